"""Paged attention in Triton: decode (split-KV) and chunked prefill.

KV cache layout (the engine's `kv_cache.py` allocates it):
- one page pool per layer, `k_pages` and `v_pages` each `[num_pages, page_size, n_kv_heads,
  head_dim]` bf16, page_size `PAGE_SIZE` = 16 by default (any size works);
- `block_tables` int32 `[bs, max_pages_per_seq]`: position p of sequence b lives in page
  `block_tables[b, p // page_size]` at offset `p % page_size`;
- `seq_lens` int32 `[bs]`: keys per sequence, this step's new tokens included (their k/v are
  written first by `norm_rope.qk_norm_rope_kv_write`).

FP8 KV cache (optional): `k_pages`/`v_pages` `torch.float8_e4m3fn` (same shape, contiguous) with
fp32 `k_scales`/`v_scales` `[num_pages, page_size, n_kv_heads]`, one per (token slot, kv head):
the key is `k_pages[...] * k_scales[...]` (`reference.quantize_kv`); the scale of the vector at
element offset `base` of a pool is at offset `base // head_dim` of its scales. The kernels
widen tiles to f16 (exact) for f16 MMAs, multiply each score column by its key's scale and the
probabilities by each value's scale before the PV product (`KV_FP8`); `decode_config` has its
own table for this cache.

GQA: one program handles all g = Hq/Hkv query heads of a kv head (its tile rows are
(query token, head in group) pairs), so each kv head's keys are read once per group.
Decode splits the keys of a sequence across `num_splits` programs writing partial (output,
log-sum-exp) pairs that a second launch merges (or, with `fused_merge`, the last split program
of each sequence and kv head); that fills the GPU at batch 1 and long context.

All scores are kept in base 2 (`exp2`/`log2`), scale folded with log2(e).

FP8 output (`out_fp8`, head_dim 128): in the FP8 decode step the attention output feeds the
o-projection GEMM through a per-token, per-128-column e4m3 quantization; with head_dim 128 each
(token, head) row is exactly one quantization group, so whichever code finalizes a row (the
unsplit store, the fused merge, the merge launch) writes e4m3 values and the fp32 scale itself,
saving the separate `quant.py` launch per layer. The numerics are those of `quantize_activations`
applied to the bf16 output the same call would store (the bf16 store rounds with
`round_to_bf16`, so interpreter and GPU agree bit for bit).

Every kernel takes `USE_PDL` and waits for its inputs first (`kernels/pdl.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.norm_rope import interpreting
from shoal.kernels.pdl import pdl_launch, wait_for_inputs
from shoal.kernels.quant import (
    FP8_MAX,
    GROUP,
    MIN_SCALE,
    _quantize_groups,
    check_activation_scales,
    check_kv_scales,
    round_to_bf16,
)
from shoal.kernels.tuned import ATTENTION_DECODE, config_fields, read_table, update_table

PAGE_SIZE = 16
_LOG2E = 1.4426950408889634
_FP8_MAX = tl.constexpr(FP8_MAX)  # jit functions may only read constexpr globals
_MIN_SCALE = tl.constexpr(MIN_SCALE)


@dataclass(frozen=True)
class AttentionConfig:
    """Tunables; the benchmark's `--sweep` varies them on the GPU."""

    block_n: int = 64  # keys per inner-loop iteration
    block_m: int = 16  # prefill query tokens per program (decode uses 1)
    num_warps: int = 4
    num_stages: int = 2
    target_programs: int = 264  # split-KV aims for this many programs (2 per H200 SM)
    min_split_tokens: int = 256  # never split into pieces shorter than this
    max_splits: int = 32
    # Decode: the last split program of each (sequence, kv head) to finish merges the partials
    # (per-(sequence, kv head) arrival counters), so split-KV costs one launch instead of two.
    fused_merge: bool = False
    # Decode: keys per iteration instead of block_n when a row is split (num_splits > 1); 0 keeps
    # block_n. The split count follows the block table's width, so one batch bucket meets both.
    split_block_n: int = 0
    # ptxas's register limit per thread (0: its own choice). Programs per SM follow the registers:
    # at 4 warps, 168 allow three, 169-255 two (`scripts/inspect_gemm_sm90.py`'s programs_per_sm).
    max_registers: int = 0


DEFAULT_CONFIG = AttentionConfig()


def _decode_tables() -> tuple[Mapping[int, AttentionConfig], Mapping[int, AttentionConfig]]:
    raw = read_table(ATTENTION_DECODE)
    return tuple(
        MappingProxyType({int(bucket): AttentionConfig(**fields) for bucket, fields in raw[kind].items()})
        for kind in ("bf16", "fp8_kv")
    )


# `paged_decode_attention`'s configs per batch bucket (the smallest key >= batch; larger batches
# take the largest), for a bf16 and an e4m3 KV cache (`kernels/tuned/attention_decode.json`). Short
# rows stay split, and split rows take small key blocks that double-buffer in about one 64-key
# buffer's shared memory; an e4m3 cache, half the bytes and more work per key, prefers 128-key blocks.
TUNED_DECODE_CONFIGS, TUNED_DECODE_CONFIGS_FP8_KV = _decode_tables()


def write_decode_table(
    winners: Mapping[int, AttentionConfig], kv_fp8: bool = False, directory: Path | None = None
) -> Path:
    """Merge sweep winners {batch bucket: config} into the decode table (other buckets kept)."""

    def change(table: dict) -> dict:
        entries = {int(bucket): fields for bucket, fields in table["fp8_kv" if kv_fp8 else "bf16"].items()}
        entries.update({bucket: config_fields(config) for bucket, config in winners.items()})
        table["fp8_kv" if kv_fp8 else "bf16"] = {str(bucket): entries[bucket] for bucket in sorted(entries)}
        return table

    return update_table(ATTENTION_DECODE, change, directory)


def decode_config(
    batch: int, kv_fp8: bool = False, replaced: Mapping[int, AttentionConfig] | None = None
) -> AttentionConfig:
    """The tuned decode config for this batch size and cache dtype, else `DEFAULT_CONFIG`;
    `replaced` (`Tuning.attention_configs`) replaces table entries by bucket."""
    table = TUNED_DECODE_CONFIGS_FP8_KV if kv_fp8 else TUNED_DECODE_CONFIGS
    if replaced:
        table = {**table, **replaced}
    for bucket in sorted(table):
        if batch <= bucket:
            return table[bucket]
    return table[max(table)] if table else DEFAULT_CONFIG


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_key_range(
    acc, m_i, l_i, q, query_pos, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row_ptr, kv_head, lo, hi,
    stride_kp, stride_kt, stride_kh, scale_log2e,
    CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
):  # fmt: skip
    """Online-softmax accumulation of q tile rows over keys [lo, hi) of one page table row.

    KV_FP8 (an e4m3 cache): the tiles widen to f16 (exact, one `cvt` per two values on sm90) and
    both MMAs take f16 operands, q and the probabilities rounded to f16 (q exactly above f16's
    subnormal range; the probabilities to 11 bits instead of 8). Widening to bf16 would take three
    conversions per two values and an fp32 tile in registers. Each key's scale multiplies its
    score column and each value's scale its probability column (l_i sums the unscaled ones).

    The page numbers of the next block are loaded one iteration ahead and carried in the loop: the
    key and value addresses then come from a loop-carried value, so Triton's pipeliner treats
    them as direct loads and buffers them by `num_stages` (at 3 stages, the next block is in
    flight while this one is computed)."""
    offs_d = tl.arange(0, HEAD_DIM)
    if KV_FP8:
        q_op = q.to(tl.float16)
    else:
        q_op = q
    keys = tl.arange(0, BLOCK_N)
    next_page = tl.load(table_row_ptr + (lo + keys) // PAGE, mask=lo + keys < hi, other=0)
    for start in range(lo, hi, BLOCK_N):
        tok = start + keys
        valid = tok < hi
        page = next_page.to(tl.int64)
        ahead = tok + BLOCK_N
        next_page = tl.load(table_row_ptr + ahead // PAGE, mask=ahead < hi, other=0)
        base = page * stride_kp + (tok % PAGE) * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + base[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(v_ptr + base[:, None] + offs_d[None, :], mask=valid[:, None], other=0.0)
        if KV_FP8:
            k = k.to(tl.float16)
            v = v.to(tl.float16)
            k_scale = tl.load(k_scale_ptr + base // HEAD_DIM, mask=valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + base // HEAD_DIM, mask=valid, other=0.0)
            s = _dot(q_op, tl.trans(k), UPCAST) * (k_scale * scale_log2e)[None, :]
        else:
            s = _dot(q, tl.trans(k), UPCAST) * scale_log2e
        keep = valid[None, :]
        if CAUSAL:
            keep = keep & (tok[None, :] <= query_pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if KV_FP8:
            acc = acc * alpha[:, None] + _dot((p * v_scale[None, :]).to(v.dtype), v, UPCAST)
        else:
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_fresh(
    q, query_pos, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row_ptr, kv_head, lo, hi,
    stride_kp, stride_kt, stride_kh, scale_log2e, CAUSAL: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, UPCAST: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    """(acc, m, l) of q's rows over keys [lo, hi), from the empty state."""
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    return _attend_key_range(
        acc, m_i, l_i, q, query_pos, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row_ptr, kv_head,
        lo, hi, stride_kp, stride_kt, stride_kh, scale_log2e, CAUSAL, BLOCK_N, PAGE, HEAD_DIM, UPCAST,
        KV_FP8,
    )  # fmt: skip


@triton.jit
def _write_rows(
    x, token, head, row_ok, out_ptr, stride_ot, stride_oh,
    q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, QUANT_OUT: tl.constexpr,
):  # fmt: skip
    """Store finished fp32 rows x [R, D] of (token, head) to `out`, or (QUANT_OUT) as e4m3 + scale.

    Both round to bf16 on the bits (RNE, as the GPU's cast; the interpreter's cast truncates), so
    the quantized rows equal `quantize_activations` of the bf16 rows bit for bit."""
    offs_d = tl.arange(0, HEAD_DIM)
    token = token.to(tl.int64)
    if QUANT_OUT:
        q, scale = _quantize_groups(round_to_bf16(x).to(tl.float32), _FP8_MAX, _MIN_SCALE)
        dest = token * stride_q8 + head * HEAD_DIM
        tl.store(q8_ptr + dest[:, None] + offs_d[None, :], q, mask=row_ok[:, None])
        tl.store(scale_ptr + token * stride_st + head * stride_sh, scale, mask=row_ok)
    else:
        if out_ptr.dtype.element_ty == tl.bfloat16:
            value = round_to_bf16(x)
        else:
            value = x.to(out_ptr.dtype.element_ty)
        dest = token * stride_ot + head * stride_oh
        tl.store(out_ptr + dest[:, None] + offs_d[None, :], value, mask=row_ok[:, None])


@triton.jit
def _store_rows(
    acc, m_i, l_i, token, head, row_ok, split, out_ptr, part_out_ptr, part_lse_ptr,
    stride_ot, stride_oh, num_q_heads, num_slots, q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, WRITE_PARTIAL: tl.constexpr, QUANT_OUT: tl.constexpr,
):  # fmt: skip
    """Finished rows go to `out` (bf16 or e4m3 + scales), or as (normalized output,
    log2-sum-exp) partials."""
    offs_d = tl.arange(0, HEAD_DIM)
    has_keys = l_i > 0
    normed = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if WRITE_PARTIAL:
        slot = (token.to(tl.int64) * num_q_heads + head) * num_slots + split
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + slot, lse, mask=row_ok)
        tl.store(part_out_ptr + slot[:, None] * HEAD_DIM + offs_d[None, :], normed, mask=row_ok[:, None])
    else:
        _write_rows(
            normed, token, head, row_ok, out_ptr, stride_ot, stride_oh,
            q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh, HEAD_DIM, QUANT_OUT,
        )  # fmt: skip


@triton.jit
def _merge_group_partials(
    part_out_ptr, part_lse_ptr, out_ptr, token, kv_head, num_q_heads, num_slots, stride_ot, stride_oh,
    q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
    QUANT_OUT: tl.constexpr,
):  # fmt: skip
    """Combine the partials of one token's g heads of a kv head (one [g, slots, D] load, no loop)."""
    g = tl.arange(0, BLOCK_G)
    slots = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    head = kv_head * GROUP + g
    row = token.to(tl.int64) * num_q_heads + head
    ok = (g[:, None] < GROUP) & (slots[None, :] < num_slots)
    slot_index = row[:, None] * num_slots + slots[None, :]
    lse = tl.load(part_lse_ptr + slot_index, mask=ok, other=float("-inf"), cache_modifier=".cg")
    top = tl.max(lse, 1)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top[:, None])
    partial = tl.load(
        part_out_ptr + slot_index[:, :, None] * HEAD_DIM + offs_d[None, None, :],
        mask=ok[:, :, None],
        other=0.0,
        cache_modifier=".cg",
    )
    total = tl.sum(weight, 1)
    merged = tl.sum(partial * weight[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]
    _write_rows(
        merged, token + tl.zeros_like(g), head, g < GROUP, out_ptr, stride_ot, stride_oh,
        q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh, HEAD_DIM, QUANT_OUT,
    )  # fmt: skip


@triton.jit
def _attend_split(
    q, query_pos, token, head, row_ok, seq, kv_head, split, lo, hi, k_ptr, v_ptr, k_scale_ptr,
    v_scale_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, block_tables_ptr, q8_ptr, scale_ptr,
    scale_log2e, num_q_heads, num_slots, num_splits, stride_bt, stride_kp, stride_kt,
    stride_kh, stride_ot, stride_oh, stride_q8, stride_st, stride_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
    FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr, UPCAST: tl.constexpr, QUANT_OUT: tl.constexpr,
    KV_FP8: tl.constexpr,
):  # fmt: skip
    """One split's keys [lo, hi): finished rows, or a partial (and with FUSED_MERGE, the merge by
    the last split of the (sequence, kv head) to arrive)."""
    acc, m_i, l_i = _attend_fresh(
        q, query_pos, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
        block_tables_ptr + seq.to(tl.int64) * stride_bt, kv_head, lo, hi, stride_kp, stride_kt,
        stride_kh, scale_log2e, CAUSAL, BLOCK_R, BLOCK_N, PAGE, HEAD_DIM, UPCAST, KV_FP8,
    )  # fmt: skip
    _store_rows(
        acc, m_i, l_i, token, head, row_ok, split, out_ptr, part_out_ptr, part_lse_ptr,
        stride_ot, stride_oh, num_q_heads, num_slots, q8_ptr, scale_ptr, stride_q8, stride_st,
        stride_sh, HEAD_DIM, WRITE_PARTIAL, QUANT_OUT,
    )  # fmt: skip
    if FUSED_MERGE:
        tl.debug_barrier()  # every thread's partial is written before the release below
        counter = counter_ptr + seq * (tl.num_programs(2) // num_splits) + kv_head
        arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if arrived == num_splits - 1:
            _merge_group_partials(
                part_out_ptr, part_lse_ptr, out_ptr, seq, kv_head, num_q_heads, num_slots,
                stride_ot, stride_oh, q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh,
                GROUP, BLOCK_G, BLOCK_S, HEAD_DIM, QUANT_OUT,
            )  # fmt: skip
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["num_slots", "num_splits"])
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, kv_start_ptr, q8_ptr, scale_ptr,
    scale_log2e, num_q_heads, num_slots, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kp, stride_kt, stride_kh,
    stride_q8, stride_st, stride_sh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    IS_DECODE: tl.constexpr, CAUSAL: tl.constexpr, HAS_KV_START: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr, UPCAST: tl.constexpr,
    QUANT_OUT: tl.constexpr, KV_FP8: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (bs, query blocks, Hkv * num_splits): a block of one sequence's queries x the g heads
    of one kv head, over one split of that sequence's (causally visible) keys. With FUSED_MERGE
    (decode only), the last of a (sequence, kv head)'s split programs to finish merges them.
    HAS_KV_START (keys from kv_start[b] on) has no caller; `scripts/inspect_attention_sm90.py`
    names it when it compiles this kernel."""
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    if IS_DECODE:  # the step's lengths: read before the wait (`paged_decode_attention`'s contract)
        seq_len = tl.load(seq_lens_ptr + seq)
        wait_for_inputs(USE_PDL)  # q and the pages were written just before
    else:
        wait_for_inputs(USE_PDL)
        seq_len = tl.load(seq_lens_ptr + seq)
    if IS_DECODE:
        q_start = seq
        q_len = 1
    else:
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_M < q_len:
        rows = tl.arange(0, BLOCK_R)
        in_group = rows % BLOCK_G
        q_index = q_block * BLOCK_M + rows // BLOCK_G
        row_ok = (in_group < GROUP) & (rows // BLOCK_G < BLOCK_M) & (q_index < q_len)
        token = q_start + q_index
        head = kv_head * GROUP + in_group
        query_pos = seq_len - q_len + q_index
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptrs = q_ptr + (token.to(tl.int64) * stride_qt + head * stride_qh)[:, None] + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

        kv_lo = 0
        if HAS_KV_START:
            kv_lo = tl.load(kv_start_ptr + seq)
        last_query = tl.minimum(q_block * BLOCK_M + BLOCK_M, q_len) - 1
        kv_hi = seq_len - q_len + last_query + 1
        span = tl.maximum(kv_hi - kv_lo, 0)
        chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
        lo = kv_lo + split * chunk
        hi = tl.minimum(lo + chunk, kv_hi)
        _attend_split(
            q, query_pos, token, head, row_ok, seq, kv_head, split, lo, hi, k_ptr, v_ptr, k_scale_ptr,
            v_scale_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, block_tables_ptr, q8_ptr,
            scale_ptr, scale_log2e, num_q_heads, num_slots, num_splits, stride_bt, stride_kp, stride_kt,
            stride_kh, stride_ot, stride_oh, stride_q8, stride_st, stride_sh,
            GROUP, BLOCK_G, BLOCK_R, BLOCK_N, PAGE, HEAD_DIM, CAUSAL, WRITE_PARTIAL, FUSED_MERGE,
            BLOCK_S, UPCAST, QUANT_OUT, KV_FP8,
        )  # fmt: skip


@triton.jit
def _merge_partials_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, num_q_heads, num_slots, stride_ot, stride_oh,
    q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh,
    BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, QUANT_OUT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (T, Hq): combine one row's partial outputs weighted by exp2(lse - max lse)."""
    wait_for_inputs(USE_PDL)  # the partials come from the launch just before
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = token * num_q_heads + head
    slots = tl.arange(0, BLOCK_S)
    ok = slots < num_slots
    lse = tl.load(part_lse_ptr + row * num_slots + slots, mask=ok, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top)
    offs_d = tl.arange(0, HEAD_DIM)
    partial = tl.load(
        part_out_ptr + (row * num_slots + slots)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    merged = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    one = tl.arange(0, 1)  # the row as a [1, D] tile: the quantizer works on [rows, 128]
    _write_rows(
        merged[None, :], token + one, head + one, one < 1, out_ptr, stride_ot, stride_oh,
        q8_ptr, scale_ptr, stride_q8, stride_st, stride_sh, HEAD_DIM, QUANT_OUT,
    )  # fmt: skip


def split_launch_config(config: AttentionConfig, num_splits: int) -> AttentionConfig:
    """The config a decode launch of `num_splits` splits compiles: split rows take
    `split_block_n`-key blocks where the entry sets it."""
    if num_splits > 1 and config.split_block_n:
        return replace(config, block_n=config.split_block_n)
    return config


def choose_num_splits(batch: int, n_kv_heads: int, max_context: int, config: AttentionConfig) -> int:
    """Splits per sequence so that batch * Hkv * splits reaches `target_programs`, without
    pieces shorter than `min_split_tokens`. Depends only on shapes, so CUDA graphs can fix it."""
    wanted = math.ceil(config.target_programs / max(1, batch * n_kv_heads))
    longest = max(1, max_context // config.min_split_tokens)
    return max(1, min(wanted, longest, config.max_splits))


def _check_inputs(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> tuple[int, int, int]:  # fmt: skip
    if k_pages.shape != v_pages.shape or k_pages.stride() != v_pages.stride():
        raise ValueError("k_pages and v_pages must have the same shape and layout")
    if k_pages.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("head_dim must be the innermost, contiguous dimension")
    hq, hkv, d = q.shape[1], k_pages.shape[2], q.shape[2]
    if hq % hkv or d & (d - 1):
        raise ValueError(f"need Hq % Hkv == 0 and a power-of-two head_dim (got {hq}, {hkv}, {d})")
    check_kv_scales(k_pages, v_pages, k_scales, v_scales)
    return hq, hkv, d


def _check_out_fp8(out_fp8: tuple[Tensor, Tensor], q: Tensor) -> None:
    """Validate the (e4m3 [T, Hq*D], group-major fp32 scales [T, Hq]) pair of an `out_fp8`."""
    tokens, hq, d = q.shape
    if d != GROUP:
        raise ValueError(f"out_fp8 needs head_dim == {GROUP} (one quantization group per head), got {d}")
    q8, scales = out_fp8
    if q8.dtype != torch.float8_e4m3fn or tuple(q8.shape) != (tokens, hq * d) or q8.stride(1) != 1:
        raise ValueError(
            f"out_fp8 values must be float8_e4m3fn [{tokens}, {hq * d}] with unit column stride, "
            f"got {q8.dtype} {tuple(q8.shape)} strides {q8.stride()}"
        )
    check_activation_scales(scales, tokens, hq * d)


def _register_limit(config: AttentionConfig) -> dict:
    """Launch keywords for `config.max_registers` (none: ptxas's own choice)."""
    return {"maxnreg": config.max_registers} if config.max_registers else {}


_merge_counters: dict[torch.device, Tensor] = {}


def _counters(device: torch.device, count: int) -> Tensor:
    """Zeroed int32 arrival counters for the fused merge, grown on demand; each launch leaves
    them at zero again, so one buffer serves every layer and every graph replay on a stream."""
    current = _merge_counters.get(device)
    if current is None or current.numel() < count:
        current = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _merge_counters[device] = current
    return current


def _launch_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor | None, out: Tensor, part_out: Tensor | None,
    part_lse: Tensor | None, num_slots: int, grid_q_blocks: int, block_m: int, num_splits: int,
    scale: float, config: AttentionConfig, fused_merge: bool = False,
    out_fp8: tuple[Tensor, Tensor] | None = None, k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
):  # fmt: skip
    hq, hkv, d = _check_inputs(q, k_pages, v_pages, k_scales, v_scales)
    q8, scales = out_fp8 if out_fp8 is not None else (out, out)
    group = hq // hkv
    block_g = triton.next_power_of_2(group)
    dummy = seq_lens  # any tensor: pointers a constexpr branch never reads
    counters = _counters(q.device, seq_lens.shape[0] * hkv) if fused_merge else dummy
    # a fixed width (one compile for every split count up to max_splits); unused without fusion
    block_s = triton.next_power_of_2(max(num_slots, config.max_splits)) if fused_merge else 1
    _paged_attention_kernel[(seq_lens.shape[0], grid_q_blocks, hkv * num_splits)](
        q, k_pages, v_pages,
        k_pages if k_scales is None else k_scales, k_pages if v_scales is None else v_scales, out,
        part_out if part_out is not None else out, part_lse if part_lse is not None else out, counters,
        block_tables, seq_lens,
        query_start_loc if query_start_loc is not None else dummy,
        dummy, q8, scales,
        scale * _LOG2E, hq, num_slots, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        q8.stride(0), scales.stride(0), scales.stride(1),
        GROUP=group, BLOCK_G=block_g, BLOCK_M=block_m, BLOCK_R=max(16, block_m * block_g),
        BLOCK_N=config.block_n, PAGE=k_pages.shape[1], HEAD_DIM=d,
        IS_DECODE=query_start_loc is None, CAUSAL=query_start_loc is not None,
        HAS_KV_START=False, WRITE_PARTIAL=part_out is not None,
        FUSED_MERGE=fused_merge, BLOCK_S=block_s, UPCAST=interpreting(),
        QUANT_OUT=out_fp8 is not None, KV_FP8=k_scales is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch("attention"),
        **_register_limit(config),
    )  # fmt: skip


def _merge(
    part_out: Tensor, part_lse: Tensor, out: Tensor, config: AttentionConfig,
    out_fp8: tuple[Tensor, Tensor] | None = None,
) -> None:  # fmt: skip
    tokens, hq, slots, d = part_out.shape
    q8, scales = out_fp8 if out_fp8 is not None else (out, out)
    _merge_partials_kernel[(tokens, hq)](
        part_out, part_lse, out, hq, slots, out.stride(0), out.stride(1),
        q8, scales, q8.stride(0), scales.stride(0), scales.stride(1),
        BLOCK_S=triton.next_power_of_2(slots), HEAD_DIM=d, QUANT_OUT=out_fp8 is not None,
        num_warps=4, **pdl_launch("attention"),
    )  # fmt: skip


def paged_decode_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_tables: Tensor, seq_lens: Tensor,
    scale: float | None = None, num_splits: int | None = None, config: AttentionConfig | None = None,
    out: Tensor | None = None, out_fp8: tuple[Tensor, Tensor] | None = None, k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """One query per sequence: q [bs, Hq, D] -> [bs, Hq, D]. With `num_splits` > 1 (default:
    `choose_num_splits` over the block table's capacity) the partials are merged, by a second
    launch or (`config.fused_merge`) by the last split program. `config` defaults to the tuned
    entry for this batch size (`decode_config`).

    `out_fp8` = (e4m3 [bs, Hq*D], scales from `quant.new_activation_scales(bs, Hq*D)`), D == 128:
    the output is written quantized for the FP8 o-projection instead of to `out`, and returned.

    `k_scales`/`v_scales`: the fp32 [num_pages, page_size, Hkv] scales of float8_e4m3fn pages
    (required then, refused otherwise; see the module docstring).

    Under PDL (`kernels/pdl.py`) `seq_lens` is read before the wait for the previous kernel: no
    kernel of the same graph or chain may write it (the engine uploads the step's lengths before
    the step; the fast passes' are constant)."""
    bs, hq, d = q.shape
    config = decode_config(bs, kv_fp8=k_scales is not None) if config is None else config
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if out_fp8 is not None:
        _check_out_fp8(out_fp8, q)
        out = q if out is None else out  # never written: only its pointer type and strides travel
    out = torch.empty_like(q) if out is None else out
    result = out if out_fp8 is None else out_fp8
    if num_splits is None:
        capacity = block_tables.shape[1] * k_pages.shape[1]
        num_splits = choose_num_splits(bs, k_pages.shape[2], capacity, config)
    config = split_launch_config(config, num_splits)
    if num_splits == 1:
        _launch_attention(
            q, k_pages, v_pages, block_tables, seq_lens, None, out, None, None, 1, 1, 1, 1,
            scale, config, out_fp8=out_fp8, k_scales=k_scales, v_scales=v_scales,
        )  # fmt: skip
        return result
    part_out = torch.empty(bs, hq, num_splits, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bs, hq, num_splits, dtype=torch.float32, device=q.device)
    _launch_attention(
        q, k_pages, v_pages, block_tables, seq_lens, None, out, part_out, part_lse,
        num_splits, 1, 1, num_splits, scale, config, fused_merge=config.fused_merge, out_fp8=out_fp8,
        k_scales=k_scales, v_scales=v_scales,
    )  # fmt: skip
    if not config.fused_merge:
        _merge(part_out, part_lse, out, config, out_fp8)
    return result


def paged_prefill_attention(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor, max_query_len: int, scale: float | None = None,
    config: AttentionConfig = DEFAULT_CONFIG, out: Tensor | None = None,
    out_fp8: tuple[Tensor, Tensor] | None = None, k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """Varlen causal attention for (chunked) prefill: sequence b's queries are
    q[query_start_loc[b]:query_start_loc[b+1]] [T, Hq, D], its last positions; earlier chunks
    and cached prefix pages are visible through the block table. Returns [T, Hq, D], or with
    `out_fp8` (as in `paged_decode_attention`) that quantized pair. `k_scales`/`v_scales`: as in
    `paged_decode_attention`, for an FP8 KV cache."""
    d = q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    if out_fp8 is not None:
        _check_out_fp8(out_fp8, q)
        out = q if out is None else out  # never written
    out = torch.empty_like(q) if out is None else out
    block_m = config.block_m
    _launch_attention(
        q, k_pages, v_pages, block_tables, seq_lens, query_start_loc, out, None, None, 1,
        max(1, triton.cdiv(max_query_len, block_m)), block_m, 1, scale, config, out_fp8=out_fp8,
        k_scales=k_scales, v_scales=v_scales,
    )  # fmt: skip
    return out if out_fp8 is None else out_fp8
