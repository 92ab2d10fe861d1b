"""QK-norm + interleaved RoPE + paged KV write for prefill-sized token counts: blocks of tokens.

`norm_rope._qk_norm_rope_kv_kernel` gives each (token, head) one single-warp program: at decode
sizes (a few hundred programs) latency is the cost, and that build is tuned for it. A prefill
chunk of thousands of tokens makes it hundreds of thousands of tiny programs whose scheduling, not
their bytes, sets the time: a concurrency-64 wave's 3,840-token chunks took 189 µs each against
about 25 µs of traffic (docs/performance.md run 198, 14% of the wave). Here a program takes
`BLOCK_T` tokens of one head as [BLOCK_T, D] tiles read and written in whole contiguous rows (the
even/odd halves split and joined in registers), so a chunk is a few thousand programs.

The arithmetic is the decode kernel's (`_rms_scale`'s formula, the same rotation, rounding and
FP8 KV quantization); only the order of each head's mean-square sum differs with the tile's
layout, so q and k may differ from the per-head build's by a bf16 rounding step now and then (as
both do from torch's reference). `norm_rope.qk_norm_rope_kv_write` picks this kernel by token
count alone, so a given batch always takes the same build.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shoal.kernels.norm_rope import cast_rne, load_summing_partials, norm_weight_halves
from shoal.kernels.pdl import wait_for_inputs
from shoal.kernels.quant import quantize_by, scale_from_amax

BLOCK_T = 16  # tokens per program: [16, 128] tiles on 4 warps, 16 elements per thread
NUM_WARPS = 4


@triton.jit
def _halves(x, BLOCK: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK, 2 * HALF] rows of interleaved pairs -> (even, odd) halves [BLOCK, HALF]."""
    return tl.split(tl.reshape(x, [BLOCK, HALF, 2]))


@triton.jit
def _rotated(
    x0, x1, cos, sin, dtype: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, EMULATE: tl.constexpr
):
    """Normalized halves rotated in fp32 (the per-head kernel's expressions), rounded to `dtype`
    and interleaved back into [BLOCK, D] rows."""
    f0 = x0.to(tl.float32)
    f1 = x1.to(tl.float32)
    r0 = cast_rne(f0 * cos - f1 * sin, dtype, EMULATE)
    r1 = cast_rne(f1 * cos + f0 * sin, dtype, EMULATE)
    return tl.reshape(tl.join(r0, r1), [BLOCK, HEAD_DIM])


@triton.jit
def _norm_halves(
    x0, x1, w0, w1, eps, HEAD_DIM: tl.constexpr, HAS_WEIGHT: tl.constexpr, EMULATE: tl.constexpr
):
    """`norm_rope._rms_scale` per row of [BLOCK, D/2] halves (one mean square per head)."""
    if HAS_WEIGHT:
        f0 = x0.to(tl.float32)
        f1 = x1.to(tl.float32)
        mean_square = (tl.sum(f0 * f0, 1) + tl.sum(f1 * f1, 1)) / HEAD_DIM
        inv = (1.0 / tl.sqrt(mean_square + eps))[:, None]
        x0 = cast_rne(f0 * inv * w0[None, :], x0.dtype, EMULATE)
        x1 = cast_rne(f1 * inv * w1[None, :], x1.dtype, EMULATE)
    return x0, x1


@triton.jit
def qk_norm_rope_kv_block_kernel(
    qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, slots_ptr,
    q_out_ptr, k_pages_ptr, v_pages_ptr, k_scales_ptr, v_scales_ptr, eps, num_tokens,
    stride_qkv, stride_qkv_s, stride_table, stride_qo_t, stride_qo_h, stride_page, stride_pos,
    stride_head, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, PARTS: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr, BLOCK: tl.constexpr,
    EMULATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK), Hq + Hkv): program (b, h) handles tokens [b * BLOCK, (b + 1) *
    BLOCK) of q head h, or for h >= Hq their k and v heads h - Hq (arguments as the per-head
    kernel's, plus `num_tokens` = T)."""
    half: tl.constexpr = HEAD_DIM // 2
    tokens = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1)
    valid = tokens < num_tokens
    dims = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, half)
    rows = valid[:, None] & (dims[None, :] < HEAD_DIM)
    if head < NUM_Q_HEADS:
        w0, w1 = norm_weight_halves(q_norm_ptr, offs, HAS_Q_NORM)
    else:
        w0, w1 = norm_weight_halves(k_norm_ptr, offs, HAS_K_NORM)
    position = tl.load(positions_ptr + tokens, mask=valid, other=0).to(tl.int64)
    table = tl.load(table_ptr + position[:, None] * stride_table + dims[None, :], mask=rows, other=0.0)
    cos, sin = _halves(table.to(tl.float32), BLOCK, half)
    slot = tl.load(slots_ptr + tokens, mask=valid, other=-1).to(tl.int64)
    wait_for_inputs(USE_PDL)
    row = qkv_ptr + tokens[:, None] * stride_qkv + head * HEAD_DIM
    x0, x1 = _halves(
        load_summing_partials(row, dims[None, :], rows, stride_qkv_s, PARTS, EMULATE), BLOCK, half
    )
    if head < NUM_Q_HEADS:
        x0, x1 = _norm_halves(x0, x1, w0, w1, eps, HEAD_DIM, HAS_Q_NORM, EMULATE)
        q = _rotated(x0, x1, cos, sin, q_out_ptr.dtype.element_ty, BLOCK, HEAD_DIM, EMULATE)
        tl.store(q_out_ptr + tokens[:, None] * stride_qo_t + head * stride_qo_h + dims[None, :], q, mask=rows)
    else:
        v = load_summing_partials(
            row + NUM_KV_HEADS * HEAD_DIM, dims[None, :], rows, stride_qkv_s, PARTS, EMULATE
        )
        written = valid & (slot >= 0)  # a negative slot: a padding row, nothing written
        kept = written[:, None] & (dims[None, :] < HEAD_DIM)
        x0, x1 = _norm_halves(x0, x1, w0, w1, eps, HEAD_DIM, HAS_K_NORM, EMULATE)
        place = (slot // PAGE) * stride_page + (slot % PAGE) * stride_pos + (head - NUM_Q_HEADS) * stride_head
        k_dest = k_pages_ptr + place[:, None] + dims[None, :]
        v_dest = v_pages_ptr + place[:, None] + dims[None, :]
        if KV_FP8:  # the bf16 pool's k and v, each head quantized with its own scale
            k = _rotated(x0, x1, cos, sin, tl.bfloat16, BLOCK, HEAD_DIM, EMULATE).to(tl.float32)
            k_scale = scale_from_amax(tl.max(tl.abs(k), 1), FP8_MAX_, MIN_SCALE_)
            tl.store(k_dest, quantize_by(k, k_scale[:, None], FP8_MAX_), mask=kept)
            tl.store(k_scales_ptr + place // HEAD_DIM, k_scale, mask=written)
            vf = cast_rne(v, tl.bfloat16, EMULATE).to(tl.float32)
            v_scale = scale_from_amax(tl.max(tl.abs(vf), 1), FP8_MAX_, MIN_SCALE_)
            tl.store(v_dest, quantize_by(vf, v_scale[:, None], FP8_MAX_), mask=kept)
            tl.store(v_scales_ptr + place // HEAD_DIM, v_scale, mask=written)
        else:
            k = _rotated(x0, x1, cos, sin, k_pages_ptr.dtype.element_ty, BLOCK, HEAD_DIM, EMULATE)
            tl.store(k_dest, k, mask=kept)
            tl.store(v_dest, v.to(v_pages_ptr.dtype.element_ty), mask=kept)
