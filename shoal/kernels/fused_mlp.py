"""The SwiGLU MLP of one layer at decode sizes as one persistent launch (M <= 16, FP8 weights).

Today's MLP at batch 1 is three launches: the gate+up GEMM, SwiGLU + quantization, and the down
GEMM. Each launch pays a ramp and a drain during which HBM streams nothing (docs/performance.md:
about 4.5 µs of a standalone GEMM launch, 3 µs of each GEMM in the step), which is most of the
distance between the batch-1 step and its weight floor. This kernel is the first piece of the
persistent layer kernel that the performance notes call for: a fixed grid of co-resident
programs (at most one per SM by default) runs the three phases in turn, separated by grid-wide
barriers instead of kernel boundaries:

1. gate+up: each program takes output tiles `pid, pid + P, ...` of the gate+up product and
   stores them in bf16 (split 1, as the tuned split-K kernel at M = 1);
2. SwiGLU + quantization of 128-column groups, exactly `kernels.quant.swiglu_quantize`;
3. down: (output tile, K split) items, each storing its fp32 (or bf16) partial for the consumer
   kernel to sum (`SplitKPartials`), exactly as the split-K kernel's unreduced launch.

Every phase does the split-K kernel's arithmetic per tile in the same order, so the partials
equal the three-launch chain's bit for bit. The barriers need every program resident at once:
the grid is at most the SM count and the kernel waits for its predecessor (PDL) before its first
barrier, but lets its dependents launch only after the last one, so they cannot take the SMs its
later programs need. The Triton interpreter runs programs one after another, so there (and in
the CPU tests) each phase is its own launch without barriers (`phases`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shoal.kernels.fp8_gemm import BLOCK_K, SplitKPartials, check_weight_layout
from shoal.kernels.pdl import pdl_launch
from shoal.kernels.quant import (
    FP8_MAX,
    GROUP,
    MIN_SCALE,
    _quantize_groups,
    check_activation_scales,
    round_to_bf16,
    silu_times,
)

PHASE_GATE_UP, PHASE_SWIGLU, PHASE_DOWN = 1, 2, 4
ALL_PHASES = PHASE_GATE_UP | PHASE_SWIGLU | PHASE_DOWN
BLOCK_M = 16  # decode batches: one M tile
SYNC_MODES = {"barrier": 1, "dataflow": 2}  # the kernel's SYNC (0: one launch per phase)


@dataclass(frozen=True)
class FusedMlpConfig:
    """Tiles per phase and the grid; `programs` must all be resident at once (`resident_per_sm`).
    Three programs per SM streamed best in run 54 (one per SM left each item's ramp exposed)."""

    programs: int = 3 * 132
    block_n_up: int = 64
    block_n_down: int = 64
    split_down: int = 7
    num_warps: int = 4
    num_stages: int = 4
    tma: bool = True
    bf16_partials: bool = False
    # How the phases wait for each other in one launch: "barrier" (two grid-wide barriers) or
    # "dataflow" (per-group ready flags: each down item waits only for its K split's groups).
    sync: str = "barrier"

    def __post_init__(self) -> None:
        if self.sync not in SYNC_MODES:
            raise ValueError(f"sync must be one of {tuple(SYNC_MODES)}, got {self.sync!r}")
        if GROUP % self.block_n_up:
            raise ValueError(f"block_n_up must divide {GROUP} (a SwiGLU group's gate or up rows)")


def resident_per_sm(config: FusedMlpConfig) -> int:
    """Programs of this config that surely fit on one Hopper SM at once (228 KB of shared memory,
    64K registers): the pipeline's tiles plus 8 KB of scratch, and at most 128 registers a thread
    (the sm_90 builds of run 54 used 41 KB and 64-107 registers). Waiting programs that are not
    all resident would wait forever, so the launcher refuses more than SMs x this."""
    block_n = max(config.block_n_up, config.block_n_down)
    shared = config.num_stages * (block_n + BLOCK_M) * GROUP + 8 * 1024
    return max(1, min((227 * 1024) // shared, 65536 // (config.num_warps * 32 * 128)))


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Arrive, then wait until `target` arrivals in all (the counter only grows within a launch).
    The CTA barrier before the release orders every thread's stores before the arrival."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while arrived < target:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _tile_product(
    a_ptr, a_desc, a_scale_ptr, w_ptr, w_desc, w_scale_ptr, tile, split, offs_m, m_mask,
    N, K, stride_am, stride_asm, stride_asg, stride_wn, stride_wsn,
    BLOCK_N: tl.constexpr, BLOCK_K_: tl.constexpr, STEPS: tl.constexpr, STEPS_P2: tl.constexpr,
    W_TMA: tl.constexpr, A_TMA: tl.constexpr, BLOCK_M_: tl.constexpr,
):  # fmt: skip
    """acc[BLOCK_N, BLOCK_M] of weight rows `tile` over K steps `split * STEPS ..`: the split-K
    kernel's swapped-operand loop (scales preloaded per split, one scaled MMA per 128 columns).
    Activations and their scales may have been written by this launch: loads bypass L1."""
    k_blocks = tl.cdiv(K, BLOCK_K_)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    kb_start = split * STEPS
    steps = tl.arange(0, STEPS_P2)
    step_kb = kb_start + steps
    step_ok = (steps < STEPS) & (step_kb < k_blocks)
    w_scales = tl.load(
        w_scale_ptr + ((tile * BLOCK_N) // BLOCK_K_) * stride_wsn + step_kb, mask=step_ok, other=0.0
    )
    a_scales = tl.load(
        a_scale_ptr + offs_m[:, None] * stride_asm + step_kb[None, :] * stride_asg,
        mask=m_mask[:, None] & step_ok[None, :],
        other=0.0,
        cache_modifier=".cg",
    )
    acc = tl.zeros((BLOCK_N, BLOCK_M_), dtype=tl.float32)
    for step in range(0, STEPS):
        kb = kb_start + step
        offs_k = kb * BLOCK_K_ + tl.arange(0, BLOCK_K_)
        k_mask = offs_k < K
        if W_TMA:
            w = w_desc.load([tile * BLOCK_N, kb * BLOCK_K_])
        else:
            w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
            w = tl.load(w_rows + offs_k[None, :], mask=(offs_n < N)[:, None] & k_mask[None, :], other=0.0)
        if A_TMA:
            a = a_desc.load([0, kb * BLOCK_K_])
        else:
            a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
            a = tl.load(
                a_rows + offs_k[None, :],
                mask=m_mask[:, None] & k_mask[None, :],
                other=0.0,
                cache_modifier=".cg",
            )
        w_scale = tl.sum(tl.where(steps == step, w_scales, 0.0), 0)
        a_scale = tl.sum(tl.where((steps == step)[None, :], a_scales, 0.0), 1)
        acc += tl.dot(w, tl.trans(a)) * (a_scale[None, :] * w_scale)
    return acc


@triton.jit
def _swiglu_group(
    group, gate_up_ptr, h_ptr, h_scale_ptr, offs_m, m_mask, stride_hm, stride_hsm, stride_hsg,
    INTER: tl.constexpr, BLOCK_K_: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr,
):  # fmt: skip
    """silu(gate) * up of one 128-column group, quantized per token (`swiglu_quantize`'s math).
    gate+up was written by this launch: its loads bypass L1."""
    cols = group * BLOCK_K_ + tl.arange(0, BLOCK_K_)
    mask = m_mask[:, None] & (cols < INTER)[None, :]
    rows = gate_up_ptr + offs_m[:, None] * (2 * INTER)
    gate = tl.load(rows + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    up = tl.load(rows + INTER + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    q, scale = _quantize_groups(silu_times(gate, up), FP8_MAX_, MIN_SCALE_)
    tl.store(h_ptr + offs_m[:, None] * stride_hm + cols[None, :], q, mask=mask)
    tl.store(h_scale_ptr + offs_m * stride_hsm + group * stride_hsg, scale, mask=m_mask)


@triton.jit
def _wait_at_least(flag_ptr, target):
    """Spin until the flag reaches `target` (acquire: what its writers stored is visible)."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _fused_mlp_kernel(
    x_ptr, x_desc, x_scale_ptr, w1_ptr, w1_desc, w1_scale_ptr, gate_up_ptr,
    h_ptr, h_desc, h_scale_ptr, w2_ptr, w2_desc, w2_scale_ptr, partial_ptr, counter_ptr,
    M, stride_xm, stride_xsm, stride_xsg, stride_w1n, stride_w1sn, stride_hm, stride_hsm, stride_hsg,
    stride_w2n, stride_w2sn,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, BLOCK_M_: tl.constexpr, BLOCK_K_: tl.constexpr,
    BLOCK_N_UP: tl.constexpr, BLOCK_N_DOWN: tl.constexpr, SPLIT_DOWN: tl.constexpr,
    STEPS_UP: tl.constexpr, STEPS_UP_P2: tl.constexpr, STEPS_DOWN: tl.constexpr, STEPS_DOWN_P2: tl.constexpr,
    PROGRAMS: tl.constexpr, PHASES: tl.constexpr, SYNC: tl.constexpr, BF16_PARTIALS: tl.constexpr,
    USE_TMA: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr, FLAGS_P2: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    # SYNC 0: phases are separate launches; 1: grid barriers between phases (counter_ptr[0]);
    # 2: data flow: counter_ptr[1 + g] counts the finished gate+up tiles of SwiGLU group g, the
    # last of them runs the group's SwiGLU and bumps it once more, and a down item waits only
    # for the groups of its K split.
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M_)
    m_mask = offs_m < M
    if USE_PDL:  # wait for the input now; let dependents launch only at the very end
        tl.extra.cuda.gdc_wait()
    up_n: tl.constexpr = 2 * INTER
    groups: tl.constexpr = INTER // BLOCK_K_
    half: tl.constexpr = BLOCK_K_ // BLOCK_N_UP  # gate (or up) tiles per group
    if PHASES & 1:  # gate+up [M, 2 * INTER] in bf16, group by group: gate tiles, then up tiles
        for item in range(pid, up_n // BLOCK_N_UP, PROGRAMS):
            group = item // (2 * half)
            part = item % (2 * half)
            tile = (group * BLOCK_K_ + (part // half) * INTER) // BLOCK_N_UP + part % half
            acc = _tile_product(
                x_ptr, x_desc, x_scale_ptr, w1_ptr, w1_desc, w1_scale_ptr, tile, 0, offs_m, m_mask,
                up_n, HIDDEN, stride_xm, stride_xsm, stride_xsg, stride_w1n, stride_w1sn,
                BLOCK_N_UP, BLOCK_K_, STEPS_UP, STEPS_UP_P2, USE_TMA, USE_TMA, BLOCK_M_,
            )  # fmt: skip
            offs_n = tile * BLOCK_N_UP + tl.arange(0, BLOCK_N_UP)
            ptrs = gate_up_ptr + offs_m[None, :] * up_n + offs_n[:, None]
            tl.store(ptrs, round_to_bf16(acc), mask=(offs_n < up_n)[:, None] & m_mask[None, :])
            if SYNC == 2:
                tl.debug_barrier()  # every thread's tile is stored before the arrival
                arrived = tl.atomic_add(counter_ptr + 1 + group, 1, sem="acq_rel", scope="gpu")
                if arrived == 2 * half - 1:  # the group's last tile: its SwiGLU, then ready
                    _swiglu_group(
                        group, gate_up_ptr, h_ptr, h_scale_ptr, offs_m, m_mask, stride_hm, stride_hsm,
                        stride_hsg, INTER, BLOCK_K_, FP8_MAX_, MIN_SCALE_,
                    )  # fmt: skip
                    tl.debug_barrier()
                    tl.atomic_add(counter_ptr + 1 + group, 1, sem="release", scope="gpu")
        if SYNC == 1:
            _grid_barrier(counter_ptr, PROGRAMS)
    if PHASES & 2:  # silu(gate) * up, quantized per token per 128 columns
        for group in range(pid, groups, PROGRAMS):
            _swiglu_group(
                group, gate_up_ptr, h_ptr, h_scale_ptr, offs_m, m_mask, stride_hm, stride_hsm, stride_hsg,
                INTER, BLOCK_K_, FP8_MAX_, MIN_SCALE_,
            )  # fmt: skip
        if SYNC == 1:
            _grid_barrier(counter_ptr, 2 * PROGRAMS)
    if PHASES & 4:  # down: split-K partials [SPLIT_DOWN, M, HIDDEN], the first split first
        # The SwiGLU output comes from this launch's ordinary stores: a TMA read of it would need
        # a generic-to-async proxy fence, so only the weights come through TMA here.
        down_tiles: tl.constexpr = (HIDDEN + BLOCK_N_DOWN - 1) // BLOCK_N_DOWN
        for item in range(pid, down_tiles * SPLIT_DOWN, PROGRAMS):
            split = item // down_tiles
            tile = item % down_tiles
            if SYNC == 2:
                for group in range(split * STEPS_DOWN, tl.minimum((split + 1) * STEPS_DOWN, groups)):
                    _wait_at_least(counter_ptr + 1 + group, 2 * half + 1)
            acc = _tile_product(
                h_ptr, h_desc, h_scale_ptr, w2_ptr, w2_desc, w2_scale_ptr, tile, split, offs_m, m_mask,
                HIDDEN, INTER, stride_hm, stride_hsm, stride_hsg, stride_w2n, stride_w2sn,
                BLOCK_N_DOWN, BLOCK_K_, STEPS_DOWN, STEPS_DOWN_P2, USE_TMA, False, BLOCK_M_,
            )  # fmt: skip
            offs_n = tile * BLOCK_N_DOWN + tl.arange(0, BLOCK_N_DOWN)
            ptrs = partial_ptr + split * M * HIDDEN + offs_m[None, :] * HIDDEN + offs_n[:, None]
            if BF16_PARTIALS:
                partial = round_to_bf16(acc)
            else:
                partial = acc
            tl.store(ptrs, partial, mask=(offs_n < HIDDEN)[:, None] & m_mask[None, :])
        if SYNC != 0:  # the last program out resets the counters for the next launch / replay
            tl.debug_barrier()
            done = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
            if done == (3 if SYNC == 1 else 1) * PROGRAMS - 1:
                flags = tl.arange(0, FLAGS_P2)
                tl.store(counter_ptr + flags, 0, mask=flags < groups + 1)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


class FusedMlpWorkspace:
    """What the three phases hand each other, allocated once for up to `max_rows` tokens:
    gate+up in bf16, the quantized SwiGLU output and its scales, the down partials and the
    counters: [0] for barriers and the last program out, [1 + g] the ready flag of SwiGLU group
    g (all 0 between launches)."""

    def __init__(self, hidden: int, inter: int, max_rows: int, splits: int, device):
        self.max_rows, self.inter = max_rows, inter
        self.gate_up = torch.empty(max_rows, 2 * inter, dtype=torch.bfloat16, device=device)
        self.h = torch.empty(max_rows, inter, dtype=torch.float8_e4m3fn, device=device)
        self.h_scale_storage = torch.empty(
            triton.cdiv(inter, GROUP) * max_rows, dtype=torch.float32, device=device
        )
        # fp32 storage for up to `splits` partials; bf16 partials use a view of its first half
        self.partials = torch.empty(splits * max_rows * hidden, dtype=torch.float32, device=device)
        self.counter = torch.zeros(1 + triton.cdiv(inter, GROUP), dtype=torch.int32, device=device)

    def h_scales(self, m: int) -> torch.Tensor:
        """The [m, groups] group-major scale view the GEMM kernels read (strides (1, m))."""
        groups = triton.cdiv(self.inter, GROUP)
        return self.h_scale_storage[: groups * m].view(groups, m).t()


def fused_mlp(
    x_q: torch.Tensor,
    x_scale: torch.Tensor,
    w_up: torch.Tensor,
    w_up_scale: torch.Tensor,
    w_down: torch.Tensor,
    w_down_scale: torch.Tensor,
    workspace: FusedMlpWorkspace,
    config: FusedMlpConfig = FusedMlpConfig(),
    phases: int | None = None,
):
    """x (e4m3 [M, H] + scales) -> the down projection's partials ([splits, M, H], a
    `SplitKPartials`) of w_down(silu(gate) * up), gate | up = w_up x. `w_up` is the
    concatenated [2I, H] gate+up weight (I a multiple of 128, so no weight block straddles gate
    and up). On a GPU one launch (`config.sync` says how its phases wait); in the interpreter,
    which runs programs one after another, one launch per phase (for "dataflow": gate+up with
    each group's SwiGLU, then down). `phases` forces one launch of those phases, no waiting."""
    check_weight_layout(w_up, w_up_scale)
    check_weight_layout(w_down, w_down_scale)
    m, hidden = x_q.shape
    inter = w_down.shape[1]
    if x_q.dtype != torch.float8_e4m3fn or x_q.stride(1) != 1:
        raise ValueError("fused_mlp takes e4m3 activations with unit column stride")
    if tuple(w_up.shape) != (2 * inter, hidden) or w_down.shape[0] != hidden:
        raise ValueError(f"weights must be gate+up [{2 * inter}, {hidden}] and down [{hidden}, {inter}]")
    if inter % GROUP:
        raise ValueError(f"the intermediate size must be a multiple of {GROUP}, got {inter}")
    if workspace.inter != inter:
        raise ValueError("fused_mlp workspace was made for another intermediate size")
    if not 0 < m <= min(BLOCK_M, workspace.max_rows):
        raise ValueError(f"fused_mlp takes 1..{min(BLOCK_M, workspace.max_rows)} rows, got {m}")
    check_activation_scales(x_scale, m, hidden)
    splits = config.split_down
    storage = workspace.partials.view(torch.bfloat16) if config.bf16_partials else workspace.partials
    partials = storage[: splits * m * hidden]
    if partials.numel() < splits * m * hidden:
        raise ValueError("fused_mlp workspace holds fewer down partials than the config's split")
    interpreted = x_q.device.type != "cuda"
    dataflow = config.sync == "dataflow"
    if phases is not None:
        launches = [(phases, 0)]
    elif interpreted:
        phases_apart = (PHASE_GATE_UP, PHASE_DOWN) if dataflow else (PHASE_GATE_UP, PHASE_SWIGLU, PHASE_DOWN)
        launches = [(phase, SYNC_MODES[config.sync] if dataflow else 0) for phase in phases_apart]
    else:
        launches = [(PHASE_GATE_UP | PHASE_DOWN if dataflow else ALL_PHASES, SYNC_MODES[config.sync])]
    programs = config.programs
    if not interpreted and launches[0][1]:
        sms = torch.cuda.get_device_properties(x_q.device).multi_processor_count
        if programs > sms * resident_per_sm(config):
            raise ValueError(
                f"{programs} programs that wait for each other cannot all be resident: "
                f"{sms} SMs x {resident_per_sm(config)}"
            )
    h, gate_up = workspace.h[:m], workspace.gate_up[:m]
    h_scale = workspace.h_scales(m)
    h_desc = h  # read with plain loads (phase 3's comment)
    if config.tma:
        x_desc = TensorDescriptor.from_tensor(x_q, [BLOCK_M, BLOCK_K])
        w1_desc = TensorDescriptor.from_tensor(w_up, [config.block_n_up, BLOCK_K])
        w2_desc = TensorDescriptor.from_tensor(w_down, [config.block_n_down, BLOCK_K])
    else:
        x_desc, w1_desc, w2_desc = x_q, w_up, w_down  # unused pointers
    steps_up = triton.cdiv(hidden, BLOCK_K)
    steps_down = triton.cdiv(triton.cdiv(inter, BLOCK_K), splits)
    for phase_mask, sync in launches:
        _fused_mlp_kernel[(programs,)](
            x_q, x_desc, x_scale, w_up, w1_desc, w_up_scale, gate_up,
            h, h_desc, h_scale, w_down, w2_desc, w_down_scale, partials, workspace.counter,
            m, x_q.stride(0), x_scale.stride(0), x_scale.stride(1), w_up.stride(0), w_up_scale.stride(0),
            h.stride(0), h_scale.stride(0), h_scale.stride(1), w_down.stride(0), w_down_scale.stride(0),
            HIDDEN=hidden, INTER=inter, BLOCK_M_=BLOCK_M, BLOCK_K_=BLOCK_K,
            BLOCK_N_UP=config.block_n_up, BLOCK_N_DOWN=config.block_n_down, SPLIT_DOWN=splits,
            STEPS_UP=steps_up, STEPS_UP_P2=max(2, triton.next_power_of_2(steps_up)),
            STEPS_DOWN=steps_down, STEPS_DOWN_P2=max(2, triton.next_power_of_2(steps_down)),
            PROGRAMS=programs, PHASES=phase_mask, SYNC=sync, BF16_PARTIALS=config.bf16_partials,
            USE_TMA=config.tma, FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE,
            FLAGS_P2=triton.next_power_of_2(1 + inter // GROUP),
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(),
        )  # fmt: skip
    return SplitKPartials(partials.view(splits, m, hidden))
