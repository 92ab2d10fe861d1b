"""Block-scaled FP8 GEMM for decode shapes (M <= 128): out[M, N] = A[M, K] @ W[N, K]^T in bf16.

Weights are e4m3 [N, K] with one fp32 scale per 128x128 block (`w_scale[n // 128, k // 128]`,
row-major contiguous). Three ways to feed the activations (a compile-time `ACT_MODE`):

- `ACT_BF16`: bf16 activations, weights dequantized in registers (W8A16, no activation rounding);
- `ACT_FP8`: activations already quantized by `kernels/quant.py` (e4m3 + [M, K/128] scales);
- `ACT_QUANT_INLINE`: bf16 activations quantized per token per 128 columns inside the GEMM, with
  exactly the numerics of `kernels/quant.py`, so no quantization launch at all.

`SWIGLU` (with the bf16 and inline modes) reads A as the gate+up output [M, 2K] and applies
silu(gate) * up while loading, so the down projection needs no separate activation kernel.

At small M a plain tiling leaves most of the 132 SMs idle, and a memory-bound GEMM needs every SM
streaming weights. Split-K fixes that: `SPLIT_K` programs share one output tile, each writes an fp32
partial to a workspace and bumps a per-tile counter; the last to arrive sums the partials in fixed
order (deterministic), writes bf16 and resets the counter to 0. One launch, no host sync, no
allocation when the caller passes `out` and a `SplitKWorkspace`: safe to capture in a CUDA graph.
With `unreduced=True` the programs only write their partials and the caller gets them as a
`SplitKPartials`, for a consumer kernel to sum while loading them (no atomic, no reduction here).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from shoal.kernels.pdl import pdl_launch, wait_for_inputs
from shoal.kernels.quant import (
    FP8_MAX,
    GROUP,
    MIN_SCALE,
    _quantize_groups,
    check_activation_scales,
    round_to_bf16,
    silu_times,
)
from shoal.kernels.tuned import FP8_GEMM, config_fields, keyed_entries, read_table, update_table

ACT_BF16 = 0
ACT_FP8 = 1
ACT_QUANT_INLINE = 2
BLOCK_K = GROUP  # one weight-scale column per K step
H200_SMS = 132
# Triton's CPU interpreter multiplies bf16 tensors as raw uint16; there the W8A16 dot runs in fp32.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
# Activation scales for a whole split are preloaded into registers up to BLOCK_M x steps this big.
PRELOAD_A_SCALES_LIMIT = 2048


@dataclass(frozen=True)
class GemmConfig:
    """Launch parameters; the benchmark's `--sweep` searches these per (N, K, M bucket)."""

    block_m: int
    block_n: int  # divides 128: a tile's rows share one weight-scale row
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    # Compute out^T = W @ A^T: the weight tile is the MMA's M side (>= 64 rows reach Hopper's
    # wgmma, and in W8A16 the dequantized tile can feed it from registers), M becomes the N side.
    swap_ab: bool = False
    # Pre-quantized activations and weights through Hopper's tensor memory accelerator (TMA
    # descriptors: bulk async tile copies, out-of-range rows and columns zero-filled) instead of
    # per-thread pointer loads. W8A8 only; needs K % 16 == 0 (16-byte aligned rows).
    tma: bool = False
    # Split-K partials stored as bf16 (each rounded once, summed in fp32 in split order) instead
    # of fp32: half the partial bytes written and read back. The output's bits change, so only
    # with the correctness gate's consent.
    bf16_partials: bool = False
    # Pre-quantized activations: each K step's two scales are loaded one step ahead (carried
    # through the loop) instead of picked out of vectors preloaded for the whole split, a
    # cross-warp reduction with CTA barriers every step. The same bits either way.
    scales_ahead: bool = False
    # Pre-quantized activations on Hopper: the Gluon kernel (`kernels/fp8_gemm_gluon.py`), swapped
    # tiles or not as `swap_ab` says, always TMA (`tma` unused); the same bits as this config with
    # tma and scales_ahead, which is what runs where Gluon cannot (CPU interpreter, other GPUs).
    gluon: bool = False
    # With `gluon`: weight tiles (<= num_stages) each program copies before the PDL wait, so that
    # much of the weight stream overlaps the kernel before the GEMM.
    tiles_before_wait: int = 0
    # With `gluon`: each K step's activation scales come through the TMA ring with its tiles
    # (`kernels/fp8_gemm_gluon.py`), `num_stages` steps ahead instead of one, and the next weight
    # scale is loaded right after the MMAs, before the refill copies (the Triton kernel's order);
    # launches with M not a multiple of 4 load the activation scales by pointer
    # (`fp8_gemm_gluon.flat_scales`). The same bits.
    tma_scales: bool = False
    # With `gluon`: the output tile (or split-K partials) converted through shared memory to a
    # layout of 16 contiguous bytes per thread before its store, instead of stored from the
    # wgmma accumulator's layout (2-4 bytes per store instruction). The same bits.
    vector_stores: bool = False


GemmKey = tuple[int, int, int]  # (N, K, M bucket)


def _tuned_tables() -> tuple[Mapping[GemmKey, GemmConfig], Mapping[GemmKey, GemmConfig]]:
    raw = read_table(FP8_GEMM)

    def table(kind: str) -> Mapping[GemmKey, GemmConfig]:
        return MappingProxyType({
            (entry.pop("n"), entry.pop("k"), entry.pop("m")): GemmConfig(**entry) for entry in raw[kind]
        })  # fmt: skip

    return table("w8a16"), table("w8a8")


# Configs per (N, K, M bucket) from `kernels/tuned/fp8_gemm.json`, for bf16 activations
# (`TUNED_CONFIGS`) and for pre-quantized or inline-quantized ones (`TUNED_CONFIGS_FP8`); other
# shapes take `default_config`. Small M runs swapped tiles (the weight rows fill the MMA's M side)
# split over K until every SM streams weights; M = 64 runs unswapped 64-row activation tiles.
TUNED_CONFIGS, TUNED_CONFIGS_FP8 = _tuned_tables()


def write_tuned_table(
    winners: Mapping[GemmKey, GemmConfig], fp8_activations: bool, directory: Path | None = None
) -> Path:
    """Merge sweep winners into `kernels/tuned/fp8_gemm.json` (other entries kept)."""
    kind = "w8a8" if fp8_activations else "w8a16"
    fields = {key: config_fields(config) for key, config in winners.items()}

    def change(table: dict) -> dict:
        table[kind] = keyed_entries(table[kind], fields, ("n", "k", "m"))
        return table

    return update_table(FP8_GEMM, change, directory)


def m_bucket(m: int) -> int:
    """The smallest bucket >= m (buckets are powers of two up to 128; larger M uses 128's row)."""
    for bucket in M_BUCKETS:
        if m <= bucket:
            return bucket
    return M_BUCKETS[-1]


def _multiprocessors(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return H200_SMS


def default_config(n: int, k: int, m: int, sms: int = H200_SMS) -> GemmConfig:
    """Heuristic: tiles sized to M, then split K until about two programs per SM stream weights."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    m_tiles = triton.cdiv(m, block_m)
    block_n = 128 if m_tiles * triton.cdiv(n, 128) >= sms else 64
    tiles = m_tiles * triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, BLOCK_K)
    split_k = max(1, min(triton.cdiv(2 * sms, tiles), k_blocks // 2, 16))
    return GemmConfig(block_m, block_n, split_k, num_warps=4, num_stages=4)


def pick_config(
    n: int, k: int, m: int, device: torch.device | None = None, fp8_activations: bool = False
) -> GemmConfig:
    table = TUNED_CONFIGS_FP8 if fp8_activations else TUNED_CONFIGS
    config = table.get((n, k, m_bucket(m)))
    if config is None:
        sms = _multiprocessors(device) if device is not None else H200_SMS
        config = default_config(n, k, m, sms)
    if _bf16_partials_everywhere and config.split_k > 1:
        config = dataclasses.replace(config, bf16_partials=True)
    return config


_bf16_partials_everywhere = False


@contextlib.contextmanager
def bf16_partials_everywhere() -> Iterator[None]:
    """Every split-K config `pick_config` hands out stores bf16 partials meanwhile: how
    `shoal gate correctness --bf16-partials` judges `GemmConfig.bf16_partials` before a tuned
    table adopts it."""
    global _bf16_partials_everywhere
    before, _bf16_partials_everywhere = _bf16_partials_everywhere, True
    try:
        yield
    finally:
        _bf16_partials_everywhere = before


class SplitKWorkspace:
    """fp32 partials + int32 per-tile counters for split-K. Counters start at 0 and every launch
    leaves them at 0, so one workspace serves every GEMM on a stream, across graph replays."""

    def __init__(self, max_partial_elements: int, max_tiles: int, device: torch.device | str):
        self.partials = torch.empty(max(1, max_partial_elements), dtype=torch.float32, device=device)
        self.counters = torch.zeros(max(1, max_tiles), dtype=torch.int32, device=device)

    @staticmethod
    def required(m: int, n: int, config: GemmConfig) -> tuple[int, int]:
        """(fp32 partial elements, counters) a launch with this config needs (bf16 partials
        take half the fp32 elements)."""
        if config.split_k == 1:
            return 0, 0
        tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
        partials = config.split_k * m * n
        return (partials + 1) // 2 if config.bf16_partials else partials, tiles

    def partials_for(self, config: GemmConfig) -> torch.Tensor:
        """The flat partial buffer in the config's partial dtype (one memory, two views)."""
        return self.partials.view(torch.bfloat16) if config.bf16_partials else self.partials

    def check(self, m: int, n: int, config: GemmConfig) -> None:
        partials, tiles = self.required(m, n, config)
        if partials > self.partials.numel() or tiles > self.counters.numel():
            raise ValueError(
                f"split-K workspace too small: need {partials} partials and {tiles} counters, "
                f"have {self.partials.numel()} and {self.counters.numel()}"
            )


@dataclass(frozen=True)
class SplitKPartials:
    """A split-K GEMM's output left unreduced (`unreduced=True`): the partials [splits, M, N]
    (fp32, or bf16 with `GemmConfig.bf16_partials`) in the split-K workspace. The GEMM's result is
    their fp32 sum in split order, rounded to bf16, exactly what the reducing epilogue would
    store; a consumer kernel that sums them while loading its input (`kernels/norm_rope.rms_norm`)
    saves the GEMM its arrival atomic, fence and last-program reduction. They live in the shared
    workspace: valid only until the next split-K launch on it."""

    parts: torch.Tensor

    def __post_init__(self) -> None:
        parts = self.parts
        if parts.dtype not in (torch.float32, torch.bfloat16) or parts.dim() != 3 or parts.stride(2) != 1:
            raise ValueError(
                "split-K partials must be float32 or bfloat16 [splits, M, N] with contiguous rows"
            )

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def reduce(self) -> torch.Tensor:
        """The bf16 result, summed in the kernel's order (tests, and consumers without the fusion)."""
        total = torch.zeros_like(self.parts[0], dtype=torch.float32)
        for part in self.parts:
            total += part.float()
        return total.to(torch.bfloat16)


_default_workspaces: dict[torch.device, SplitKWorkspace] = {}


def _workspace_for(device: torch.device, m: int, n: int, config: GemmConfig) -> SplitKWorkspace:
    """A lazily grown per-device workspace, for callers (tests, eager use) that pass none."""
    need_partials, need_tiles = SplitKWorkspace.required(m, n, config)
    current = _default_workspaces.get(device)
    if current is None or current.partials.numel() < need_partials or current.counters.numel() < need_tiles:
        have_p = current.partials.numel() if current else 0
        have_t = current.counters.numel() if current else 0
        current = SplitKWorkspace(max(need_partials, have_p), max(need_tiles, have_t), device)
        _default_workspaces[device] = current
    return current


@triton.jit
def _load_activation_tile(a_ptr, offs_m, offs_k, m_mask, k_mask, stride_am, K, SWIGLU: tl.constexpr):
    """[BLOCK_M, BLOCK_K] fp32 activations; with SWIGLU, silu(gate) * up of a [M, 2K] input."""
    rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
    mask = m_mask[:, None] & k_mask[None, :]
    if SWIGLU:
        gate = tl.load(rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(rows + K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        return silu_times(gate, up)
    return tl.load(rows + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)


# M (and the activation-scale stride, which equals M) is not specialized: one binary per (shape,
# config) serves every M of a bucket, which keeps the benchmark's sweep affordable.
@triton.jit(do_not_specialize=["M", "stride_asg"])
def _fp8_gemm_kernel(
    a_ptr, a_scale_ptr, w_ptr, a_desc, w_desc, w_scale_ptr, out_ptr, partial_ptr, counter_ptr, M, N, K,
    k_blocks, stride_am, stride_asm, stride_asg, stride_wn, stride_wsn, stride_wsk, stride_om,
    ACT_MODE: tl.constexpr, SWIGLU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K_: tl.constexpr, SPLIT_K: tl.constexpr, LEAVE_PARTIALS: tl.constexpr, BF16_PARTIALS: tl.constexpr,
    STEPS_PER_SPLIT: tl.constexpr, STEPS_P2: tl.constexpr, PRELOAD_A_SCALES: tl.constexpr,
    SCALES_AHEAD: tl.constexpr, SWAP_AB: tl.constexpr, DOT_IN_FP32: tl.constexpr, FP8_MAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr, USE_TMA: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    # Grid (m tiles, n tiles, splits): the M tiles of one weight tile run back to back (L2 reuse).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    kb_start = pid_k * STEPS_PER_SPLIT

    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    # Scales for all of this split's K steps, loaded once before the loop: a scale load inside
    # the loop is not software-pipelined and would expose a memory latency every step.
    # BLOCK_N divides 128, so the tile's rows share one weight-scale row: one scalar per step.
    steps = tl.arange(0, STEPS_P2)
    step_kb = kb_start + steps
    step_ok = (steps < STEPS_PER_SPLIT) & (step_kb < k_blocks)
    w_scale_row = w_scale_ptr + ((pid_n * BLOCK_N) // BLOCK_K_) * stride_wsn
    w_scales = tl.load(w_scale_row + step_kb * stride_wsk, mask=step_ok, other=0.0)
    # Everything above reads constants of the step (weights, their scales); from here on the
    # inputs may come from the previous kernel.
    wait_for_inputs(USE_PDL)
    if ACT_MODE == 1:
        if PRELOAD_A_SCALES:
            a_scales = tl.load(
                a_scale_ptr + offs_m[:, None] * stride_asm + step_kb[None, :] * stride_asg,
                mask=m_mask[:, None] & step_ok[None, :],
                other=0.0,
            )
    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCALES_AHEAD:  # ACT_MODE 1 only (the launcher's check)
        w_scale_next = tl.load(w_scale_row + kb_start * stride_wsk, mask=kb_start < k_blocks, other=0.0)
        a_scale_next = tl.load(
            a_scale_ptr + offs_m * stride_asm + kb_start * stride_asg,
            mask=m_mask & (kb_start < k_blocks),
            other=0.0,
        )
    # A fixed trip count (the last split may run past K: those steps load nothing and add zero).
    for step in range(0, STEPS_PER_SPLIT):
        kb = kb_start + step
        offs_k = kb * BLOCK_K_ + tl.arange(0, BLOCK_K_)
        k_mask = offs_k < K
        if USE_TMA:  # zero-filled past N and K, like the masked load
            w = w_desc.load([pid_n * BLOCK_N, kb * BLOCK_K_])
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if SCALES_AHEAD:
            w_scale = w_scale_next
            a_scale_now = a_scale_next
        else:
            w_scale = tl.sum(tl.where(steps == step, w_scales, 0.0), 0)
        if ACT_MODE == 1:  # pre-quantized e4m3 activations + per-token group scales
            if USE_TMA:
                a = a_desc.load([pid_m * BLOCK_M, kb * BLOCK_K_])
            else:
                a_rows = a_ptr + offs_m[:, None].to(tl.int64) * stride_am
                a = tl.load(a_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if SCALES_AHEAD:
                a_scale = a_scale_now
            elif PRELOAD_A_SCALES:
                a_scale = tl.sum(tl.where((steps == step)[None, :], a_scales, 0.0), 1)
            else:
                a_scale_ptrs = a_scale_ptr + offs_m * stride_asm + kb * stride_asg
                a_scale = tl.load(a_scale_ptrs, mask=m_mask & (kb < k_blocks), other=0.0)
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(a)) * (a_scale[None, :] * w_scale)
            else:
                acc += tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale)
            if SCALES_AHEAD:
                # Issued after this step's scales were last used, so the loads land in the
                # registers that carry them and need to arrive only at the next step's multiply
                # (issued earlier, the loop copied them at its back edge and waited there).
                following = kb + 1
                w_scale_next = tl.load(
                    w_scale_row + following * stride_wsk, mask=following < k_blocks, other=0.0
                )
                a_scale_next = tl.load(
                    a_scale_ptr + offs_m * stride_asm + following * stride_asg,
                    mask=m_mask & (following < k_blocks),
                    other=0.0,
                )
        elif ACT_MODE == 2:  # quantize this 128-column group of every token in registers
            a = _load_activation_tile(a_ptr, offs_m, offs_k, m_mask, k_mask, stride_am, K, SWIGLU)
            a_q, a_scale = _quantize_groups(a, FP8_MAX_, MIN_SCALE_)
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(a_q)) * (a_scale[None, :] * w_scale)
            else:
                acc += tl.dot(a_q, tl.trans(w)) * (a_scale[:, None] * w_scale)
        else:  # bf16 activations, e4m3 -> bf16 is exact; the block scale multiplies the partial
            a = _load_activation_tile(a_ptr, offs_m, offs_k, m_mask, k_mask, stride_am, K, SWIGLU)
            if DOT_IN_FP32:  # same products (bf16 and e4m3 values are exact in fp32), fp32 sum
                a_op = round_to_bf16(a).to(tl.float32)
                w_op = w.to(tl.float32)
            else:
                a_op = round_to_bf16(a)
                w_op = w.to(tl.bfloat16)
            if SWAP_AB:
                acc += tl.dot(w_op, tl.trans(a_op)) * w_scale
            else:
                acc += tl.dot(a_op, tl.trans(w_op)) * w_scale
    if SWAP_AB:
        acc = tl.trans(acc)

    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, round_to_bf16(acc), mask=out_mask)
    else:
        tile_offsets = offs_m[:, None] * N + offs_n[None, :]  # int32: split_k * M * N < 2**31
        split_stride = M * N
        if BF16_PARTIALS:
            partial = round_to_bf16(acc)
        else:
            partial = acc
        tl.store(partial_ptr + pid_k * split_stride + tile_offsets, partial, mask=out_mask)
        if not LEAVE_PARTIALS:  # else the consumer sums them (`SplitKPartials`)
            tl.debug_barrier()  # every thread's partial is written before the release below
            tile = pid_m * tl.num_programs(1) + pid_n
            arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT_K):  # fixed order: the result does not depend on arrival order
                    total += tl.load(
                        partial_ptr + s * split_stride + tile_offsets,
                        mask=out_mask,
                        other=0.0,
                        cache_modifier=".cg",
                    ).to(tl.float32)
                tl.store(out_ptrs, round_to_bf16(total), mask=out_mask)
                tl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


def check_weight_layout(w_q: torch.Tensor, w_scale: torch.Tensor) -> None:
    """Raise unless the weight and its scales are exactly the layout the kernel indexes."""
    if w_q.dtype != torch.float8_e4m3fn or w_q.dim() != 2 or w_q.stride(1) != 1:
        raise ValueError(f"weight must be float8_e4m3fn [N, K] with unit column stride, got {w_q.dtype}")
    n, k = w_q.shape
    expected = (triton.cdiv(n, 128), triton.cdiv(k, 128))
    if w_scale.dtype != torch.float32 or tuple(w_scale.shape) != expected:
        raise ValueError(
            f"weight_scale must be float32 {list(expected)}, got {w_scale.dtype} {list(w_scale.shape)}"
        )
    if not w_scale.is_contiguous():
        raise ValueError(f"weight_scale must be row-major contiguous, got strides {w_scale.stride()}")


def kernel_constants(mode: int, swiglu: bool, k: int, config: GemmConfig, leave_partials: bool) -> dict:
    """The split-K kernel's compile-time arguments for a launch (all but USE_PDL), in one place
    for `_launch` and for `scripts/inspect_gemm_sm90.py`, which compiles what a launch would."""
    steps = triton.cdiv(triton.cdiv(k, BLOCK_K), config.split_k)
    steps_p2 = max(2, triton.next_power_of_2(steps))
    return {
        "ACT_MODE": mode, "SWIGLU": swiglu, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
        "BLOCK_K_": BLOCK_K, "SPLIT_K": config.split_k, "LEAVE_PARTIALS": leave_partials,
        "BF16_PARTIALS": config.bf16_partials and config.split_k > 1, "STEPS_PER_SPLIT": steps,
        "STEPS_P2": steps_p2,
        "PRELOAD_A_SCALES": config.block_m * steps_p2 <= PRELOAD_A_SCALES_LIMIT and not config.scales_ahead,
        "SCALES_AHEAD": config.scales_ahead, "SWAP_AB": config.swap_ab, "DOT_IN_FP32": _INTERPRETED,
        "FP8_MAX_": FP8_MAX, "MIN_SCALE_": MIN_SCALE, "USE_TMA": config.tma and mode == ACT_FP8,
    }  # fmt: skip


def _launch(
    mode: int, a: torch.Tensor, a_scale: torch.Tensor | None, w_q: torch.Tensor, w_scale: torch.Tensor,
    swiglu: bool, out: torch.Tensor | None, workspace: SplitKWorkspace | None, config: GemmConfig | None,
    unreduced: bool = False,
) -> torch.Tensor | SplitKPartials:  # fmt: skip
    check_weight_layout(w_q, w_scale)
    n, k = w_q.shape
    if a.dim() != 2 or a.stride(1) != 1:
        raise ValueError("activations must be 2-D with unit column stride")
    m = a.shape[0]
    if a.shape[1] != (2 * k if swiglu else k):
        raise ValueError(
            f"activations have {a.shape[1]} columns, weight expects {k}{' x 2' if swiglu else ''}"
        )
    if out is None:
        out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    if out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or out.stride(1) != 1:
        raise ValueError(f"out must be bfloat16 [{m}, {n}] with unit column stride")
    if m == 0:
        return out
    if config is None:
        config = pick_config(n, k, m, a.device, fp8_activations=mode != ACT_BF16)
    if config.gluon and (mode != ACT_FP8 or not _gluon_runs(a.device)):  # its Triton equivalent
        config = dataclasses.replace(config, gluon=False, tma=True, scales_ahead=True)
    if config.scales_ahead and mode != ACT_FP8:
        config = dataclasses.replace(config, scales_ahead=False)  # the scales of quantized inputs
    if config.block_n > BLOCK_K or BLOCK_K % config.block_n:
        raise ValueError(f"block_n must divide {BLOCK_K} (one weight-scale row per tile): {config}")
    if workspace is None:
        workspace = _workspace_for(a.device, m, n, config)
    workspace.check(m, n, config)
    if a_scale is None:
        a_scale_arg, stride_asm, stride_asg = w_scale, 0, 0  # unused by the bf16/inline modes
    else:
        check_activation_scales(a_scale, m, k)
        a_scale_arg, stride_asm, stride_asg = a_scale, a_scale.stride(0), a_scale.stride(1)
    leave_partials = unreduced and config.split_k > 1
    if config.gluon:
        from shoal.kernels.fp8_gemm_gluon import launch_prefetch_gemm

        launch_prefetch_gemm(
            a, a_scale_arg, w_q, w_scale, out, workspace.partials_for(config), workspace.counters,
            block_m=config.block_m, block_n=config.block_n, split_k=config.split_k,
            swapped=config.swap_ab, num_stages=config.num_stages, tiles_before_wait=config.tiles_before_wait,
            num_warps=config.num_warps, bf16_partials=config.bf16_partials,
            leave_partials=leave_partials, launch=pdl_launch(), tma_scales=config.tma_scales,
            vector_stores=config.vector_stores,
        )  # fmt: skip
        return _result(out, workspace, config, m, n, leave_partials)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), config.split_k)
    k_blocks = triton.cdiv(k, BLOCK_K)
    use_tma = config.tma and mode == ACT_FP8
    if use_tma:
        if k % 16:
            raise ValueError(f"TMA loads need K % 16 == 0 (16-byte aligned e4m3 rows), got K = {k}")
        a_desc = TensorDescriptor.from_tensor(a, [config.block_m, BLOCK_K])
        w_desc = TensorDescriptor.from_tensor(w_q, [config.block_n, BLOCK_K])
    else:
        a_desc, w_desc = a, w_q  # unused pointers
    _fp8_gemm_kernel[grid](
        a, a_scale_arg, w_q, a_desc, w_desc, w_scale, out, workspace.partials_for(config), workspace.counters,
        m, n, k, k_blocks, a.stride(0), stride_asm, stride_asg, w_q.stride(0), w_scale.stride(0),
        w_scale.stride(1), out.stride(0), **kernel_constants(mode, swiglu, k, config, leave_partials),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch(),
    )  # fmt: skip
    return _result(out, workspace, config, m, n, leave_partials)


def _result(
    out: torch.Tensor, workspace: SplitKWorkspace, config: GemmConfig, m: int, n: int, leave_partials: bool
) -> torch.Tensor | SplitKPartials:
    if leave_partials:
        parts = workspace.partials_for(config)[: config.split_k * m * n]
        return SplitKPartials(parts.view(config.split_k, m, n))
    return out


def _gluon_runs(device: torch.device) -> bool:
    """Whether `kernels/fp8_gemm_gluon.py` can run here: compiled (not interpreted) on Hopper, with
    a Triton whose Gluon dialect it was written for (3.6; `pyproject.toml` allows older Tritons,
    which then run the equivalent Triton config)."""
    return not _INTERPRETED and device.type == "cuda" and _is_hopper(device.index) and _gluon_imports()


@functools.cache
def _is_hopper(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


@functools.cache
def _gluon_imports() -> bool:
    try:
        import shoal.kernels.fp8_gemm_gluon  # noqa: F401
    except (ImportError, AttributeError) as error:
        warnings.warn(
            f"the Gluon FP8 GEMM does not load with Triton {triton.__version__} ({error}); "
            "its equivalent Triton config runs instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    return True


def fp8_gemm(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    out: torch.Tensor | None = None, workspace: SplitKWorkspace | None = None,
    config: GemmConfig | None = None, unreduced: bool = False,
) -> torch.Tensor | SplitKPartials:  # fmt: skip
    """W8A8 with pre-quantized activations (`kernels.quant`): [M, K] e4m3 x [N, K] e4m3 -> bf16 [M, N].
    `unreduced`: a split-K launch returns its `SplitKPartials` instead (`out` is then not written);
    a launch without split returns `out` as usual."""
    if x_q.dtype != torch.float8_e4m3fn:
        raise ValueError("fp8_gemm takes e4m3 activations; use fp8_linear for bf16 input")
    return _launch(ACT_FP8, x_q, x_scale, w_q, w_scale, False, out, workspace, config, unreduced)


def fp8_linear(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, quantize_input: bool,
    swiglu_input: bool = False, out: torch.Tensor | None = None, workspace: SplitKWorkspace | None = None,
    config: GemmConfig | None = None, unreduced: bool = False,
) -> torch.Tensor | SplitKPartials:  # fmt: skip
    """bf16 x [M, K] (or gate|up [M, 2K] with `swiglu_input`) times FP8 W [N, K] -> bf16 [M, N].

    `quantize_input=True` rounds activations to e4m3 per token per 128 columns inside the GEMM
    (W8A8); False keeps them bf16 and dequantizes weights in registers (W8A16). `unreduced`: as
    in `fp8_gemm`."""
    if x.dtype != torch.bfloat16:
        raise ValueError(f"fp8_linear takes bf16 activations, got {x.dtype}")
    mode = ACT_QUANT_INLINE if quantize_input else ACT_BF16
    return _launch(mode, x, None, w_q, w_scale, swiglu_input, out, workspace, config, unreduced)
