"""Plain contiguous KV caches: the simple AttentionBackend the reference path and tests use.

`ContiguousKVCache` holds several sequences (slots) for the slow transformer; a forward runs
any mix of them, each with any number of new tokens, flattened into one varlen batch.
`FastKVCache` is the fast transformer's dense per-frame cache `[B, Hkv, N, D]` per layer.
The engine's paged cache (`engine/kv_cache.py`) implements the same `attend` contract.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from shoal.models.layers import repeat_kv_heads


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
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_seq_len: int,
        num_slots: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_slots, max_seq_len, n_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layers)]
        self.max_seq_len = max_seq_len
        self.lengths = [0] * num_slots
        self._segments: list[_Segment] = []

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
        return torch.cat(positions).to(device) if positions else torch.zeros(0, dtype=torch.long)

    def reset(self, slot: int) -> None:
        """Forget a sequence; its slot can take a new one."""
        self.lengths[slot] = 0

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        groups = q.shape[1] // k.shape[1]
        for seg in self._segments:
            new = slice(seg.offset, seg.offset + seg.count)
            end = seg.start + seg.count
            self.keys[layer][seg.slot, seg.start : end] = k[new]
            self.values[layer][seg.slot, seg.start : end] = v[new]
            keys = repeat_kv_heads(self.keys[layer][seg.slot, :end].transpose(0, 1), groups, 0)
            values = repeat_kv_heads(self.values[layer][seg.slot, :end].transpose(0, 1), groups, 0)
            query_positions = torch.arange(seg.start, end, device=q.device)
            mask = torch.arange(end, device=q.device)[None, :] <= query_positions[:, None]
            attended = F.scaled_dot_product_attention(
                q[new].transpose(0, 1)[None], keys[None], values[None], attn_mask=mask[None, None]
            )
            out[new] = attended[0].transpose(0, 1)
        return out


class FastKVCache:
    """The fast transformer's cache: per layer `[B, Hkv, N, D]`, N = num_codebooks.

    The fast model sets the step window (`start_pos`, length) before running its layers. Each
    frame overwrites positions from 0 up, and attention masks out later positions, so the cache
    never needs clearing between frames."""

    def __init__(
        self,
        n_layers: int,
        batch: int,
        n_kv_heads: int,
        num_positions: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
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
        """Eager masked attention over all N cached positions, as the reference's fast layers do."""
        batch, steps, start = self.batch, self.step_len, self.start_pos
        q = q.view(batch, steps, *q.shape[1:]).transpose(1, 2)
        self.keys[layer][:, :, start : start + steps] = k.view(batch, steps, *k.shape[1:]).transpose(1, 2)
        self.values[layer][:, :, start : start + steps] = v.view(batch, steps, *v.shape[1:]).transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        keys = repeat_kv_heads(self.keys[layer], groups, 1)
        values = repeat_kv_heads(self.values[layer], groups, 1)
        query_positions = torch.arange(start, start + steps, device=q.device)
        visible = torch.arange(self.num_positions, device=q.device)[None, :] <= query_positions[:, None]
        bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(visible.logical_not(), float("-inf"))
        scores = q @ keys.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]))
        weights = torch.softmax(scores + bias, dim=-1)
        out = weights @ values
        return out.transpose(1, 2).reshape(batch * steps, out.shape[1], out.shape[-1])
