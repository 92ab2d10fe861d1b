"""The slow transformer's decode attention with QK-norm + RoPE + KV write in the same launch.

Each slow layer of a decode step ran two kernels between the qkv GEMM and the o projection:
`norm_rope.qk_norm_rope_kv_write` (normalize and rotate q and k, write k and v into the pages)
and `attention.paged_decode_attention`. Under PDL every kernel boundary costs the drain of one
grid and the ramp of the next; the first kernel's work is small (one token per row). Here each
attention program does it itself, for what it needs:

- every program (row b, kv head h, split s) sums its q heads out of the qkv GEMM's output (or its
  split-K partials, `SplitKPartials`, in split order as the GEMM's reduction would), normalizes
  and rotates them: the g query heads of kv head h;
- it attends them over the row's cached keys [0, seq_len - 1), split as `paged_decode_attention`
  splits a row (the same `decode_config`, split count and fused merge);
- the last split (s = num_splits - 1) also normalizes and rotates the new token's k head h,
  stores it and v head h at the token's slot (a negative slot stores nothing: padding rows of a
  CUDA-graph batch), and starts its softmax state from that key, before its key loop. The key
  is never read back by this launch; the next step's attention reads it from the page.

Numerics: the same expressions as the two kernels (`_rms_scale` for k, the per-row form for q,
RoPE in fp32 with one rounding, probabilities rounded to the value dtype before the PV product),
so in the interpreter the pages get the same bits as `qk_norm_rope_kv_write` writes. On the GPU
the reductions (a head's mean square, the new key's score) run in this kernel's 4-warp layouts,
not the one-warp order of `qk_norm_rope_kv_write`, and the new key joins the softmax first, so
keys and outputs may differ from the two-kernel path in the last bit. The engine's results
already depend on the batch size at that level (each M bucket has its own split-K).

bf16 (or fp16/fp32) pages only; an e4m3 cache keeps the two kernels.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.attention import (
    _LOG2E,
    AttentionConfig,
    _attend_key_range,
    _check_out_fp8,
    _counters,
    _merge,
    choose_num_splits,
    decode_config,
    finish_split,
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

# The paged decode kernel's register count: four 4-warp programs per SM, which batch 64 needs to
# run its 512 programs in one wave. Left to itself ptxas gives this kernel 164 (the QK-norm
# prologue's [16, 64] tiles), three programs per SM, and the step lost 6.8% at batch 64 (docs/
# performance.md run 111); capped, it spills 16 bytes.
MAX_REGISTERS = 128


@triton.jit(do_not_specialize=["num_slots", "num_splits"])
def _decode_rope_attention_kernel(
    qkv_ptr, positions_ptr, slots_ptr, table_ptr, q_norm_ptr, k_norm_ptr, k_ptr, v_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, counter_ptr, block_tables_ptr, seq_lens_ptr, q8_ptr,
    scale_ptr, eps, scale_log2e, num_slots, num_splits,
    stride_qkv, stride_qkv_s, stride_table, stride_ot, stride_oh, stride_bt, stride_kp, stride_kt,
    stride_kh, stride_q8, stride_st, stride_sh,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr, PARTS: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, FUSED_MERGE: tl.constexpr, BLOCK_S: tl.constexpr,
    EMULATE: tl.constexpr, UPCAST: tl.constexpr, QUANT_OUT: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Grid (bs, 1, Hkv * num_splits), as the paged decode kernel's (module docstring).

    Before the PDL wait: the row's length, position, slot and RoPE row (uploaded before the step,
    `decode_rope_attention`'s contract) and the norm weights; after it, qkv."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    half: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, half)
    seq_len = tl.load(seq_lens_ptr + seq)
    position = tl.load(positions_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    cos = tl.load(table_ptr + position * stride_table + 2 * offs_h).to(tl.float32)
    sin = tl.load(table_ptr + position * stride_table + 2 * offs_h + 1).to(tl.float32)
    q_w0, q_w1 = norm_weight_halves(q_norm_ptr, offs_h, HAS_Q_NORM)
    k_w0, k_w1 = norm_weight_halves(k_norm_ptr, offs_h, HAS_K_NORM)
    wait_for_inputs(USE_PDL)  # qkv comes from the GEMM just before

    # The g query heads of this kv head: tile rows (head in group), normalized and rotated.
    rows = tl.arange(0, BLOCK_R)
    in_group = rows % BLOCK_G
    row_ok = (in_group < GROUP) & (rows < BLOCK_G)
    head = kv_head * GROUP + in_group
    qkv_row = seq.to(tl.int64) * stride_qkv
    q_at = (qkv_row + head * HEAD_DIM)[:, None] + 2 * offs_h[None, :]
    x0 = load_summing_partials(qkv_ptr, q_at, row_ok[:, None], stride_qkv_s, PARTS, EMULATE)
    x1 = load_summing_partials(qkv_ptr, q_at + 1, row_ok[:, None], stride_qkv_s, PARTS, EMULATE)
    if HAS_Q_NORM:  # `_rms_scale` per row
        f0 = x0.to(tl.float32)
        f1 = x1.to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(f0 * f0, 1) + tl.sum(f1 * f1, 1)) / HEAD_DIM + eps)
        x0 = cast_rne(f0 * inv[:, None] * q_w0[None, :], x0.dtype, EMULATE)
        x1 = cast_rne(f1 * inv[:, None] * q_w1[None, :], x1.dtype, EMULATE)
    f0 = x0.to(tl.float32)
    f1 = x1.to(tl.float32)
    q = tl.interleave(
        cast_rne(f0 * cos[None, :] - f1 * sin[None, :], x0.dtype, EMULATE),
        cast_rne(f1 * cos[None, :] + f0 * sin[None, :], x0.dtype, EMULATE),
    )

    # The new token's key (last split): normalized, rotated, stored, and its softmax term taken
    # as the initial state, so that nothing of it stays live through the key loop below (its
    # registers would cost the loop occupancy: 168 against 128 per thread when added after it).
    acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    if split == num_splits - 1:
        k_at = qkv_row + (NUM_Q_HEADS + kv_head) * HEAD_DIM + 2 * offs_h
        everywhere = offs_h < half
        k0 = load_summing_partials(qkv_ptr, k_at, everywhere, stride_qkv_s, PARTS, EMULATE)
        k1 = load_summing_partials(qkv_ptr, k_at + 1, everywhere, stride_qkv_s, PARTS, EMULATE)
        offs_d = tl.arange(0, HEAD_DIM)
        v_at = qkv_row + (NUM_Q_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM + offs_d
        v = load_summing_partials(qkv_ptr, v_at, offs_d < HEAD_DIM, stride_qkv_s, PARTS, EMULATE)
        v = v.to(v_ptr.dtype.element_ty)
        k0, k1 = _rms_scale(k0, k1, k_w0, k_w1, eps, HEAD_DIM, HAS_K_NORM, EMULATE)
        kf0 = k0.to(tl.float32)  # names of their own: the branch may not retype q's f0/f1
        kf1 = k1.to(tl.float32)
        k_type = k_ptr.dtype.element_ty
        k0 = cast_rne(kf0 * cos - kf1 * sin, k_type, EMULATE)
        k1 = cast_rne(kf1 * cos + kf0 * sin, k_type, EMULATE)
        place = (slot // PAGE) * stride_kp + (slot % PAGE) * stride_kt + kv_head * stride_kh
        stored = slot >= 0
        tl.store(k_ptr + place + 2 * offs_h, k0, mask=stored & everywhere)
        tl.store(k_ptr + place + 2 * offs_h + 1, k1, mask=stored & everywhere)
        tl.store(v_ptr + place + offs_d, v, mask=stored & (offs_d < HEAD_DIM))
        key = tl.interleave(k0, k1).to(tl.float32)
        # one key: its probability is exp2(0) = 1 (exact in any value dtype)
        m_i = tl.sum(q.to(tl.float32) * key[None, :], 1) * scale_log2e
        l_i = tl.full([BLOCK_R], 1.0, dtype=tl.float32)
        acc = tl.zeros([BLOCK_R, HEAD_DIM], dtype=tl.float32) + v.to(tl.float32)[None, :]

    # The cached keys [0, seq_len - 1), split as the paged decode kernel splits a row.
    span = tl.maximum(seq_len - 1, 0)
    chunk = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, span)
    acc, m_i, l_i = _attend_key_range(
        acc, m_i, l_i, q, rows, k_ptr, v_ptr, k_ptr, v_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt,
        kv_head, lo, hi, stride_kp, stride_kt, stride_kh, scale_log2e, False, BLOCK_N, PAGE, HEAD_DIM,
        UPCAST, False,
    )  # fmt: skip

    finish_split(
        acc, m_i, l_i, seq + tl.zeros_like(rows), head, row_ok, seq, kv_head, split, out_ptr,
        part_out_ptr, part_lse_ptr, counter_ptr, q8_ptr, scale_ptr, NUM_Q_HEADS, num_slots, num_splits,
        stride_ot, stride_oh, stride_q8, stride_st, stride_sh, GROUP, BLOCK_G, HEAD_DIM, WRITE_PARTIAL,
        FUSED_MERGE, BLOCK_S, QUANT_OUT,
    )  # fmt: skip


def decode_rope_attention(
    qkv: Tensor | SplitKPartials,
    positions: Tensor,
    slot_mapping: Tensor,
    rope_table: Tensor,
    k_pages: Tensor,
    v_pages: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    n_q_heads: int,
    n_kv_heads: int,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    eps: float = 1e-6,
    out_fp8: tuple[Tensor, Tensor] | None = None,
    config: AttentionConfig | None = None,
    num_splits: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`qk_norm_rope_kv_write` then `paged_decode_attention`, in one launch (two with an unfused
    merge): one token per row.

    qkv [bs, (Hq+2Hkv)*D] or the qkv GEMM's `SplitKPartials`; positions and slot_mapping [bs]
    (the new token's position and its slot in the pages, as `qk_norm_rope_kv_write` takes them;
    the slot must be that of key seq_len - 1 in the row's block table); rope_table as
    `models.layers.rope_table`; pages, block_tables and seq_lens (the new token included) as
    `paged_decode_attention` takes them, which also decides the config and split count. Returns
    the attention output [bs, Hq, D] in qkv's dtype (bf16 for partials), or the `out_fp8` pair
    filled for the FP8 o-projection.

    Under PDL (`kernels/pdl.py`) seq_lens, positions, slot_mapping and the rope table are read
    before the wait for the previous kernel: no kernel of the same graph or chain may write them."""
    qkv, parts, split_stride, dtype = _consumer_input(qkv)
    bs, width = qkv.shape
    head_dim = width // (n_q_heads + 2 * n_kv_heads)
    if head_dim * (n_q_heads + 2 * n_kv_heads) != width or n_q_heads % n_kv_heads:
        raise ValueError(f"qkv width {width} does not split into {n_q_heads} q + 2 x {n_kv_heads} kv heads")
    if head_dim < 16 or head_dim & (head_dim - 1) or qkv.stride(1) != 1:
        raise ValueError(f"need a power-of-two head_dim >= 16 and contiguous qkv rows, got {head_dim}")
    if not k_pages.dtype.is_floating_point or k_pages.element_size() == 1:
        raise ValueError(
            f"pages must be bf16/fp16/fp32 (an e4m3 cache keeps the two kernels), got {k_pages.dtype}"
        )
    if k_pages.shape != v_pages.shape or k_pages.stride() != v_pages.stride() or k_pages.stride(-1) != 1:
        raise ValueError("k_pages and v_pages must share one shape and layout with head_dim innermost")
    if tuple(k_pages.shape[2:]) != (n_kv_heads, head_dim):
        raise ValueError(f"pages hold {list(k_pages.shape[2:])} per slot, need [{n_kv_heads}, {head_dim}]")
    if rope_table.stride(-1) != 1 or rope_table.stride(-2) != 2:
        raise ValueError("the rope table's [D/2, 2] rows must be contiguous")
    if positions.shape != (bs,) or slot_mapping.shape != (bs,) or seq_lens.shape != (bs,):
        raise ValueError(f"positions, slot_mapping and seq_lens must be [{bs}]")
    shape = (bs, n_q_heads, head_dim)
    out = torch.empty(shape, dtype=dtype, device=qkv.device)
    if out_fp8 is not None:
        _check_out_fp8(out_fp8, out)
    result = out if out_fp8 is None else out_fp8
    if bs == 0:
        return result
    config = decode_config(bs) if config is None else config
    if num_splits is None:
        num_splits = choose_num_splits(bs, n_kv_heads, block_tables.shape[1] * k_pages.shape[1], config)
    if num_splits > 1 and config.split_block_n:
        config = replace(config, block_n=config.split_block_n)
    fused_merge = num_splits > 1 and config.fused_merge
    part_out = part_lse = out  # unused without splits
    if num_splits > 1:
        part_out = torch.empty(bs, n_q_heads, num_splits, head_dim, dtype=torch.float32, device=qkv.device)
        part_lse = torch.empty(bs, n_q_heads, num_splits, dtype=torch.float32, device=qkv.device)
    q8, scales = out_fp8 if out_fp8 is not None else (out, out)
    group = n_q_heads // n_kv_heads
    block_g = triton.next_power_of_2(group)
    counters = _counters(qkv.device, bs * n_kv_heads) if fused_merge else seq_lens
    dummy = rope_table
    _decode_rope_attention_kernel[(bs, 1, n_kv_heads * num_splits)](
        qkv, positions, slot_mapping, rope_table,
        q_norm_weight if q_norm_weight is not None else dummy,
        k_norm_weight if k_norm_weight is not None else dummy,
        k_pages, v_pages, out, part_out, part_lse, counters, block_tables, seq_lens, q8, scales,
        eps, 1.0 / math.sqrt(head_dim) * _LOG2E, num_splits, num_splits,
        qkv.stride(0), split_stride, rope_table.stride(0), out.stride(0), out.stride(1),
        block_tables.stride(0), k_pages.stride(0), k_pages.stride(1), k_pages.stride(2),
        q8.stride(0), scales.stride(0), scales.stride(1),
        NUM_Q_HEADS=n_q_heads, NUM_KV_HEADS=n_kv_heads, GROUP=group, BLOCK_G=block_g,
        BLOCK_R=max(16, block_g), BLOCK_N=config.block_n, PAGE=k_pages.shape[1], HEAD_DIM=head_dim,
        HAS_Q_NORM=q_norm_weight is not None, HAS_K_NORM=k_norm_weight is not None, PARTS=parts,
        WRITE_PARTIAL=num_splits > 1, FUSED_MERGE=fused_merge,
        BLOCK_S=triton.next_power_of_2(max(num_splits, config.max_splits)) if fused_merge else 1,
        EMULATE=interpreting(), UPCAST=interpreting(), QUANT_OUT=out_fp8 is not None,
        num_warps=config.num_warps, num_stages=config.num_stages, maxnreg=MAX_REGISTERS,
        **pdl_launch("attention"),
    )  # fmt: skip
    if num_splits > 1 and not fused_merge:
        _merge(part_out, part_lse, out, config, out_fp8)
    return result
