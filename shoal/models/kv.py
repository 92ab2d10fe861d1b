"""Plain contiguous KV caches: the simple AttentionBackend the reference path and tests use.

`ContiguousKVCache` holds several sequences (slots) for the slow transformer; a forward runs
any mix of them, each with any number of new tokens, flattened into one varlen batch.
`FastKVCache` is the fast transformer's dense per-frame cache `[B, Hkv, N, D]` per layer.
The engine's paged cache (`engine/kv_cache.py`) implements the same `attend` contract.

Both attend through `grouped_attention`: one fused SDPA call per layer with native GQA (no
repeat_interleave copies), no mask at all for a single new token, and masks built once per
forward otherwise. On a CPU shared with other processes every OpenMP parallel region can wait a
scheduler time slice for its second thread, so the reference path keeps one per attention call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def grouped_attention(q: Tensor, keys: Tensor, values: Tensor, visible: Tensor | None = None) -> Tensor:
    """Masked GQA attention: q [B, Hq, S, D], keys/values [B, Hkv, L, D], visible bool [S, L]
    (True where query s may attend to key l; every row needs at least one True; None: all
    visible) -> [B, Hq, S, D].

    Scale 1/sqrt(D); kv head j serves q heads j*g .. j*g+g-1 (g = Hq / Hkv), without copying
    keys. Equal, up to float rounding, to the reference's `softmax(q k^T / sqrt(D) + mask) v`
    over repeat_interleave'd keys and values."""
    groups = q.shape[1] // keys.shape[1]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=groups > 1)


def causal_mask(start: int, count: int, device: torch.device | str = "cpu") -> Tensor | None:
    """bool [count, start+count]: the query at position start+i sees keys 0 .. start+i. None
    for a single query, which sees every key up to its own position: no mask needed."""
    if count == 1:
        return None
    keys = torch.arange(start + count, device=device)
    queries = torch.arange(start, start + count, device=device)
    return keys[None, :] <= queries[:, None]


@dataclass(frozen=True)
class _Segment:
    """One sequence's share of a varlen step: tokens [offset, offset+count) of the flat batch
    go to slot `slot` at positions [start, start+count)."""

    slot: int
    start: int
    count: int
    offset: int


class ContiguousKVCache:
    """Per layer `[slots, max_seq_len, Hkv, D]` key and value buffers.

    Usage per forward: `positions = cache.plan(slots, new_token_counts)`, then the model's
    `forward_slow(tokens, positions, cache)` (tokens ordered slot by slot as planned)."""

    def __init__(
        self, n_layers: int, n_kv_heads: int, head_dim: int, max_seq_len: int, num_slots: int = 1,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        shape = (num_slots, max_seq_len, n_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_seq_len = max_seq_len
        self.lengths = [0] * num_slots
        self._segments: list[_Segment] = []
        self._masks: list[Tensor | None] = []

    def plan(self, slots: Sequence[int], new_token_counts: Sequence[int]) -> Tensor:
        """Declare the next forward: `new_token_counts[i]` tokens appended to slot `slots[i]`,
        in that order in the flat batch. Returns each token's position, Long[T]."""
        if len(slots) != len(new_token_counts) or len(set(slots)) != len(slots):
            raise ValueError("plan() needs one count per slot and each slot at most once")
        segments, positions, offset = [], [], 0
        for slot, count in zip(slots, new_token_counts, strict=True):
            start = self.lengths[slot]
            if start + count > self.max_seq_len:
                raise ValueError(f"slot {slot}: {start + count} tokens exceed max_seq_len {self.max_seq_len}")
            segments.append(_Segment(slot, start, count, offset))
            positions.append(torch.arange(start, start + count))
            self.lengths[slot] = start + count
            offset += count
        self._segments = segments
        device = self.keys[0].device if self.keys else "cpu"
        # Causal masks, built once per forward and shared by every layer: query at position
        # start+i sees keys 0 .. start+i.
        self._masks = [causal_mask(seg.start, seg.count, device) for seg in segments]
        return torch.cat(positions).to(device) if positions else torch.zeros(0, dtype=torch.long)

    def reset(self, slot: int) -> None:
        """Forget a sequence; its slot can take a new one."""
        self.lengths[slot] = 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if len(self._segments) == 1 and self._segments[0].count == q.shape[0]:
            return self._attend_segment(layer, self._segments[0], self._masks[0], q, k, v)
        out = torch.empty_like(q)
        for seg, mask in zip(self._segments, self._masks, strict=True):
            new = slice(seg.offset, seg.offset + seg.count)
            out[new] = self._attend_segment(layer, seg, mask, q[new], k[new], v[new])
        return out

    def _attend_segment(
        self, layer: int, seg: _Segment, mask: Tensor | None, q: Tensor, k: Tensor, v: Tensor
    ) -> Tensor:
        end = seg.start + seg.count
        self.keys[layer][seg.slot, seg.start : end] = k
        self.values[layer][seg.slot, seg.start : end] = v
        keys = self.keys[layer][seg.slot, :end].transpose(0, 1)[None]
        values = self.values[layer][seg.slot, :end].transpose(0, 1)[None]
        return grouped_attention(q.transpose(0, 1)[None], keys, values, mask)[0].transpose(0, 1)


class FastKVCache:
    """The fast transformer's cache: per layer `[B, Hkv, N, D]`, N = num_codebooks.

    The fast model sets the step window (`start_pos`, length) before running its layers. Each
    frame overwrites positions from 0 up, and attention masks out later positions, so the cache
    never needs clearing between frames."""

    def __init__(
        self, n_layers: int, batch: int, n_kv_heads: int, num_positions: int, head_dim: int,
        dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
    ) -> None:  # fmt: skip
        shape = (batch, n_kv_heads, num_positions, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.batch = batch
        self.num_positions = num_positions
        self.start_pos = 0
        self.step_len = 0

    def set_window(self, start_pos: int, step_len: int) -> None:
        if start_pos < 0 or start_pos + step_len > self.num_positions:
            raise ValueError(
                f"fast positions {start_pos}..{start_pos + step_len} out of 0..{self.num_positions}"
            )
        self.start_pos = start_pos
        self.step_len = step_len

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention over the cached positions 0 .. start_pos+step_len-1. The reference's
        fast layers attend over all N positions with the later ones masked out: the same sum."""
        batch, steps, start = self.batch, self.step_len, self.start_pos
        end = start + steps
        q = q.view(batch, steps, *q.shape[1:]).transpose(1, 2)
        self.keys[layer][:, :, start:end] = k.view(batch, steps, *k.shape[1:]).transpose(1, 2)
        self.values[layer][:, :, start:end] = v.view(batch, steps, *v.shape[1:]).transpose(1, 2)
        keys = self.keys[layer][:, :, :end]
        values = self.values[layer][:, :, :end]
        out = grouped_attention(q, keys, values, causal_mask(start, steps, q.device))
        return out.transpose(1, 2).reshape(batch * steps, out.shape[1], out.shape[-1])
