"""QK-norm + interleaved RoPE + paged KV write for prefill-sized token counts: blocks of tokens.

`norm_rope._qk_norm_rope_kv_kernel` gives each (token, head) one single-warp program: at decode
sizes (a few hundred programs) latency is the cost, and that build is tuned for it. A prefill
chunk of thousands of tokens makes it hundreds of thousands of tiny programs whose scheduling, not
their bytes, sets the time. Here a program takes `BLOCK_T` tokens of one head as [BLOCK_T, D]
tiles read and written in whole contiguous rows (the even/odd halves split and joined in registers).

The arithmetic is the per-head kernel's (`_rms_scale`'s formula, the same rotation and rounding);
only the order of each head's mean-square sum follows the tile's layout, so q and k may differ from
the per-head build's by a bf16 rounding step now and then (as both do from torch's reference).
The layout follows the loads and stores, so a build over split-K partials or into an e4m3 KV
cache would sum in yet another order and break the bit-for-bit equalities those paths keep with
the plain bf16 one: `norm_rope.qk_norm_rope_kv_write` sends only bf16/fp32 qkv into bf16/fp32
pools here (prefill's case; partials come from decode-sized GEMMs), by token count, so a given
batch always takes the same build.

The two jit helpers both builds (and other kernels, through `norm_rope`'s re-export) use live here,
`cast_rne` and `norm_weight_halves`, so `norm_rope.py` imports this module and not the reverse.
"""

from __future__ import annotations

import triton
import triton.language as tl

from shoal.kernels.pdl import wait_for_inputs

BLOCK_T = 16  # tokens per program: [16, 128] tiles on 4 warps (8-64 tokens measured within 10%)
NUM_WARPS = 4


@triton.jit
def cast_rne(x, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """x.to(dtype) rounding to nearest even, as the GPU's cvt.rn does; EMULATE does the
    rounding in integer arithmetic first, for the interpreter (NaN/overflow not handled)."""
    if EMULATE and dtype == tl.bfloat16:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def norm_weight_halves(w_ptr, offs, HAS_WEIGHT: tl.constexpr):
    """The even/odd halves of a per-head norm weight, in fp32 (zeros without a weight). A
    constant of the step: kernels load it before the PDL wait, so its round trip to memory is
    not on the path after the reduction that needs it."""
    if HAS_WEIGHT:
        return tl.load(w_ptr + 2 * offs).to(tl.float32), tl.load(w_ptr + 2 * offs + 1).to(tl.float32)
    else:
        return tl.zeros(offs.shape, tl.float32), tl.zeros(offs.shape, tl.float32)


@triton.jit
def _halves(x, BLOCK: tl.constexpr, HALF: tl.constexpr):
    """[BLOCK, 2 * HALF] rows of interleaved pairs -> (even, odd) halves [BLOCK, HALF]."""
    return tl.split(tl.reshape(x, [BLOCK, HALF, 2]))


@triton.jit
def _normed_rotated(
    x, cos, sin, w0, w1, eps, dtype: tl.constexpr, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """Heads x [BLOCK, D] -> per-head `F.rms_norm` (as `norm_rope._rms_scale`: fp32, the weight
    multiplied in fp32, rounded once) when `HAS_WEIGHT`, then rotated in fp32 against the table's
    (cos, sin) [BLOCK, D/2] and rounded to `dtype`, interleaved back into [BLOCK, D] rows."""
    half: tl.constexpr = HEAD_DIM // 2
    x0, x1 = _halves(x, BLOCK, half)
    if HAS_WEIGHT:
        f0 = x0.to(tl.float32)
        f1 = x1.to(tl.float32)
        mean_square = (tl.sum(f0 * f0, 1) + tl.sum(f1 * f1, 1)) / HEAD_DIM
        inv = (1.0 / tl.sqrt(mean_square + eps))[:, None]
        x0 = cast_rne(f0 * inv * w0[None, :], x0.dtype, EMULATE)
        x1 = cast_rne(f1 * inv * w1[None, :], x1.dtype, EMULATE)
    f0 = x0.to(tl.float32)
    f1 = x1.to(tl.float32)
    r0 = cast_rne(f0 * cos - f1 * sin, dtype, EMULATE)
    r1 = cast_rne(f1 * cos + f0 * sin, dtype, EMULATE)
    return tl.reshape(tl.join(r0, r1), [BLOCK, HEAD_DIM])


@triton.jit
def qk_norm_rope_kv_block_kernel(
    qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, slots_ptr, q_out_ptr, k_pages_ptr,
    v_pages_ptr, eps, num_tokens, stride_qkv, stride_table, stride_qo_t, stride_qo_h, stride_page,
    stride_pos, stride_head, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    BLOCK: tl.constexpr, EMULATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (cdiv(T, BLOCK), Hq + Hkv): program (b, h) handles tokens [b * BLOCK, (b + 1) *
    BLOCK) of q head h, or for h >= Hq their k and v heads h - Hq. Arguments as the per-head
    kernel's, plus `num_tokens` = T; a negative slot (a padding row) writes nothing."""
    tokens = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    head = tl.program_id(1)
    valid = tokens < num_tokens
    dims = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, HEAD_DIM // 2)
    rows = valid[:, None] & (dims[None, :] < HEAD_DIM)
    if head < NUM_Q_HEADS:
        w0, w1 = norm_weight_halves(q_norm_ptr, offs, HAS_Q_NORM)
    else:
        w0, w1 = norm_weight_halves(k_norm_ptr, offs, HAS_K_NORM)
    position = tl.load(positions_ptr + tokens, mask=valid, other=0).to(tl.int64)
    table = tl.load(table_ptr + position[:, None] * stride_table + dims[None, :], mask=rows, other=0.0)
    cos, sin = _halves(table.to(tl.float32), BLOCK, HEAD_DIM // 2)
    slot = tl.load(slots_ptr + tokens, mask=valid, other=-1).to(tl.int64)
    wait_for_inputs(USE_PDL)
    row = qkv_ptr + tokens[:, None] * stride_qkv + head * HEAD_DIM + dims[None, :]
    x = tl.load(row, mask=rows, other=0.0)
    if head < NUM_Q_HEADS:
        q_type = q_out_ptr.dtype.element_ty
        q = _normed_rotated(x, cos, sin, w0, w1, eps, q_type, BLOCK, HEAD_DIM, HAS_Q_NORM, EMULATE)
        tl.store(q_out_ptr + tokens[:, None] * stride_qo_t + head * stride_qo_h + dims[None, :], q, mask=rows)
    else:
        v = tl.load(row + NUM_KV_HEADS * HEAD_DIM, mask=rows, other=0.0)
        kept = (valid & (slot >= 0))[:, None] & (dims[None, :] < HEAD_DIM)
        k_type = k_pages_ptr.dtype.element_ty
        k = _normed_rotated(x, cos, sin, w0, w1, eps, k_type, BLOCK, HEAD_DIM, HAS_K_NORM, EMULATE)
        place = (slot // PAGE) * stride_page + (slot % PAGE) * stride_pos + (head - NUM_Q_HEADS) * stride_head
        tl.store(k_pages_ptr + place[:, None] + dims[None, :], k, mask=kept)
        tl.store(v_pages_ptr + place[:, None] + dims[None, :], v.to(v_pages_ptr.dtype.element_ty), mask=kept)
