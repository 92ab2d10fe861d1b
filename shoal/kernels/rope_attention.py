"""The slow transformer's decode attention with its QK-norm + RoPE + KV write in the same launch.

A decode layer otherwise runs `norm_rope.qk_norm_rope_kv_write` (one token per row: normalize and
rotate q and k, write k and v into the pages) and then `attention.paged_decode_attention`. At
batch 1 the first launch is about 1.1 µs of a kernel boundary for almost no work, 36 times a
frame (docs/performance.md run 131). Here each split program of `paged_decode_attention`'s grid
(sequence, kv head, split) does that work for what it needs:

- every program normalizes and rotates the g = Hq/Hkv query heads of its kv head (the same few
  hundred values in every split: cheaper than a boundary);
- the program whose split holds the step's key (position seq_len - 1, the "owner") normalizes
  and rotates that key, writes it and the value into the pages (bf16, or e4m3 with its scale, as
  `qk_norm_rope_kv_write` writes them) and folds that one key into its softmax state from
  registers first; the split's other keys come from the pages, the first `preload_keys` of them
  loaded before the PDL wait (they were written by earlier steps), the rest by the key loop.

qkv may be the qkv GEMM's `SplitKPartials`, summed while loading as `qk_norm_rope_kv_write` sums
them. The keys written are the two-kernel path's bits where the norm's reductions run in the same
order (always in the interpreter; on the GPU a 4-warp program may sum a head's squares in another
order than that kernel's single warp, so a key can differ in its last bf16 bit); the output
matches within bf16 rounding (the new key's product is taken in fp32 instead of by the MMA).

Under PDL the step's metadata (lengths, positions, slots, block tables) and the constants (RoPE
table, norm weights) are read before the wait; qkv after it (`kernels/pdl.py`).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.attention import (
    _LOG2E,
    AttentionConfig,
    _attend_split,
    _check_inputs,
    _check_out_fp8,
    _counters,
    _merge,
    _online_softmax_step,
    _preloaded_tile,
    _register_limit,
    choose_num_splits,
    decode_config,
    split_launch_config,
)
from shoal.kernels.fp8_gemm import SplitKPartials
from shoal.kernels.norm_rope import (
    _consumer_input,
    _rms_scale,
    cast_rne,
    interpreting,
    load_summing_partials,
    norm_weight_halves,
)
from shoal.kernels.pdl import pdl_launch, wait_for_inputs
from shoal.kernels.quant import FP8_MAX, MIN_SCALE, quantize_by, scale_from_amax


@triton.jit
def _new_key_and_value(
    row_ptr, split_stride, k_w0, k_w1, cos, sin, eps, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, place,
    write, kv_head, num_q_heads, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_K_NORM: tl.constexpr, PARTS: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """The step's key (normalized, rotated) and value of kv head `kv_head` from the token's qkv
    row, stored at `place` in the pages where `write`; returned as the attention reads them back:
    (k [D], v [D] in the pool's element type, their scales: 1.0 for bf16 pools)."""
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, half)
    full = tl.arange(0, HEAD_DIM)
    k_row = row_ptr + (num_q_heads + kv_head) * HEAD_DIM
    x0 = load_summing_partials(k_row, 2 * offs, offs < half, split_stride, PARTS, EMULATE)
    x1 = load_summing_partials(k_row, 2 * offs + 1, offs < half, split_stride, PARTS, EMULATE)
    v = load_summing_partials(
        row_ptr + (num_q_heads + NUM_KV_HEADS + kv_head) * HEAD_DIM, full, full < HEAD_DIM, split_stride,
        PARTS, EMULATE,
    )  # fmt: skip
    x0, x1 = _rms_scale(x0, x1, k_w0, k_w1, eps, HEAD_DIM, HAS_K_NORM, EMULATE)
    f0 = x0.to(tl.float32)
    f1 = x1.to(tl.float32)
    rotated0 = f0 * cos - f1 * sin
    rotated1 = f1 * cos + f0 * sin
    if KV_FP8:
        k0 = cast_rne(rotated0, tl.bfloat16, EMULATE).to(tl.float32)
        k1 = cast_rne(rotated1, tl.bfloat16, EMULATE).to(tl.float32)
        k_scale = scale_from_amax(
            tl.maximum(tl.max(tl.abs(k0), 0), tl.max(tl.abs(k1), 0)), FP8_MAX_, MIN_SCALE_
        )
        k = tl.interleave(quantize_by(k0, k_scale, FP8_MAX_), quantize_by(k1, k_scale, FP8_MAX_))
        vf = cast_rne(v, tl.bfloat16, EMULATE).to(tl.float32)
        v_scale = scale_from_amax(tl.max(tl.abs(vf), 0), FP8_MAX_, MIN_SCALE_)
        v = quantize_by(vf, v_scale, FP8_MAX_)
        tl.store(k_scale_ptr + place // HEAD_DIM, k_scale, mask=write)
        tl.store(v_scale_ptr + place // HEAD_DIM, v_scale, mask=write)
    else:
        k_type = k_ptr.dtype.element_ty
        k = tl.interleave(cast_rne(rotated0, k_type, EMULATE), cast_rne(rotated1, k_type, EMULATE))
        v = v.to(v_ptr.dtype.element_ty)
        k_scale = 1.0
        v_scale = 1.0
    tl.store(k_ptr + place + full, k, mask=write)
    tl.store(v_ptr + place + full, v, mask=write)
    return k, v, k_scale, v_scale


@triton.jit
def _rotated_queries(
    row_ptr, split_stride, kv_head, q_w0, q_w1, cos, sin, eps, row_ok, in_group,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_Q_NORM: tl.constexpr, PARTS: tl.constexpr,
    EMULATE: tl.constexpr,
):  # fmt: skip
    """The q tile [BLOCK_R, D] (rows: the heads of kv head `kv_head`'s group) normalized per head
    and rotated as `qk_norm_rope_kv_write` stores q (rounded to bf16)."""
    half: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, half)
    pair = tl.arange(0, 2)
    head = kv_head * GROUP + in_group
    at = (head * HEAD_DIM)[:, None, None] + (2 * offs)[None, :, None] + pair[None, None, :]
    pairs = load_summing_partials(row_ptr, at, row_ok[:, None, None], split_stride, PARTS, EMULATE)
    x0, x1 = tl.split(pairs)
    f0 = x0.to(tl.float32)
    f1 = x1.to(tl.float32)
    if HAS_Q_NORM:
        mean_square = (tl.sum(f0 * f0, 1) + tl.sum(f1 * f1, 1)) / HEAD_DIM
        inv = 1.0 / tl.sqrt(mean_square + eps)
        f0 = cast_rne(f0 * inv[:, None] * q_w0[None, :], tl.bfloat16, EMULATE).to(tl.float32)
        f1 = cast_rne(f1 * inv[:, None] * q_w1[None, :], tl.bfloat16, EMULATE).to(tl.float32)
    return tl.interleave(
        cast_rne(f0 * cos[None, :] - f1 * sin[None, :], tl.bfloat16, EMULATE),
        cast_rne(f1 * cos[None, :] + f0 * sin[None, :], tl.bfloat16, EMULATE),
    )


@triton.jit(do_not_specialize=["num_slots", "num_splits"])
def _rope_decode_attention_kernel(
    qkv_ptr, positions_ptr, slots_ptr, table_ptr, q_norm_ptr, k_norm_ptr,
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    block_tables_ptr, seq_lens_ptr, q8_ptr, scale_ptr,
    eps, scale_log2e, num_q_heads, num_slots, num_splits,
    stride_qkv, stride_qkv_s, stride_table, stride_ot, stride_oh, stride_bt, stride_kp, stride_kt,
    stride_kh, stride_q8, stride_st, stride_sh,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, HAS_Q_NORM: tl.constexpr,
    HAS_K_NORM: tl.constexpr, PARTS: tl.constexpr, WRITE_PARTIAL: tl.constexpr,
    FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr, UPCAST: tl.constexpr, QUANT_OUT: tl.constexpr,
    KV_FP8: tl.constexpr, PRELOAD: tl.constexpr, EMULATE: tl.constexpr, FP8_MAX_: tl.constexpr,
    MIN_SCALE_: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (bs, 1, Hkv * num_splits), as `paged_decode_attention`'s decode grid (module docstring)."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    half: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, half)
    # The step's metadata and the constants, before the wait.
    seq_len = tl.load(seq_lens_ptr + seq)
    position = tl.load(positions_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    cos = tl.load(table_ptr + position * stride_table + 2 * offs_h).to(tl.float32)
    sin = tl.load(table_ptr + position * stride_table + 2 * offs_h + 1).to(tl.float32)
    q_w0, q_w1 = norm_weight_halves(q_norm_ptr, offs_h, HAS_Q_NORM)
    k_w0, k_w1 = norm_weight_halves(k_norm_ptr, offs_h, HAS_K_NORM)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)
    newest = seq_len - 1  # the step's key: this launch writes it
    owner = (lo <= newest) & (newest < hi)
    older_hi = tl.minimum(hi, newest)  # this split's keys from earlier steps: [lo, older_hi)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if PRELOAD > 0:
        k0, v0, k0_scale, v0_scale, base0, tok0, valid0 = _preloaded_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, seq_len, kv_head, split, num_splits,
            stride_kp, stride_kt, stride_kh, BLOCK_N, PAGE, HEAD_DIM, PRELOAD, KV_FP8,
        )  # fmt: skip
    wait_for_inputs(USE_PDL)  # qkv comes from the GEMM just before

    row_ptr = qkv_ptr + seq.to(tl.int64) * stride_qkv
    rows = tl.arange(0, BLOCK_R)
    in_group = rows % BLOCK_G
    row_ok = (in_group < GROUP) & (rows < BLOCK_G)
    head = kv_head * GROUP + in_group
    q = _rotated_queries(
        row_ptr, stride_qkv_s, kv_head, q_w0, q_w1, cos, sin, eps, row_ok, in_group, GROUP, HEAD_DIM,
        HAS_Q_NORM, PARTS, EMULATE,
    )  # fmt: skip
    place = (slot // PAGE) * stride_kp + (slot % PAGE) * stride_kt + kv_head * stride_kh
    k_new, v_new, k_new_scale, v_new_scale = _new_key_and_value(
        row_ptr, stride_qkv_s, k_w0, k_w1, cos, sin, eps, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, place,
        owner & (slot >= 0), kv_head, num_q_heads, NUM_KV_HEADS, HEAD_DIM, HAS_K_NORM, PARTS, KV_FP8,
        FP8_MAX_, MIN_SCALE_, EMULATE,
    )  # fmt: skip

    # The new key first, from registers (the owner only): scores in fp32 as the MMA's operands.
    if KV_FP8:
        q_op = q.to(tl.float16)
        s_new = tl.sum(q_op.to(tl.float32) * k_new.to(tl.float16).to(tl.float32)[None, :], 1)
        s_new = s_new * (k_new_scale * scale_log2e)
        v_row = v_new.to(tl.float16).to(tl.float32) * v_new_scale
    else:
        q_op = q
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale_log2e
        v_row = v_new.to(tl.float32)
    s_new = tl.where(owner, s_new, float("-inf"))
    m_i = tl.maximum(s_new, -1.0e30)
    p_new = tl.exp2(s_new - m_i)
    l_i = p_new
    acc = p_new[:, None] * v_row[None, :]
    start = lo
    if PRELOAD > 0:  # then the keys loaded before the wait
        keep = valid0 & (tok0 < older_hi)
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, q_op, k0, v0, k0_scale, v0_scale, keep[None, :], scale_log2e, UPCAST, KV_FP8
        )
        start = lo + PRELOAD
    _attend_split(
        acc, m_i, l_i, q, seq + tl.zeros_like(rows), seq, head, row_ok, seq, kv_head, split, start,
        older_hi, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, part_out_ptr, part_lse_ptr,
        counter_ptr, block_tables_ptr, q8_ptr, scale_ptr, scale_log2e, num_q_heads, num_slots,
        num_splits, stride_bt, stride_kp, stride_kt, stride_kh, stride_ot, stride_oh, stride_q8,
        stride_st, stride_sh, GROUP, BLOCK_G, BLOCK_R, BLOCK_N, PAGE, HEAD_DIM, False, WRITE_PARTIAL,
        FUSED_MERGE, BLOCK_S, UPCAST, QUANT_OUT, KV_FP8,
    )  # fmt: skip


def rope_decode_attention(
    qkv: Tensor | SplitKPartials,
    positions: Tensor,
    rope_table: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    slot_mapping: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    out: Tensor | None = None,
    out_fp8: tuple[Tensor, Tensor] | None = None,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
    config: AttentionConfig | None = None,
    num_splits: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`qk_norm_rope_kv_write` then `paged_decode_attention` for one token per sequence, in one
    launch (plus the merge launch when the config does not fuse it): qkv [bs, (Hq+2Hkv)*D] (or its
    split-K partials) -> the attention [bs, Hq, D], or the `out_fp8` pair filled. The step's key
    and value go into the pages at `slot_mapping` (a negative slot writes nothing); `seq_lens`
    count that key. Arguments as the two functions take them; `config` defaults to the tuned
    decode entry for the batch."""
    qkv, parts, split_stride, qkv_dtype = _consumer_input(qkv)
    bs, width = qkv.shape
    head_dim = width // (n_q_heads + 2 * n_kv_heads)
    if qkv_dtype != torch.bfloat16 or qkv.stride(1) != 1:
        raise ValueError("qkv must be bf16 (or bf16-summed partials) with contiguous rows")
    if rope_table.stride(-1) != 1 or rope_table.stride(-2) != 2:
        raise ValueError("the rope table's [D/2, 2] rows must be contiguous")
    q_shape = torch.empty(bs, n_q_heads, head_dim, device="meta")  # shapes only
    hq, hkv, d = _check_inputs(q_shape, k_pages, v_pages, k_scales, v_scales)
    if (hq, hkv, d) != (n_q_heads, n_kv_heads, head_dim):
        raise ValueError(f"pages hold {hkv} kv heads of {d}, expected {n_kv_heads} of {head_dim}")
    kv_fp8 = k_scales is not None
    config = decode_config(bs, kv_fp8=kv_fp8) if config is None else config
    if num_splits is None:
        num_splits = choose_num_splits(bs, hkv, block_tables.shape[1] * k_pages.shape[1], config)
    config = split_launch_config(config, num_splits)
    if out_fp8 is not None:
        _check_out_fp8(out_fp8, q_shape)
    if out is None:
        out = torch.empty(bs, hq, d, dtype=torch.bfloat16, device=qkv.device)
    q8, scales = out_fp8 if out_fp8 is not None else (out, out)
    split = num_splits > 1
    fused = split and config.fused_merge
    part_out = part_lse = out
    if split:
        part_out = torch.empty(bs, hq, num_splits, d, dtype=torch.float32, device=qkv.device)
        part_lse = torch.empty(bs, hq, num_splits, dtype=torch.float32, device=qkv.device)
    group = hq // hkv
    block_g = triton.next_power_of_2(group)
    counters = _counters(qkv.device, bs * hkv) if fused else seq_lens
    dummy = rope_table
    _rope_decode_attention_kernel[(bs, 1, hkv * num_splits)](
        qkv, positions, slot_mapping, rope_table,
        q_norm_weight if q_norm_weight is not None else dummy,
        k_norm_weight if k_norm_weight is not None else dummy,
        k_pages, v_pages, k_scales if kv_fp8 else k_pages, v_scales if kv_fp8 else k_pages,
        out, part_out, part_lse, counters, block_tables, seq_lens, q8, scales,
        eps, (1.0 / math.sqrt(d)) * _LOG2E, hq, num_splits, num_splits,
        qkv.stride(0), split_stride, rope_table.stride(0), out.stride(0), out.stride(1),
        block_tables.stride(0), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        q8.stride(0), scales.stride(0), scales.stride(1),
        NUM_KV_HEADS=hkv, GROUP=group, BLOCK_G=block_g, BLOCK_R=max(16, block_g), BLOCK_N=config.block_n,
        PAGE=k_pages.shape[1], HEAD_DIM=d, HAS_Q_NORM=q_norm_weight is not None,
        HAS_K_NORM=k_norm_weight is not None, PARTS=parts, WRITE_PARTIAL=split, FUSED_MERGE=fused,
        BLOCK_S=triton.next_power_of_2(max(num_splits, config.max_splits)) if fused else 1,
        UPCAST=interpreting(), QUANT_OUT=out_fp8 is not None, KV_FP8=kv_fp8,
        PRELOAD=config.preload_keys, EMULATE=interpreting(), FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_launch("attention"),
        **_register_limit(config),
    )  # fmt: skip
    if split and not fused:
        _merge(part_out, part_lse, out, config, out_fp8)
    return out if out_fp8 is None else out_fp8
