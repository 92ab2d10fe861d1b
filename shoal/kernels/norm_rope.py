"""Fused RMSNorm (+ residual add) and fused QK-norm + interleaved RoPE + paged KV-cache write.

The arithmetic follows the reference model exactly (research/model.md section 2), so the fast
path rounds where the reference rounds:
- RMSNorm: normalize in fp32, cast back to the input dtype, then multiply by the weight (the
  product rounded to the promoted dtype); a residual add is rounded to the input dtype first.
- QK-norm: torch's per-head `nn.RMSNorm(head_dim)` before RoPE; torch's built-in multiplies by
  the weight in fp32 and rounds once (checked against torch 2.13), unlike the model's RMSNorm.
- RoPE: interleaved (GPT-J) pairs (x[2i], x[2i+1]) rotated in fp32 against the bf16 (cos, sin)
  table `[max_pos, head_dim // 2, 2]` (`models.layers.rope_table`), then cast back.
The KV write uses the paged layout of `kernels/attention.py`: `slot = page * page_size + offset`
per token, a negative slot skipping the token (padding rows of a CUDA-graph batch).
With float8_e4m3fn pools it writes an FP8 KV cache: each (token, kv head) vector is the bf16 vector
the bf16 pool would hold (k after norm + RoPE, v as loaded), quantized with one fp32 scale
(amax / 448) stored in `k_scales`/`v_scales` [num_pages, page_size, Hkv], bit for bit
`reference.quantize_kv` of that bf16 vector.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels import norm_rope_block
from shoal.kernels.fp8_gemm import SplitKPartials
from shoal.kernels.gather_rows import GatheredRows
from shoal.kernels.norm_rope_block import cast_rne, norm_weight_halves
from shoal.kernels.pdl import pdl_launch, wait_for_inputs
from shoal.kernels.quant import (
    FP8_MAX,
    GROUP,
    MIN_SCALE,
    PREFILL_FROM_ROWS,
    _quantize_groups,
    check_activation_scales,
    check_kv_scales,
    quantize_by,
    scale_from_amax,
)


def interpreting() -> bool:
    """True under Triton's CPU interpreter (3.6), whose fp32 -> bf16 cast truncates and which
    multiplies bf16 tiles as raw integers: the kernels emulate the cast and upcast the tiles there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _load_masked(ptr, mask):
    """tl.load with masked-out lanes 0; `mask` None: an unmasked load."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0.0)


@triton.jit
def load_summing_partials(ptr, offs, mask, split_stride, PARTS: tl.constexpr, EMULATE: tl.constexpr):
    """ptr[offs] (`mask` None: unmasked); with PARTS > 0, ptr holds a split-K GEMM's partials
    (`SplitKPartials`, fp32 or bf16, split stride `split_stride`): their sum in fp32 from 0 in
    split order, rounded to bf16 once, which is the bits the GEMM's own reduction stores."""
    if PARTS > 0:
        total = tl.zeros(offs.shape, dtype=tl.float32)
        for part in tl.static_range(PARTS):
            total += _load_masked(ptr + part * split_stride + offs, mask).to(tl.float32)
        return cast_rne(total, tl.bfloat16, EMULATE)
    else:
        return _load_masked(ptr + offs, mask)


@triton.jit
def _rms_scale(x0, x1, w0, w1, eps, HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, EMULATE: tl.constexpr):
    """Per-head `F.rms_norm` of the even/odd halves of a head (weight halves w0/w1 from
    `norm_weight_halves`): unlike the model's RMSNorm, torch's built-in multiplies by the weight
    in fp32 and rounds once at the end."""
    if HAS_WEIGHT:
        f0 = x0.to(tl.float32)
        f1 = x1.to(tl.float32)
        mean_square = (tl.sum(f0 * f0, 0) + tl.sum(f1 * f1, 0)) / HEAD_DIM
        inv = 1.0 / tl.sqrt(mean_square + eps)
        x0 = cast_rne(f0 * inv * w0, x0.dtype, EMULATE)
        x1 = cast_rne(f1 * inv * w1, x1.dtype, EMULATE)
    return x0, x1


@triton.jit
def _qk_norm_rope_kv_kernel(
    qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, slots_ptr,
    q_out_ptr, k_pages_ptr, v_pages_ptr, k_scales_ptr, v_scales_ptr, eps,
    stride_qkv, stride_qkv_s, stride_table, stride_qo_t, stride_qo_h, stride_page, stride_pos,
    stride_head, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, PARTS: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr,
    EMULATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (T, Hq + Hkv): program (t, h) rotates q head h, or for h >= Hq normalizes/rotates
    k head h-Hq and writes it and v head h-Hq into the page pools. With PARTS > 0 qkv is a
    split-K GEMM's partials, summed while loading. With KV_FP8 the pools are e4m3: each head
    vector is rounded to bf16 (the bits the bf16 pools would get), then quantized with one scale
    (amax / 448), stored at `place // HEAD_DIM` of the contiguous [pages, page, Hkv] scales.

    Loads are issued as early as they may be (latency is the cost here): before the PDL wait the
    norm weight, the position, its RoPE row and the slot (the caller's contract: no kernel of the
    step writes positions or slots; the engine uploads them before the step), after it qkv, a kv
    head's v together with its k."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, half)
    if head < NUM_Q_HEADS:
        w0, w1 = norm_weight_halves(q_norm_ptr, offs, HAS_Q_NORM)
    else:
        w0, w1 = norm_weight_halves(k_norm_ptr, offs, HAS_K_NORM)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(table_ptr + position * stride_table + 2 * offs).to(tl.float32)
    sin = tl.load(table_ptr + position * stride_table + 2 * offs + 1).to(tl.float32)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    wait_for_inputs(USE_PDL)
    row = qkv_ptr + token * stride_qkv + head * HEAD_DIM
    everywhere = offs < half
    x0 = load_summing_partials(row, 2 * offs, everywhere, stride_qkv_s, PARTS, EMULATE)
    x1 = load_summing_partials(row, 2 * offs + 1, everywhere, stride_qkv_s, PARTS, EMULATE)
    if head < NUM_Q_HEADS:
        x0, x1 = _rms_scale(x0, x1, w0, w1, eps, HEAD_DIM, HAS_Q_NORM, EMULATE)
        f0 = x0.to(tl.float32)
        f1 = x1.to(tl.float32)
        dest = q_out_ptr + token * stride_qo_t + head * stride_qo_h
        q_type = q_out_ptr.dtype.element_ty
        tl.store(dest + 2 * offs, cast_rne(f0 * cos - f1 * sin, q_type, EMULATE))
        tl.store(dest + 2 * offs + 1, cast_rne(f1 * cos + f0 * sin, q_type, EMULATE))
    else:
        full = tl.arange(0, HEAD_DIM)
        v = load_summing_partials(
            row + NUM_KV_HEADS * HEAD_DIM, full, full < HEAD_DIM, stride_qkv_s, PARTS, EMULATE
        )
        if slot >= 0:
            kv_head = head - NUM_Q_HEADS
            x0, x1 = _rms_scale(x0, x1, w0, w1, eps, HEAD_DIM, HAS_K_NORM, EMULATE)
            f0 = x0.to(tl.float32)
            f1 = x1.to(tl.float32)
            place = (slot // PAGE) * stride_page + (slot % PAGE) * stride_pos + kv_head * stride_head
            k_dest = k_pages_ptr + place
            rotated0 = f0 * cos - f1 * sin
            rotated1 = f1 * cos + f0 * sin
            if KV_FP8:
                k0 = cast_rne(rotated0, tl.bfloat16, EMULATE).to(tl.float32)
                k1 = cast_rne(rotated1, tl.bfloat16, EMULATE).to(tl.float32)
                k_amax = tl.maximum(tl.max(tl.abs(k0), 0), tl.max(tl.abs(k1), 0))
                k_scale = scale_from_amax(k_amax, FP8_MAX_, MIN_SCALE_)
                tl.store(k_dest + 2 * offs, quantize_by(k0, k_scale, FP8_MAX_))
                tl.store(k_dest + 2 * offs + 1, quantize_by(k1, k_scale, FP8_MAX_))
                tl.store(k_scales_ptr + place // HEAD_DIM, k_scale)
            else:
                k_type = k_pages_ptr.dtype.element_ty
                tl.store(k_dest + 2 * offs, cast_rne(rotated0, k_type, EMULATE))
                tl.store(k_dest + 2 * offs + 1, cast_rne(rotated1, k_type, EMULATE))
            if KV_FP8:  # the bf16 pool's value: a no-op on bf16 input (and on summed partials)
                vf = cast_rne(v, tl.bfloat16, EMULATE).to(tl.float32)
                v_scale = scale_from_amax(tl.max(tl.abs(vf), 0), FP8_MAX_, MIN_SCALE_)
                tl.store(v_pages_ptr + place + full, quantize_by(vf, v_scale, FP8_MAX_))
                tl.store(v_scales_ptr + place // HEAD_DIM, v_scale)
            else:
                tl.store(v_pages_ptr + place + full, v.to(v_pages_ptr.dtype.element_ty))


def consumer_input(x: Tensor | SplitKPartials) -> tuple[Tensor, int, int, torch.dtype]:
    """(the [M, N] tensor the kernel indexes, PARTS, split stride, the value dtype): for a
    `SplitKPartials`, partial 0, their count and stride, and bf16 (what their sum is rounded to);
    for a tensor, itself, 0, 0 and its dtype."""
    if isinstance(x, SplitKPartials):
        return x.parts[0], x.parts.shape[0], x.parts.stride(0), torch.bfloat16
    return x, 0, 0, x.dtype


# From this many tokens on (prefill: `quant.PREFILL_FROM_ROWS`), `kernels/norm_rope_block.py` takes
# blocks of tokens per program instead of one single-warp program per (token, head): plain qkv into
# bf16/fp32 pools only (its docstring says why).
BLOCK_KERNEL_FROM_TOKENS = PREFILL_FROM_ROWS


def qk_norm_rope_kv_write(
    qkv: Tensor | SplitKPartials, positions: Tensor, rope_table: Tensor, k_pages: Tensor, v_pages: Tensor,
    slot_mapping: Tensor, n_q_heads: int, n_kv_heads: int, q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None, eps: float = 1e-6, q_out: Tensor | None = None,
    k_scales: Tensor | None = None, v_scales: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """qkv [T, (Hq+2Hkv)*D] (rows contiguous) -> rotated q [T, Hq, D]; k (normed, rotated) and
    v go into the page pools at `slot_mapping` [T]. Norm weights: S1/S2 only (None skips).
    qkv may be the qkv GEMM's `SplitKPartials` (summed while loading; q then comes out bf16).

    FP8 KV cache: with float8_e4m3fn pools [num_pages, page_size, Hkv, D] (contiguous), pass
    `k_scales`/`v_scales` float32 [num_pages, page_size, Hkv] (contiguous); each written vector is
    `reference.quantize_kv` of the bf16 vector a bf16 pool would get, its scale stored alongside.

    Under PDL (`kernels/pdl.py`) `positions`, `slot_mapping` and the table are read before the
    wait for the previous kernel: no kernel of the same graph or chain may write them. From
    `BLOCK_KERNEL_FROM_TOKENS` tokens on, plain qkv into bf16/fp32 pools goes to
    `kernels/norm_rope_block.py`."""
    qkv, count, split_stride, qkv_dtype = consumer_input(qkv)
    tokens, width = qkv.shape
    head_dim = width // (n_q_heads + 2 * n_kv_heads)
    if qkv.stride(1) != 1 or rope_table.stride(-1) != 1 or rope_table.stride(-2) != 2:
        raise ValueError("qkv rows and the rope table's [D/2, 2] rows must be contiguous")
    if k_pages.stride() != v_pages.stride() or k_pages.stride(-1) != 1:
        raise ValueError("k_pages and v_pages must share one layout with head_dim innermost")
    kv_fp8 = check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    if kv_fp8 and tuple(k_pages.shape[2:]) != (n_kv_heads, head_dim):
        wanted = f"[num_pages, page_size, {n_kv_heads}, {head_dim}]"
        raise ValueError(f"fp8 pages must be {wanted}, got {list(k_pages.shape)}")
    q_out = (
        torch.empty(tokens, n_q_heads, head_dim, dtype=qkv_dtype, device=qkv.device)
        if q_out is None
        else q_out
    )
    if tokens == 0:
        return q_out
    dummy = rope_table
    q_weight = q_norm_weight if q_norm_weight is not None else dummy
    k_weight = k_norm_weight if k_norm_weight is not None else dummy
    flags = dict(
        NUM_Q_HEADS=n_q_heads, NUM_KV_HEADS=n_kv_heads, HEAD_DIM=head_dim, PAGE=k_pages.shape[1],
        HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None,
        EMULATE=interpreting(), **pdl_launch(),
    )  # fmt: skip
    page_strides = (k_pages.stride(0), k_pages.stride(1), k_pages.stride(2))
    if tokens >= BLOCK_KERNEL_FROM_TOKENS and count == 0 and not kv_fp8:
        grid = (triton.cdiv(tokens, norm_rope_block.BLOCK_T), n_q_heads + n_kv_heads)
        norm_rope_block.qk_norm_rope_kv_block_kernel[grid](
            qkv, positions, rope_table, q_weight, k_weight, slot_mapping, q_out, k_pages, v_pages, eps,
            tokens, qkv.stride(0), rope_table.stride(0), q_out.stride(0), q_out.stride(1), *page_strides,
            BLOCK=norm_rope_block.BLOCK_T, num_warps=norm_rope_block.NUM_WARPS, **flags,
        )  # fmt: skip
        return q_out
    _qk_norm_rope_kv_kernel[(tokens, n_q_heads + n_kv_heads)](
        qkv, positions, rope_table, q_weight, k_weight, slot_mapping, q_out, k_pages, v_pages,
        k_scales if kv_fp8 else k_pages, v_scales if kv_fp8 else k_pages, eps,
        qkv.stride(0), split_stride, rope_table.stride(0), q_out.stride(0), q_out.stride(1), *page_strides,
        PARTS=count, KV_FP8=kv_fp8, FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE, num_warps=1, **flags,
    )  # fmt: skip
    return q_out


@triton.jit
def _row_groups(
    x_row_ptr, residual_row_ptr, x_valid, stride_xs, dim, first_group, COUNT: tl.constexpr,
    GROUP_SIZE: tl.constexpr, PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """COUNT 128-column groups of a row from `first_group` on, as a [COUNT, 128] tile (masked past
    dim): x, or x + residual rounded to x's dtype; x reads as zeros unless `x_valid`. With
    PARTS > 0, x is a split-K GEMM's fp32 partials (split stride `stride_xs`), summed in split
    order and rounded to bf16: the bits the GEMM's own reduction would have stored. Returns
    (groups, offsets, mask, values)."""
    groups = first_group + tl.arange(0, COUNT)
    offs = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    ok = offs < dim
    x = load_summing_partials(x_row_ptr, offs, ok & x_valid, stride_xs, PARTS, EMULATE)
    if HAS_RESIDUAL:
        r = tl.load(residual_row_ptr + offs, mask=ok, other=0.0)
        x = cast_rne(x.to(tl.float32) + r.to(tl.float32), x.dtype, EMULATE)
    return groups, offs, ok, x


@triton.jit
def _normalize_and_store(
    groups, offs, ok, x, w, inv, row, residual_out_ptr, out_ptr, scale_ptr, dim, stride_ro, stride_o,
    stride_sm, stride_sg, STORE_RESIDUAL: tl.constexpr, EMULATE: tl.constexpr, QUANT_OUT: tl.constexpr,
    GROUP_SIZE: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr,
):  # fmt: skip
    """One tile of a row's groups: the residual stream stored, then x * inv * w stored (bf16 or
    quantized per 128 columns)."""
    if STORE_RESIDUAL:
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=ok)
    y = cast_rne(x.to(tl.float32) * inv, x.dtype, EMULATE).to(tl.float32) * w
    if QUANT_OUT:
        rounded = tl.where(ok, cast_rne(y, tl.bfloat16, EMULATE).to(tl.float32), 0.0)
        q, scale = _quantize_groups(rounded, FP8_MAX_, MIN_SCALE_)
        tl.store(out_ptr + row * stride_o + offs, q, mask=ok)
        tl.store(scale_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * GROUP_SIZE < dim)
    else:
        tl.store(out_ptr + row * stride_o + offs, cast_rne(y, out_ptr.dtype.element_ty, EMULATE), mask=ok)


@triton.jit
def _weight_tile(weight_ptr, dim, first_group, COUNT: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """The norm weight's [COUNT, 128] tile from `first_group` on, fp32 (zeros past dim)."""
    offs = (first_group + tl.arange(0, COUNT))[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    return tl.load(weight_ptr + offs, mask=offs < dim, other=0.0).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, residual_out_ptr, weight_ptr, out_ptr, scale_ptr, ids_ptr, eps, dim, stride_x,
    stride_xs, stride_r, stride_ro, stride_o, stride_sm, stride_sg, stride_ids, table_rows,
    GROUPS: tl.constexpr, MAIN_GROUPS: tl.constexpr, TAIL_GROUPS: tl.constexpr, SLICE_GROUPS: tl.constexpr,
    PARTS: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATHER: tl.constexpr, EMULATE: tl.constexpr,
    QUANT_OUT: tl.constexpr, GROUP_SIZE: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr,
    USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, slice): optional residual add (stored into `residual_out`), then RMSNorm of
    the row's 128-column groups [slice * SLICE_GROUPS, ...); with QUANT_OUT the bf16 result is
    quantized per 128 columns (e4m3 + fp32 scales) instead of stored, exactly as
    `kernels/quant.py` would quantize the stored bf16 row. The row is held as [groups, 128] tiles
    from the start, so the quantization's per-group reductions need no change of register layout.

    The whole row is two tiles, MAIN_GROUPS (a power of two) groups and the TAIL_GROUPS after them
    (0: none), so no lanes are masked at S2-Pro's 2,560 columns (16 + 4 groups). The mean square
    sums the main tile, then the tail (one order for every build, split or not: the same bits).

    With SLICE_GROUPS < GROUPS (GROUPS: the groups rounded up to a power of two) several programs
    share a row: each reads the whole row for the mean square and normalizes only its slice; then
    `residual_out` must not alias `residual` (another program of the row could read a slice back).
    With GATHER, row r of x is row `ids[r]` of the table x_ptr points to (a zero row for an id
    outside [0, table_rows)), stored into `residual_out` (the residual stream it starts).

    Latency, not bytes, is this kernel's cost at decode sizes, so every load is issued as early
    as it may be: the weight before the PDL wait, a slice's own tile together with the whole row."""
    row = tl.program_id(0).to(tl.int64)
    SPLIT: tl.constexpr = SLICE_GROUPS < GROUPS
    first_group = tl.program_id(1) * SLICE_GROUPS
    if SPLIT:
        w = _weight_tile(weight_ptr, dim, first_group, SLICE_GROUPS, GROUP_SIZE)
    else:
        w = _weight_tile(weight_ptr, dim, 0, MAIN_GROUPS, GROUP_SIZE)
        if TAIL_GROUPS > 0:
            w_tail = _weight_tile(weight_ptr, dim, MAIN_GROUPS, TAIL_GROUPS, GROUP_SIZE)
    wait_for_inputs(USE_PDL)
    if GATHER:  # the ids come from the kernel just before
        source = tl.load(ids_ptr + row * stride_ids).to(tl.int64)
        x_valid = (source >= 0) & (source < table_rows)
        source = tl.where(x_valid, source, 0)
    else:
        source = row
        x_valid = True
    x_row_ptr = x_ptr + source * stride_x
    residual_row_ptr = residual_ptr + row * stride_r
    groups, offs, ok, x = _row_groups(
        x_row_ptr, residual_row_ptr, x_valid, stride_xs, dim, 0, MAIN_GROUPS, GROUP_SIZE, PARTS,
        HAS_RESIDUAL, EMULATE,
    )  # fmt: skip
    if TAIL_GROUPS > 0:
        tail_groups, tail_offs, tail_ok, tail_x = _row_groups(
            x_row_ptr, residual_row_ptr, x_valid, stride_xs, dim, MAIN_GROUPS, TAIL_GROUPS, GROUP_SIZE,
            PARTS, HAS_RESIDUAL, EMULATE,
        )  # fmt: skip
    if SPLIT:  # this program's groups, in a smaller tile (an L1/L2 re-read)
        slice_groups, slice_offs, slice_ok, slice_x = _row_groups(
            x_row_ptr, residual_row_ptr, x_valid, stride_xs, dim, first_group, SLICE_GROUPS, GROUP_SIZE,
            PARTS, HAS_RESIDUAL, EMULATE,
        )  # fmt: skip
    f = x.to(tl.float32)
    square_sum = tl.sum(tl.sum(f * f, 1), 0)
    if TAIL_GROUPS > 0:
        f_tail = tail_x.to(tl.float32)
        square_sum += tl.sum(tl.sum(f_tail * f_tail, 1), 0)
    inv = 1.0 / tl.sqrt(square_sum / dim + eps)
    store_residual: tl.constexpr = HAS_RESIDUAL or GATHER
    if SPLIT:
        _normalize_and_store(
            slice_groups, slice_offs, slice_ok, slice_x, w, inv, row, residual_out_ptr, out_ptr, scale_ptr,
            dim, stride_ro, stride_o, stride_sm, stride_sg, store_residual, EMULATE, QUANT_OUT, GROUP_SIZE,
            FP8_MAX_, MIN_SCALE_,
        )  # fmt: skip
    else:
        _normalize_and_store(
            groups, offs, ok, x, w, inv, row, residual_out_ptr, out_ptr, scale_ptr, dim, stride_ro, stride_o,
            stride_sm, stride_sg, store_residual, EMULATE, QUANT_OUT, GROUP_SIZE, FP8_MAX_, MIN_SCALE_,
        )  # fmt: skip
        if TAIL_GROUPS > 0:
            _normalize_and_store(
                tail_groups, tail_offs, tail_ok, tail_x, w_tail, inv, row, residual_out_ptr, out_ptr,
                scale_ptr, dim, stride_ro, stride_o, stride_sm, stride_sg, store_residual, EMULATE,
                QUANT_OUT, GROUP_SIZE, FP8_MAX_, MIN_SCALE_,
            )  # fmt: skip


def row_tiles(dim: int) -> tuple[int, int]:
    """(main, tail) groups of a `dim`-wide row: the largest power of two of its 128-column groups,
    then the rest rounded up to a power of two (0 when none): no masked lanes at S2-Pro's width."""
    groups = triton.cdiv(dim, GROUP)
    main = 1 << (groups.bit_length() - 1)
    return main, (triton.next_power_of_2(groups - main) if groups > main else 0)


# Decode-sized norms build with a register limit: without one, ptxas keeps the build small and
# interleaves the loads of the split-K partials with the sums that consume them, so later loads
# wait for earlier data (several dependent rounds to memory). With the limit stated (255: at most
# one program per SM at 8 warps, and these launches have 5 to 128 programs) every load is issued
# before the first use (`scripts/inspect_norm_sm90.py` counts the rounds).
NORM_MAX_REGISTERS = 255


def rms_norm(
    x: Tensor | SplitKPartials | GatheredRows, weight: Tensor, eps: float, residual: Tensor | None = None,
    out: Tensor | None = None, num_warps: int = 8, out_fp8: tuple[Tensor, Tensor] | None = None,
    residual_out: Tensor | None = None, slice_groups: int | None = None, max_registers: int | None = None,
) -> tuple[Tensor | tuple[Tensor, Tensor], Tensor | None]:  # fmt: skip
    """RMSNorm over the last dim of x [M, dim]. With `residual`, computes h = x + residual,
    stores h into `residual_out` (default: `residual`, in place; the next block's residual
    stream) and normalizes h. Returns (normed, the residual written or None); normed has dtype
    promote(x.dtype, weight.dtype).

    `out_fp8 = (q [M, dim] e4m3, scales [M, dim/128] from `quant.new_activation_scales`)`: the
    FP8 GEMM's input written directly (bf16 result quantized in registers, bit for bit what
    `quant.quantize_activations` gives on the bf16 output; one launch instead of two); then
    `normed` is that (q, scales) pair and no bf16 output is written.

    `slice_groups` (a power of two): each program normalizes that many 128-column groups of a
    row, so a few rows still spread over several SMs; with a residual this needs a distinct
    `residual_out`. Same bits as one program per row.

    x may be a split-K FP8 GEMM's `SplitKPartials` (summed while loading: the same bits as the
    GEMM's reduced output), or a `GatheredRows` (ids, table, out): row `ids[r]` of the table is
    row r, stored into `out` (the residual stream it starts; returned as the second value) and
    normalized, the same bits as `F.embedding` then this norm. No residual add then.

    `max_registers`: the build's register limit (None: ptxas's own choice); decode-sized launches
    want `NORM_MAX_REGISTERS`. Same bits either way."""
    gathered = x if isinstance(x, GatheredRows) else None
    if gathered is not None:
        if residual is not None or residual_out is not None:
            raise ValueError("gathered rows start the residual stream: no residual add, no residual_out")
        gathered.check()
        x, count, stride_xs, x_dtype = gathered.table, 0, 0, gathered.table.dtype
        rows, dim = gathered.ids.shape[0], x.shape[1]
    else:
        x, count, stride_xs, x_dtype = consumer_input(x)
        rows, dim = x.shape
    if x.stride(1) != 1 or weight.stride(0) != 1:
        raise ValueError("rows of x and the weight must be contiguous")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise ValueError("residual must match x with contiguous rows")
    groups = triton.next_power_of_2(triton.cdiv(dim, GROUP))
    if slice_groups is not None and (slice_groups < 1 or slice_groups & (slice_groups - 1)):
        raise ValueError(f"slice_groups must be a power of two, got {slice_groups}")
    slice_groups = groups if slice_groups is None else min(slice_groups, groups)
    if residual_out is None:
        residual_out = residual
    elif residual is None or residual_out.shape != x.shape or residual_out.stride(1) != 1:
        raise ValueError("residual_out needs a residual, and must match x with contiguous rows")
    if residual is not None and slice_groups < groups and residual_out.data_ptr() == residual.data_ptr():
        raise ValueError("a row split over programs needs residual_out distinct from residual")
    scales = x  # unused pointer without out_fp8
    if out_fp8 is not None:
        out, scales = out_fp8
        if torch.promote_types(x_dtype, weight.dtype) != torch.bfloat16:
            raise ValueError("out_fp8 quantizes a bf16 result: x and the weight must be bf16")
        if out.dtype != torch.float8_e4m3fn or tuple(out.shape) != (rows, dim) or out.stride(1) != 1:
            raise ValueError(f"out_fp8[0] must be float8_e4m3fn [{rows}, {dim}] with unit column stride")
        check_activation_scales(scales, rows, dim)
    elif out is None:
        out = torch.empty(rows, dim, dtype=torch.promote_types(x_dtype, weight.dtype), device=x.device)
    if gathered is not None:
        residual_out = gathered.out
    if rows == 0:
        return (out_fp8 if out_fp8 is not None else out), residual_out
    slices = triton.cdiv(triton.cdiv(dim, GROUP), slice_groups)
    main_groups, tail_groups = row_tiles(dim)
    ids = gathered.ids if gathered is not None else x  # an unused pointer without gathering
    _rms_norm_kernel[(rows, slices)](
        x, residual if residual is not None else x, residual_out if residual_out is not None else x, weight,
        out, scales, ids, eps, dim, x.stride(0), stride_xs, residual.stride(0) if residual is not None else 0,
        residual_out.stride(0) if residual_out is not None else 0, out.stride(0),
        scales.stride(0) if out_fp8 is not None else 0, scales.stride(1) if out_fp8 is not None else 0,
        ids.stride(0) if gathered is not None else 0, x.shape[0],
        GROUPS=groups, MAIN_GROUPS=main_groups, TAIL_GROUPS=tail_groups, SLICE_GROUPS=slice_groups,
        PARTS=count, HAS_RESIDUAL=residual is not None,
        GATHER=gathered is not None, EMULATE=interpreting(),
        QUANT_OUT=out_fp8 is not None, GROUP_SIZE=GROUP, FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE,
        num_warps=num_warps, **({"maxnreg": max_registers} if max_registers else {}), **pdl_launch(),
    )  # fmt: skip
    return (out_fp8 if out_fp8 is not None else out), residual_out
