"""Plain-torch references for the attention-side kernels: the oracles the tests hold them to.

Each function here is the definition the matching Triton kernel is tested against:

- `paged_attention_reference`: causal varlen attention over the paged KV cache
  (`kernels/attention.py`), GQA kv head j serving q heads j*g .. j*g+g-1.
- `rms_norm_reference` / `qk_norm_rope_reference`: the reference model's RMSNorm and the fused
  QK-norm + interleaved RoPE + KV-cache write (`kernels/norm_rope.py`).
- `window_shift_reference`: the previous-frames window push (`kernels/window.py`).

The sampling kernel's reference is `models.sampling.sample_reference`, beside the rules it applies.

Paged KV layout (see `kernels/attention.py`): per layer k and v pools
`[num_pages, page_size, n_kv_heads, head_dim]`; token position p of sequence b lives in page
`block_tables[b, p // page_size]` at offset `p % page_size`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def gather_sequence_kv(
    k_pages: Tensor, v_pages: Tensor, block_table_row: Tensor, length: int
) -> tuple[Tensor, Tensor]:
    """The first `length` keys and values of one sequence, contiguous `[length, Hkv, D]`."""
    page_size = k_pages.shape[1]
    positions = torch.arange(length, device=k_pages.device)
    pages = block_table_row.long()[positions // page_size]
    offsets = positions % page_size
    return k_pages[pages, offsets], v_pages[pages, offsets]


def paged_attention_reference(
    q: Tensor, k_pages: Tensor, v_pages: Tensor, block_tables: Tensor, seq_lens: Tensor,
    query_start_loc: Tensor | None = None, scale: float | None = None,
) -> Tensor:  # fmt: skip
    """Causal attention of each query token over its sequence's paged keys, in fp32.

    q [T, Hq, D]; seq_lens [bs] total keys per sequence, new tokens included (their k/v already
    written); query_start_loc [bs+1] offsets of each sequence's queries in q (default: one query
    per sequence, i.e. decode). A sequence's q_len queries are its last q_len positions."""
    bs = seq_lens.shape[0]
    if query_start_loc is None:
        query_start_loc = torch.arange(bs + 1, device=q.device)
    hq, d = q.shape[1], q.shape[2]
    hkv = k_pages.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b in range(bs):
        start, end = int(query_start_loc[b]), int(query_start_loc[b + 1])
        q_len, length = end - start, int(seq_lens[b])
        if q_len == 0:
            continue
        keys, values = gather_sequence_kv(k_pages, v_pages, block_tables[b], length)
        keys = keys.float().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        values = values.float().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("thd,lhd->htl", q[start:end].float(), keys) * scale
        query_pos = torch.arange(length - q_len, length, device=q.device)
        causal = torch.arange(length, device=q.device)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        out[start:end] = torch.einsum("htl,lhd->thd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype)


def rms_norm_reference(
    x: Tensor, weight: Tensor, eps: float, residual: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """The model's RMSNorm (fp32 normalize, cast back, times weight), after an optional
    residual add in x's dtype. Returns (normed, x + residual or None)."""
    summed = None
    if residual is not None:
        summed = x + residual
        x = summed
    x32 = x.float()
    normed = x32 * torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + eps)
    return normed.type_as(x) * weight, summed


def apply_rope_reference(x: Tensor, table: Tensor) -> Tensor:
    """Interleaved-pair RoPE in fp32 against the bf16 (cos, sin) table rows [T, D/2, 2]."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = table[:, None, :, 0].float(), table[:, None, :, 1].float()
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(-2).type_as(x)


def qk_norm_rope_reference(
    qkv: Tensor, positions: Tensor, rope_table: Tensor, k_pages: Tensor, v_pages: Tensor,
    slot_mapping: Tensor, n_q_heads: int, n_kv_heads: int, q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None, eps: float = 1e-6,
) -> Tensor:  # fmt: skip
    """Split qkv [T, (Hq+2Hkv)*D], QK-norm (torch's per-head RMSNorm) if weights are given, RoPE
    q and k, write k/v into the pools at `slot_mapping` (page*page_size+offset; < 0 skips the
    token). Returns q [T, Hq, D]; the pools are updated in place."""
    tokens = qkv.shape[0]
    d = qkv.shape[1] // (n_q_heads + 2 * n_kv_heads)
    q, k, v = qkv.split([n_q_heads * d, n_kv_heads * d, n_kv_heads * d], dim=-1)
    q = q.reshape(tokens, n_q_heads, d)
    k = k.reshape(tokens, n_kv_heads, d)
    v = v.reshape(tokens, n_kv_heads, d)
    if q_norm_weight is not None:
        q = F.rms_norm(q, (d,), q_norm_weight, eps)
    if k_norm_weight is not None:
        k = F.rms_norm(k, (d,), k_norm_weight, eps)
    table = rope_table[positions.long()]
    q = apply_rope_reference(q, table)
    k = apply_rope_reference(k, table)
    page_size = k_pages.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_pages[slots // page_size, slots % page_size] = k[keep].to(k_pages.dtype)
    v_pages[slots // page_size, slots % page_size] = v[keep].to(v_pages.dtype)
    return q


def window_shift_reference(window: Tensor, frames: Tensor) -> None:
    """In place: drop the oldest frame, append `frames` [bs, N+1] as the newest."""
    window[:, :-1] = window[:, 1:].clone()
    window[:, -1] = frames
