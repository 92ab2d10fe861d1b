"""Stream-K for the block-scaled FP8 GEMM at decode sizes (M <= 16, pre-quantized activations).

At M = 1 the GEMM is a pure weight stream: the time is the weight bytes over HBM bandwidth plus
whatever the launch wastes. Split-K (`kernels/fp8_gemm.py`) cuts the weights into output tiles x
K splits, one program each: the down projection at M = 1 is 280 programs of 11 K steps on 132
SMs. Each program pays its pipeline's ramp and drain, and the programs do not end together, so
it reached 57% of copy bandwidth (docs/performance.md run 18) against 80% for gate+up.

Here the weights are one list of units (a BLOCK_N x 128 weight tile: one output tile, one K
step), output tile after output tile, and each of a fixed number of programs (about one or two
per SM) streams an equal run of consecutive units in one software-pipelined loop. A run crosses
output tiles: at the end of each tile's part it stores its fp32 (or bf16) partial in a slot, so
the tiles that k-runs cross have several slots:

- slot `s` of tile `t` belongs to the `s`-th program whose run covers part of `t` (fixed by the
  launch, so the sum over slots in slot order is deterministic);
- `SLOTS` is the most slots any tile has; the program holding slot 0 writes zeros into the slots
  its tile does not use, so a consumer may sum all `SLOTS` partials (`SplitKPartials`);
- reduced launches count arrivals per tile; the last program to arrive sums the tile's slots in
  slot order and stores bf16, then resets the counter (a workspace stays reusable, graph-safe).

Same arithmetic per unit as the split-K kernel (one scaled MMA per 128-wide K step, fp32 sums);
the summation order over K differs, so results match it to rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal.kernels.pdl import wait_for_inputs
from shoal.kernels.quant import round_to_bf16

MAX_ROWS = 16  # one M tile of 16 rows (decode batches); larger M keeps split-K's 2-D tiling


@dataclass(frozen=True)
class StreamKPlan:
    """How the units of one (M, N, K, BLOCK_N, programs) launch are dealt out."""

    n_tiles: int
    k_blocks: int
    units_per_program: int
    programs: int
    slots: int

    @property
    def units(self) -> int:
        return self.n_tiles * self.k_blocks

    def tile_slots(self, tile: int) -> int:
        """How many programs' runs cover part of output tile `tile`."""
        first, last = tile * self.k_blocks, (tile + 1) * self.k_blocks - 1
        return last // self.units_per_program - first // self.units_per_program + 1

    @staticmethod
    def make(n: int, k: int, block_n: int, block_k: int, target_programs: int) -> StreamKPlan:
        n_tiles, k_blocks = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
        units = n_tiles * k_blocks
        per_program = triton.cdiv(units, max(1, target_programs))
        plan = StreamKPlan(n_tiles, k_blocks, per_program, triton.cdiv(units, per_program), 1)
        slots = max(plan.tile_slots(t) for t in range(n_tiles))
        return StreamKPlan(n_tiles, k_blocks, per_program, plan.programs, slots)


@triton.jit
def _unit_scales(
    unit, w_scale_ptr, a_scale_ptr, offs_m, m_mask, stride_wsn, stride_wsk, stride_asm, stride_asg,
    K_BLOCKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K_: tl.constexpr,
):  # fmt: skip
    """A unit's weight-block scale (scalar) and its K step's activation scales ([BLOCK_M])."""
    kb = unit % K_BLOCKS
    scale_row = ((unit // K_BLOCKS) * BLOCK_N) // BLOCK_K_
    w_scale = tl.load(w_scale_ptr + scale_row * stride_wsn + kb * stride_wsk)
    a_scale = tl.load(a_scale_ptr + offs_m * stride_asm + kb * stride_asg, mask=m_mask, other=0.0)
    return w_scale, a_scale


@triton.jit(do_not_specialize=["M", "stride_asg"])
def _fp8_gemm_stream_k_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    a_desc,
    w_desc,
    w_scale_ptr,
    out_ptr,
    partial_ptr,
    counter_ptr,
    M,
    N,
    K,
    stride_am,
    stride_asm,
    stride_asg,
    stride_wn,
    stride_wsn,
    stride_wsk,
    stride_om,
    N_TILES: tl.constexpr,
    K_BLOCKS: tl.constexpr,
    UNITS_PER_PROGRAM: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K_: tl.constexpr,
    LEAVE_PARTIALS: tl.constexpr,
    BF16_PARTIALS: tl.constexpr,
    USE_TMA: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    total_units = N_TILES * K_BLOCKS
    first = pid * UNITS_PER_PROGRAM
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    wait_for_inputs(USE_PDL)
    # Each unit's two scales are loaded one unit ahead (loop-carried): the pipeliner prefetches
    # only the loads that feed the MMA, and selecting from a preloaded vector of the whole run
    # cost a cross-lane reduction per unit, which one program per SM cannot hide.
    w_scale_next, a_scale_next = _unit_scales(
        tl.minimum(first, total_units - 1), w_scale_ptr, a_scale_ptr, offs_m, m_mask,
        stride_wsn, stride_wsk, stride_asm, stride_asg, K_BLOCKS, BLOCK_N, BLOCK_K_,
    )  # fmt: skip
    split_stride = M * N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for step in range(0, UNITS_PER_PROGRAM):
        unit = tl.minimum(first + step, total_units - 1)
        tile = unit // K_BLOCKS
        kb = unit % K_BLOCKS
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = kb * BLOCK_K_ + tl.arange(0, BLOCK_K_)
        if USE_TMA:  # zero-filled past N and K, like the masked loads
            w = w_desc.load([tile * BLOCK_N, kb * BLOCK_K_])
            a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K_])
        else:
            k_mask = offs_k < K
            w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
            w = tl.load(w_rows + offs_k[None, :], mask=(offs_n < N)[:, None] & k_mask[None, :], other=0.0)
            a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
            a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        # Past the end of the units (the last program's short run) the scale is 0: nothing added.
        w_scale = tl.where(first + step < total_units, w_scale_next, 0.0)
        a_scale = a_scale_next
        w_scale_next, a_scale_next = _unit_scales(
            tl.minimum(first + step + 1, total_units - 1), w_scale_ptr, a_scale_ptr, offs_m, m_mask,
            stride_wsn, stride_wsk, stride_asm, stride_asg, K_BLOCKS, BLOCK_N, BLOCK_K_,
        )  # fmt: skip
        acc += tl.dot(w, tl.trans(a)) * (a_scale[None, :] * w_scale)
        # The end of this tile's part of the run: store the partial in this program's slot.
        if (first + step < total_units) & ((kb == K_BLOCKS - 1) | (step == UNITS_PER_PROGRAM - 1)):
            tile_first = (tile * K_BLOCKS) // UNITS_PER_PROGRAM
            slot = pid - tile_first
            used = (tile * K_BLOCKS + K_BLOCKS - 1) // UNITS_PER_PROGRAM - tile_first + 1
            n_mask = offs_n < N
            tile_mask = n_mask[:, None] & m_mask[None, :]
            tile_offsets = offs_m[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M], int32
            out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            if BF16_PARTIALS:
                partial = round_to_bf16(acc)
            else:
                partial = acc
            if LEAVE_PARTIALS:  # the consumer sums every slot: unused ones must read zero
                tl.store(partial_ptr + slot * split_stride + tile_offsets, partial, mask=tile_mask)
                if slot == 0:
                    for spare in range(1, SLOTS):
                        tl.store(
                            partial_ptr + spare * split_stride + tile_offsets,
                            tl.zeros_like(partial),
                            mask=tile_mask & (spare >= used),
                        )
            elif used == 1:  # the whole tile in this run: no partial, no arrival
                tl.store(out_ptrs, round_to_bf16(acc), mask=tile_mask)
            else:
                tl.store(partial_ptr + slot * split_stride + tile_offsets, partial, mask=tile_mask)
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if not LEAVE_PARTIALS:
        # Arrivals after the loop: an atomic inside it stops Triton from pipelining the loads.
        # Only the run's first and last tiles can be shared with other programs.
        tl.debug_barrier()  # every thread's partials are written before the releases below
        last = tl.minimum(first + UNITS_PER_PROGRAM, total_units) - 1
        _arrive_and_reduce(
            first // K_BLOCKS, out_ptr, partial_ptr, counter_ptr, offs_m, m_mask, N, split_stride,
            stride_om, N_TILES, K_BLOCKS, UNITS_PER_PROGRAM, SLOTS, BLOCK_N, pid_m,
        )  # fmt: skip
        if last // K_BLOCKS != first // K_BLOCKS:
            _arrive_and_reduce(
                last // K_BLOCKS, out_ptr, partial_ptr, counter_ptr, offs_m, m_mask, N, split_stride,
                stride_om, N_TILES, K_BLOCKS, UNITS_PER_PROGRAM, SLOTS, BLOCK_N, pid_m,
            )  # fmt: skip


@triton.jit
def _arrive_and_reduce(
    tile, out_ptr, partial_ptr, counter_ptr, offs_m, m_mask, N, split_stride, stride_om,
    N_TILES: tl.constexpr, K_BLOCKS: tl.constexpr, UNITS_PER_PROGRAM: tl.constexpr,
    SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, pid_m,
):  # fmt: skip
    """Count this program's partial of a shared tile; the last to arrive sums the tile's slots
    in slot order (independent of arrival order), stores bf16 and resets the counter."""
    tile_first = (tile * K_BLOCKS) // UNITS_PER_PROGRAM
    used = (tile * K_BLOCKS + K_BLOCKS - 1) // UNITS_PER_PROGRAM - tile_first + 1
    if used > 1:
        counter = counter_ptr + pid_m * N_TILES + tile
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == used - 1:
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            tile_mask = (offs_n < N)[:, None] & m_mask[None, :]
            tile_offsets = offs_m[None, :] * N + offs_n[:, None]
            total = tl.zeros((BLOCK_N, offs_m.shape[0]), dtype=tl.float32)
            for s in range(SLOTS):
                total += tl.load(
                    partial_ptr + s * split_stride + tile_offsets,
                    mask=tile_mask & (s < used),
                    other=0.0,
                    cache_modifier=".cg",
                ).to(tl.float32)
            out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_om + offs_n[:, None]
            tl.store(out_ptrs, round_to_bf16(total), mask=tile_mask)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def launch_stream_k(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    partials: torch.Tensor,
    counters: torch.Tensor,
    plan: StreamKPlan,
    *,
    block_n: int,
    block_k: int,
    bf16_partials: bool,
    leave_partials: bool,
    use_tma: bool,
    num_warps: int,
    num_stages: int,
    launch: dict,
) -> None:
    """One stream-K launch; the caller (`fp8_gemm._launch`) has checked the operands and sized
    the workspace (`partials` in the partial dtype, `counters` zeroed)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = a.shape
    n = w_q.shape[0]
    if use_tma:
        a_desc = TensorDescriptor.from_tensor(a, [MAX_ROWS, block_k])
        w_desc = TensorDescriptor.from_tensor(w_q, [block_n, block_k])
    else:
        a_desc, w_desc = a, w_q  # unused pointers
    _fp8_gemm_stream_k_kernel[(plan.programs, triton.cdiv(m, MAX_ROWS))](
        a,
        a_scale,
        w_q,
        a_desc,
        w_desc,
        w_scale,
        out,
        partials,
        counters,
        m,
        n,
        k,
        a.stride(0),
        a_scale.stride(0),
        a_scale.stride(1),
        w_q.stride(0),
        w_scale.stride(0),
        w_scale.stride(1),
        out.stride(0),
        N_TILES=plan.n_tiles,
        K_BLOCKS=plan.k_blocks,
        UNITS_PER_PROGRAM=plan.units_per_program,
        SLOTS=plan.slots,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K_=block_k,
        LEAVE_PARTIALS=leave_partials,
        BF16_PARTIALS=bf16_partials,
        USE_TMA=use_tma,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch,
    )
