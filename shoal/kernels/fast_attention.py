"""The fast transformer's attention layer in one launch: QK-norm + RoPE + KV write + attention.

The decode step runs the fast transformer 9 times per frame over a per-row cache of one page
(`decode_step.FAST_PAGE` = 16 slots, row b uses page b) holding only this frame's positions, so
each layer attends over at most 10 keys. Two launches per layer (`norm_rope.qk_norm_rope_kv_write`
then `attention.paged_decode_attention`/`paged_prefill_attention`) are pure latency there; this
kernel does both in one.

Grid (batch, Hkv): program (b, h) takes row b's tokens (1, or 2 in pass 0) and kv head h. It
normalizes (optional) and rotates k head h of each token and stores it, with v head h, into page
b at offset `position` (the slot `qk_norm_rope_kv_write` gets: b * page_size + position); it
rotates the g = Hq/Hkv query heads of those tokens; then attends them over the page's keys
0..position (causal within the 2-token pass) and writes the output rows.

Visibility of the keys written by this launch: they are not read back. The program keeps the
rotated k and v of its own tokens in registers and puts them into the [page, D] key/value tiles
it loads from the page (`tl.where` on the key index); every other visible key was written by an
earlier pass's launch, at least two kernels back (the qkv GEMM lies between). Under PDL
(`kernels/pdl.py`) a kernel starts only once the kernel before it has passed its own wait, which
returns when the one before that has finished and its writes are visible: so the page is complete
when this program starts, and its loads are issued before the wait, overlapping the GEMM. No
store -> barrier -> load round trip and no page load is left on the critical path, and the
attention uses exactly the bits that were stored.

Numerics, against the two-kernel path (bit for bit in the interpreter, tests/test_fast_attention_kernel.py):
- k and v in the pages are bit-identical: the k head goes through the same expressions as in
  `_qk_norm_rope_kv_kernel` (`_rms_scale`, `cast_rne`), on the same 1-D [D/2] halves, launched
  with the same single warp, so the norm's reductions run in the same order;
- q is the q that kernel would store (rounded to the qkv dtype after RoPE): the same
  elementwise expressions on a [(token, head), D/2] tile, each head's norm reduced from its own
  1-D halves as there (`_q_norm_rows`);
- attention: fp32 scores, exp2 with the log2(e)-folded 1/sqrt(D) scale, probabilities cast to
  the value dtype before the PV product, as `attention._attend_key_range` does for one block of
  keys; only the summation order inside the dot products can differ (other tile shapes, on the
  GPU maybe other MMA instructions), so the output matches within bf16 rounding;
- the output row is stored by `attention._write_rows` (bf16 rounded on the bits, or quantized
  for the FP8 o-projection: then equal to `quantize_activations` of this call's bf16 output).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.attention import _LOG2E, _check_out_fp8, _dot, _write_rows
from shoal.kernels.fp8_gemm import SplitKPartials
from shoal.kernels.norm_rope import (
    _load_masked,
    _rms_scale,
    cast_rne,
    consumer_input,
    interpreting,
    load_summing_partials,
    norm_weight_halves,
)
from shoal.kernels.pdl import pdl_launch, wait_for_inputs

# With QK-norm, one warp: the norm's 1-D reductions then run in the order of
# `qk_norm_rope_kv_write`'s launch (also one warp), which keeps normalized keys and queries
# bit-identical. Without it every value is elementwise and any warp count gives the same bits:
# the [16, D] tiles get four (one warp is slower than the two launches it replaces), and reading
# split-K partials eight, whose smaller per-thread share lets the partials' loads go out in fewer
# dependent rounds after the PDL wait.
NORM_WARPS = 1
PLAIN_WARPS = 4
PARTIALS_WARPS = 8
# bf16 qkv (or partials) and RoPE table read as 32-bit (even, odd) words (`_load_pairs`) from
# WORDS_MIN_ROWS rows up: faster than [..., 2] tiles from batch 8, slower below (`Tuning.packed_pairs`,
# `Tuning.words_min_rows`).
PACKED_PAIRS = True
WORDS_MIN_ROWS = 8


@triton.jit
def _q_norm_rows(
    x0, x1, qkv_ptr, first_token, stride_qkv, split_stride, kv_head, w0, w1, offs, eps,
    TOKENS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr, PARTS: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """`norm_rope._rms_scale` of the q tile's heads (x0/x1 [BLOCK_R, D/2] even/odd halves, row
    t * BLOCK_G + i = token t, head i of the group). Each head's mean square is reduced from the
    head's own 1-D halves as `_qk_norm_rope_kv_kernel` reduces it (same shape, same single warp,
    hence the same order) and only the elementwise scaling runs on the tile, so q does not drift
    an ulp from the two-kernel path's the way a row-wise reduction of the tile could."""
    rows = tl.arange(0, BLOCK_R)
    inv = tl.zeros([BLOCK_R], dtype=tl.float32)
    for t in tl.static_range(TOKENS):
        for i in tl.static_range(GROUP):
            head = qkv_ptr + (first_token + t) * stride_qkv + (kv_head * GROUP + i) * HEAD_DIM
            f0 = load_summing_partials(head, 2 * offs, None, split_stride, PARTS, EMULATE).to(tl.float32)
            f1 = load_summing_partials(head, 2 * offs + 1, None, split_stride, PARTS, EMULATE).to(tl.float32)
            mean_square = (tl.sum(f0 * f0, 0) + tl.sum(f1 * f1, 0)) / HEAD_DIM
            inv = tl.where(rows == t * BLOCK_G + i, 1.0 / tl.sqrt(mean_square + eps), inv)
    x0 = cast_rne(x0.to(tl.float32) * inv[:, None] * w0[None, :], x0.dtype, EMULATE)
    x1 = cast_rne(x1.to(tl.float32) * inv[:, None] * w1[None, :], x1.dtype, EMULATE)
    return x0, x1


@triton.jit
def _split_words(word):
    """A tile of 32-bit words holding bf16 (even, odd) pairs -> (even, odd) in fp32: the low half
    is the even element, and a bf16 widens to fp32 by moving its bits up."""
    return (word << 16).to(tl.float32, bitcast=True), (word & 0xFFFF0000).to(tl.float32, bitcast=True)


@triton.jit
def _pair_words(ptr, base, lane):
    """Pointers to the 32-bit words holding the bf16 pairs at ptr[base + 2 * lane] (base even and
    ptr 4-byte aligned: `_reads_words`)."""
    return ptr.to(tl.pointer_type(tl.uint32)) + (base // 2 + lane)


@triton.jit
def _load_pairs(
    ptr, base, lane, mask, split_stride, PARTS: tl.constexpr, PACKED: tl.constexpr, EMULATE: tl.constexpr
):
    """The (even, odd) halves of pairs: ptr[base + 2 * lane] and the element after it (`base`
    broadcasts against `lane`), in ptr's element type, or bf16 when summed from PARTS partials
    (`norm_rope.load_summing_partials`'s bits).

    PACKED (bf16 storage; `base`, the split stride and ptr 4-byte aligned: `_reads_words`): each
    pair is one 32-bit word, split by shifts after loading, not a [..., 2] tile split after a
    layout conversion through shared memory."""
    if PACKED:
        words = _pair_words(ptr, base, lane)
        if PARTS > 0:
            even = tl.zeros(words.shape, dtype=tl.float32)
            odd = tl.zeros(words.shape, dtype=tl.float32)
            for part in tl.static_range(PARTS):
                part_even, part_odd = _split_words(_load_masked(words + part * (split_stride // 2), mask))
                even += part_even
                odd += part_odd
            return cast_rne(even, tl.bfloat16, EMULATE), cast_rne(odd, tl.bfloat16, EMULATE)
        else:
            even, odd = _split_words(_load_masked(words, mask))
            return even.to(tl.bfloat16), odd.to(tl.bfloat16)
    else:
        even_offsets = base + 2 * lane
        last: tl.constexpr = len(even_offsets.shape)
        pair_offsets = tl.expand_dims(even_offsets, last) + tl.arange(0, 2)
        pairs_mask = None if mask is None else tl.expand_dims(mask, last)
        return tl.split(load_summing_partials(ptr, pair_offsets, pairs_mask, split_stride, PARTS, EMULATE))


@triton.jit
def _load_cos_sin(table_ptr, base, lane, mask, PACKED: tl.constexpr):
    """(cos, sin) in fp32 at table_ptr[base + 2 * lane] and the element after it: as one word
    each with PACKED (`_load_pairs`), else by two strided loads."""
    if PACKED:
        cos, sin = _split_words(_load_masked(_pair_words(table_ptr, base, lane), mask))
    else:
        pairs = table_ptr + base + 2 * lane
        cos = _load_masked(pairs, mask).to(tl.float32)
        sin = _load_masked(pairs + 1, mask).to(tl.float32)
    return cos, sin


@triton.jit
def _rotation(position_ptr, table_ptr, stride_table, offs_h, position_limit, PACKED: tl.constexpr):
    """(position, cos, sin) of one token; a position outside [0, position_limit) reads row 0."""
    position = tl.load(position_ptr).to(tl.int32)
    at = tl.where((position >= 0) & (position < position_limit), position, 0).to(tl.int64)
    cos, sin = _load_cos_sin(table_ptr, at * stride_table, offs_h, None, PACKED)
    return position, cos, sin


@triton.jit
def _fast_rope_attention_kernel(
    qkv_ptr, positions_ptr, table_ptr, q_norm_ptr, k_norm_ptr, k_pages_ptr, v_pages_ptr,
    out_ptr, q8_ptr, scale_ptr, eps, scale_log2e, position_limit,
    stride_qkv, split_stride, stride_table, stride_page, stride_pos, stride_head,
    stride_ot, stride_oh, stride_q8, stride_st, stride_sh,
    TOKENS: tl.constexpr, NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, EMULATE: tl.constexpr,
    UPCAST: tl.constexpr, QUANT_OUT: tl.constexpr, PARTS: tl.constexpr, PACKED: tl.constexpr,
    PACKED_TABLE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (batch, Hkv): row b's TOKENS tokens x kv head h (module docstring). Tile rows of q
    are (token, head in group) pairs; a position outside [0, position_limit) writes nothing and
    reads only its own page (padding rows of a CUDA-graph batch stay inside their page). With
    PARTS > 0 qkv is the qkv GEMM's split-K partials (split stride `split_stride`), each value
    summed while loading (`norm_rope.load_summing_partials`: the GEMM's own reduction's bits).

    Loads before the PDL wait: the norm weights, the positions and their RoPE rows
    (`fast_rope_attention`'s contract) and the page (written by earlier passes); after it qkv,
    each new token's v with its k."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, half)
    k_w0, k_w1 = norm_weight_halves(k_norm_ptr, offs_h, HAS_K_NORM)
    q_w0, q_w1 = norm_weight_halves(q_norm_ptr, offs_h, HAS_Q_NORM)
    # The new tokens' rotations (k side: TOKENS is 1 or 2), then the query rows' (q side).
    position_0, cos_0, sin_0 = _rotation(
        positions_ptr + row * TOKENS, table_ptr, stride_table, offs_h, position_limit, PACKED_TABLE
    )
    position_1, cos_1, sin_1 = position_0, cos_0, sin_0
    if TOKENS == 2:
        position_1, cos_1, sin_1 = _rotation(
            positions_ptr + row * TOKENS + 1, table_ptr, stride_table, offs_h, position_limit, PACKED_TABLE
        )
    rows = tl.arange(0, BLOCK_R)
    in_group = rows % BLOCK_G
    t_index = rows // BLOCK_G
    row_ok = (in_group < GROUP) & (t_index < TOKENS)
    token_r = row * TOKENS + t_index
    head_r = kv_head * GROUP + in_group
    position_r = tl.load(positions_ptr + token_r, mask=row_ok, other=0).to(tl.int32)
    at_r = tl.where((position_r >= 0) & (position_r < position_limit), position_r, 0).to(tl.int64)
    q_cos, q_sin = _load_cos_sin(
        table_ptr, at_r[:, None] * stride_table, offs_h[None, :], row_ok[:, None], PACKED_TABLE
    )
    # The page: every key this program reads from it was written by an earlier pass's launch, at
    # least two kernels back, so it is complete before this program starts (module docstring);
    # the keys of this launch's own tokens are put into the tiles from registers below. Read at
    # L2 (".cg"), the point of coherence: no SM's L1 can hold a line of it from before the write,
    # whatever the wait would have invalidated.
    offs_d = tl.arange(0, HEAD_DIM)
    keys_at = tl.arange(0, BLOCK_N)
    in_page = keys_at < PAGE
    page = row * stride_page + kv_head * stride_head
    tile = page + keys_at[:, None] * stride_pos + offs_d[None, :]
    keys = tl.load(k_pages_ptr + tile, mask=in_page[:, None], other=0.0, cache_modifier=".cg")
    values = tl.load(v_pages_ptr + tile, mask=in_page[:, None], other=0.0, cache_modifier=".cg")
    wait_for_inputs(USE_PDL)  # qkv comes from the GEMM just before
    # The qkv loads before any use: each new token's k (as (even, odd) pairs, split in registers:
    # 4-byte loads, not two strided 2-byte ones) and v, then the query rows. Loaded where they
    # are used, each would wait for the layout changes of the one before, and the build would go
    # to memory in more dependent rounds.
    k_halves = ()
    v_rows = ()
    for t in tl.static_range(TOKENS):
        src = qkv_ptr + (row * TOKENS + t) * stride_qkv + (NUM_Q_HEADS + kv_head) * HEAD_DIM
        k_halves = k_halves + (_load_pairs(src, 0, offs_h, None, split_stride, PARTS, PACKED, EMULATE),)
        v_rows = v_rows + (
            load_summing_partials(src + NUM_KV_HEADS * HEAD_DIM, offs_d, None, split_stride, PARTS, EMULATE),
        )
    q_rows = (token_r * stride_qkv + head_r * HEAD_DIM)[:, None]
    q_halves = _load_pairs(
        qkv_ptr, q_rows, offs_h[None, :], row_ok[:, None], split_stride, PARTS, PACKED, EMULATE
    )

    # This row's new keys: normalized and rotated exactly as `_qk_norm_rope_kv_kernel` does, stored,
    # and put into the tiles in place of whatever the page held at their positions.
    last = tl.full([], -1, tl.int32)
    for t in tl.static_range(TOKENS):
        if t == 0:
            position, cos, sin = position_0, cos_0, sin_0
        else:
            position, cos, sin = position_1, cos_1, sin_1
        valid = (position >= 0) & (position < position_limit)
        at = tl.where(valid, position, 0).to(tl.int64)
        x0, x1 = k_halves[t]
        v = v_rows[t].to(v_pages_ptr.dtype.element_ty)
        x0, x1 = _rms_scale(x0, x1, k_w0, k_w1, eps, HEAD_DIM, HAS_K_NORM, EMULATE)
        f0 = x0.to(tl.float32)
        f1 = x1.to(tl.float32)
        k_type = k_pages_ptr.dtype.element_ty
        k0 = cast_rne(f0 * cos - f1 * sin, k_type, EMULATE)
        k1 = cast_rne(f1 * cos + f0 * sin, k_type, EMULATE)
        dest = page + at * stride_pos
        k = tl.interleave(k0, k1)
        tl.store(k_pages_ptr + dest + offs_d, k, mask=valid)
        tl.store(v_pages_ptr + dest + offs_d, v, mask=valid)
        here = (keys_at == position)[:, None]
        keys = tl.where(here, k[None, :], keys)
        values = tl.where(here, v[None, :], values)
        last = tl.maximum(last, position)
    # Keys past the row's last position may hold anything (an older frame, a padding row's
    # garbage): their probabilities are 0, and 0 * NaN would still poison the sum.
    values = tl.where((keys_at <= last)[:, None], values, 0.0)

    # Queries: rows (token, head in group), rotated as `_qk_norm_rope_kv_kernel` rotates q heads.
    x0, x1 = q_halves
    if HAS_Q_NORM:
        x0, x1 = _q_norm_rows(
            x0, x1, qkv_ptr, row * TOKENS, stride_qkv, split_stride, kv_head, q_w0, q_w1, offs_h, eps,
            TOKENS, GROUP, BLOCK_G, BLOCK_R, HEAD_DIM, PARTS, EMULATE,
        )  # fmt: skip
    f0 = x0.to(tl.float32)
    f1 = x1.to(tl.float32)
    q_type = k_pages_ptr.dtype.element_ty  # qkv's (partials: what their sum is rounded to)
    q = tl.interleave(
        cast_rne(f0 * q_cos - f1 * q_sin, q_type, EMULATE), cast_rne(f1 * q_cos + f0 * q_sin, q_type, EMULATE)
    )

    # One block of keys of `_attend_key_range`, from its initial state (nothing accumulated yet).
    s = _dot(q, tl.trans(keys), UPCAST) * scale_log2e
    keep = in_page[None, :] & (keys_at[None, :] <= position_r[:, None])
    s = tl.where(keep, s, float("-inf"))
    m = tl.maximum(tl.max(s, 1), -1.0e30)
    p = tl.exp2(s - m[:, None])
    total = tl.sum(p, 1)
    acc = _dot(p.to(values.dtype), values, UPCAST)
    normed = acc / tl.where(total > 0, total, 1.0)[:, None]
    _write_rows(
        normed, token_r, head_r, row_ok, out_ptr, stride_ot, stride_oh,
        q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh, HEAD_DIM, QUANT_OUT,
    )  # fmt: skip


def _check_inputs(
    qkv: Tensor, qkv_dtype: torch.dtype, positions: Tensor, rope_table: Tensor, k_pages: Tensor,
    v_pages: Tensor, tokens_per_row: int, n_q_heads: int, n_kv_heads: int,
    norm_weights: tuple[Tensor | None, Tensor | None],
) -> int:  # fmt: skip
    """Raise ValueError on anything the kernel cannot take; returns head_dim."""
    if tokens_per_row not in (1, 2):
        raise ValueError(f"tokens_per_row must be 1 or 2 (pass 0), got {tokens_per_row}")
    if qkv.dim() != 2 or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, (Hq + 2*Hkv) * D] with contiguous rows, got {tuple(qkv.shape)}")
    tokens, width = qkv.shape
    heads = n_q_heads + 2 * n_kv_heads
    if n_kv_heads < 1 or n_q_heads % n_kv_heads or width % heads:
        raise ValueError(
            f"qkv width {width} does not split into {n_q_heads} q + 2 x {n_kv_heads} kv heads "
            "(Hq must be a multiple of Hkv)"
        )
    head_dim = width // heads
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
    if tokens % tokens_per_row:
        raise ValueError(f"{tokens} tokens are not whole rows of {tokens_per_row}")
    if positions.shape != (tokens,) or positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"positions: need integer [{tokens}], got {positions.dtype} {list(positions.shape)}")
    if rope_table.dim() != 3 or rope_table.shape[1:] != (head_dim // 2, 2):
        raise ValueError(f"rope_table must be [max_pos, {head_dim // 2}, 2], got {tuple(rope_table.shape)}")
    if rope_table.stride(-1) != 1 or rope_table.stride(-2) != 2:
        raise ValueError("the rope table's [D/2, 2] rows must be contiguous")
    if k_pages.shape != v_pages.shape or k_pages.stride() != v_pages.stride() or k_pages.dim() != 4:
        raise ValueError("k_pages and v_pages must be [num_pages, page_size, Hkv, D] of one shape and layout")
    if k_pages.stride(-1) != 1:
        raise ValueError("k_pages and v_pages need head_dim innermost and contiguous")
    if k_pages.shape[2:] != (n_kv_heads, head_dim):
        raise ValueError(f"pages hold {list(k_pages.shape[2:])} per slot, need [{n_kv_heads}, {head_dim}]")
    if k_pages.shape[0] < tokens // tokens_per_row:
        raise ValueError(f"{tokens // tokens_per_row} rows need as many pages, got {k_pages.shape[0]}")
    if not (qkv_dtype == k_pages.dtype == v_pages.dtype) or not qkv_dtype.is_floating_point:
        dtypes = f"{qkv_dtype}, {k_pages.dtype}, {v_pages.dtype}"
        raise ValueError(f"qkv and the pages must share one floating dtype, got {dtypes}")
    for name, weight in zip(("q_norm_weight", "k_norm_weight"), norm_weights, strict=True):
        if weight is not None and (weight.shape != (head_dim,) or weight.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{head_dim}], got {tuple(weight.shape)}")
    return head_dim


def _reads_words(tensor: Tensor, *strides: int, packed_pairs: bool = PACKED_PAIRS) -> bool:
    """Whether the kernel may read `tensor`'s bf16 (even, odd) pairs as 32-bit words (`_load_pairs`
    PACKED): every pair must start 4-byte aligned."""
    aligned = tensor.data_ptr() % 4 == 0 and all(stride % 2 == 0 for stride in strides)
    return packed_pairs and tensor.dtype == torch.bfloat16 and aligned


def fast_rope_attention(
    qkv: Tensor | SplitKPartials, positions: Tensor, rope_table: Tensor, k_pages: Tensor, v_pages: Tensor,
    tokens_per_row: int, n_q_heads: int, n_kv_heads: int, q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None, eps: float = 1e-6, out: Tensor | None = None,
    out_fp8: tuple[Tensor, Tensor] | None = None, packed_pairs: bool = PACKED_PAIRS,
    words_min_rows: int = WORDS_MIN_ROWS,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """One fast-transformer attention layer: `qk_norm_rope_kv_write` + paged attention, one launch.

    qkv [T, (Hq+2Hkv)*D], T = batch * tokens_per_row, grouped by row (pass 0: tokens_per_row 2,
    positions 0 and 1; pass k >= 2: one token at position k); positions [T] inside the frame;
    rope_table as `models.layers.rope_table`; k_pages/v_pages [num_pages >= batch, page_size,
    Hkv, D], row b in page b: its tokens' k/v land at slot b * page_size + position (where
    `qk_norm_rope_kv_write` puts them) and it attends causally over its keys 0..position.
    qkv may be the qkv GEMM's `SplitKPartials` (bf16 pages, summed while loading). Norm weights:
    QK-norm (None skips). Returns the attention output [T, Hq, D] (`out`, or new), or with
    `out_fp8` (as `attention.paged_decode_attention`'s) that pair filled for the FP8 o-projection.

    Positions are range-checked here only on the CPU (reading a CUDA tensor would sync the
    captured step); on the GPU a position outside [0, min(page_size, len(rope_table))) writes
    nothing and reads only its own row's page.

    Under PDL (`kernels/pdl.py`) `positions` and the table are read before the wait for the
    previous kernel: no kernel of the same graph or chain may write them (the engine's pass
    positions are constant buffers)."""
    qkv, parts, split_stride, qkv_dtype = consumer_input(qkv)
    head_dim = _check_inputs(
        qkv, qkv_dtype, positions, rope_table, k_pages, v_pages, tokens_per_row, n_q_heads, n_kv_heads,
        (q_norm_weight, k_norm_weight),
    )  # fmt: skip
    tokens = qkv.shape[0]
    page_size = k_pages.shape[1]
    position_limit = min(page_size, rope_table.shape[0])
    if positions.device.type == "cpu" and tokens:
        low, high = positions.min().item(), positions.max().item()
        if low < 0 or high >= position_limit:
            raise ValueError(
                f"positions must lie in [0, {position_limit}) (page size {page_size}, rope table "
                f"{rope_table.shape[0]} rows), got {low}..{high}"
            )
    shape = (tokens, n_q_heads, head_dim)
    if out_fp8 is not None:
        _check_out_fp8(out_fp8, qkv[:, : n_q_heads * head_dim].unflatten(1, (n_q_heads, head_dim)))
        q8, scales = out_fp8
        out = q8  # never written (QUANT_OUT): only its pointer and strides travel
    else:
        if out is None:
            out = torch.empty(shape, dtype=qkv_dtype, device=qkv.device)
        elif out.shape != shape or out.dtype != qkv_dtype or out.stride(-1) != 1:
            got = f"{out.dtype} {list(out.shape)}"
            raise ValueError(f"out must be {qkv_dtype} {list(shape)} with head_dim contiguous, got {got}")
        q8, scales = out, out  # never touched without QUANT_OUT
    result = out if out_fp8 is None else out_fp8
    if tokens == 0:
        return result
    group = n_q_heads // n_kv_heads
    block_g = triton.next_power_of_2(group)
    plain_warps = PARTIALS_WARPS if parts else PLAIN_WARPS
    # With QK-norm the halves must keep the layout of `qk_norm_rope_kv_write`'s, whose norm
    # reductions they repeat bit for bit: words reach them in another layout (keys an ulp apart).
    with_norm = q_norm_weight is not None or k_norm_weight is not None
    rows = tokens // tokens_per_row
    packed = (
        not with_norm
        and rows >= words_min_rows
        and _reads_words(qkv, qkv.stride(0), split_stride, packed_pairs=packed_pairs)
    )
    dummy = rope_table
    _fast_rope_attention_kernel[(rows, n_kv_heads)](
        qkv, positions, rope_table,
        q_norm_weight if q_norm_weight is not None else dummy,
        k_norm_weight if k_norm_weight is not None else dummy,
        k_pages, v_pages, out, q8, scales, eps, 1.0 / math.sqrt(head_dim) * _LOG2E, position_limit,
        qkv.stride(0), split_stride, rope_table.stride(0),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        out.stride(0), out.stride(1), q8.stride(0), scales.stride(0), scales.stride(1),
        TOKENS=tokens_per_row, NUM_Q_HEADS=n_q_heads, NUM_KV_HEADS=n_kv_heads, GROUP=group,
        BLOCK_G=block_g, BLOCK_R=max(16, tokens_per_row * block_g), HEAD_DIM=head_dim, PAGE=page_size,
        BLOCK_N=max(16, triton.next_power_of_2(page_size)),
        HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None,
        EMULATE=interpreting(), UPCAST=interpreting(), QUANT_OUT=out_fp8 is not None, PARTS=parts,
        PACKED=packed,
        PACKED_TABLE=packed and _reads_words(rope_table, rope_table.stride(0), packed_pairs=packed_pairs),
        num_warps=NORM_WARPS if with_norm else plain_warps,
        **pdl_launch("attention"),
    )  # fmt: skip
    return result
