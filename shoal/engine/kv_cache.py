"""Paged KV cache: the page pool, per-request block tables and the voice-prefix cache.

Pages are reference counted. A request holds one reference on every page of its block table;
the prefix cache holds one on the whole pages of each cached voice prefix. Requests that start
with a cached voice borrow those pages (their block table starts with them) and never write to
them: only whole pages are shared, the partial last page of a prefix is recomputed per request.
An entry is evictable (least recently used first) once no running request borrows it.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from shoal.config import EngineConfig
from shoal.engine.request import Request
from shoal.kernels.reference import dequantize_kv, quantize_kv


class OutOfPages(RuntimeError):
    """The pool cannot supply the pages asked for (after evicting idle prefixes)."""


class PagePool:
    """Free list plus reference counts over `num_pages` page ids."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._refs = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def ref_count(self, page: int) -> int:
        return self._refs[page]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"retain of free page {p}")
            self._refs[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise RuntimeError(f"double free of page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)


@dataclass
class PrefixEntry:
    key: str
    pages: list[int]
    num_tokens: int  # len(pages) * page_size
    last_used: int
    users: int = 0  # running requests borrowing the pages


class KVCacheManager:
    """Block tables for requests, backed by a PagePool, with the voice-prefix cache on top."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self._prefixes: dict[str, PrefixEntry] = {}
        self._clock = itertools.count()

    # Prefix cache ------------------------------------------------------------------------

    @property
    def prefix_cache_pages(self) -> int:
        return sum(len(e.pages) for e in self._prefixes.values())

    def has_prefix(self, key: str) -> bool:
        return key in self._prefixes

    def attach_prefix(self, request: Request) -> None:
        """Start a fresh request's block table with its voice's cached pages (found by the
        request's `prefix_key`), if any."""
        if request.block_table or request.num_computed:
            raise RuntimeError("attach_prefix on a request that already has pages")
        entry = self._prefixes.get(request.prefix_key) if request.prefix_key else None
        if entry is None or entry.num_tokens >= request.seq_len:
            return  # the last column must be computed to have logits to sample from
        self.pool.retain(entry.pages)
        entry.users += 1
        entry.last_used = next(self._clock)
        request.block_table = list(entry.pages)
        request.num_shared_pages = len(entry.pages)
        request.num_computed = entry.num_tokens

    def register_prefix(self, request: Request) -> bool:
        """Once a request has computed its voice prefix's whole pages, cache them (if new)."""
        key = request.prefix_key
        if key is None or request.num_shared_pages or key in self._prefixes:
            return False
        n_pages = request.prefix_len // self.page_size
        if n_pages == 0 or request.num_computed < n_pages * self.page_size:
            return False
        pages = request.block_table[:n_pages]
        self.pool.retain(pages)
        self._prefixes[key] = PrefixEntry(key, pages, n_pages * self.page_size, next(self._clock), users=1)
        request.num_shared_pages = n_pages
        return True

    def evict_prefixes(self, pages_needed: int) -> int:
        """Drop idle prefixes, least recently used first, until `pages_needed` pages are free."""
        freed = 0
        idle = sorted((e for e in self._prefixes.values() if e.users == 0), key=lambda e: e.last_used)
        for entry in idle:
            if self.pool.num_free >= pages_needed:
                break
            del self._prefixes[entry.key]
            before = self.pool.num_free
            self.pool.release(entry.pages)
            freed += self.pool.num_free - before
        return freed

    # Block tables ------------------------------------------------------------------------

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def extra_pages_needed(self, request: Request, upto_tokens: int) -> int:
        return max(0, self.pages_for(upto_tokens) - len(request.block_table))

    def can_allocate(self, n: int) -> bool:
        """Whether n pages are free or can be freed by evicting idle prefixes."""
        if n <= self.pool.num_free:
            return True
        idle = sum(len(e.pages) for e in self._prefixes.values() if e.users == 0)
        return n <= self.pool.num_free + idle

    def grow(self, request: Request, upto_tokens: int) -> None:
        """Give the request pages for its first `upto_tokens` positions (raises OutOfPages)."""
        n = self.extra_pages_needed(request, upto_tokens)
        if n == 0:
            return
        if n > self.pool.num_free:
            self.evict_prefixes(n)
        request.block_table.extend(self.pool.allocate(n))

    def free(self, request: Request) -> None:
        """Return all of a request's pages (finish, abort or preemption)."""
        if request.num_shared_pages and request.prefix_key in self._prefixes:
            entry = self._prefixes[request.prefix_key]
            entry.users -= 1
            entry.last_used = next(self._clock)
        self.pool.release(request.block_table)
        request.block_table = []
        request.num_shared_pages = 0
        request.num_computed = 0

    def prefill_prefix_entry(self, key: str, pages: list[int], num_tokens: int) -> None:
        """Adopt pages already filled with a voice prefix (Engine.prefill_voice); the caller's
        reference on the pages becomes the cache's."""
        if key in self._prefixes:
            self.pool.release(pages)
            return
        self._prefixes[key] = PrefixEntry(key, pages, num_tokens, next(self._clock))


FP8_KV_DTYPE = torch.float8_e4m3fn


def kv_storage_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """What the pages hold under `EngineConfig.kv_cache_dtype`: the model dtype ("auto") or e4m3."""
    return FP8_KV_DTYPE if config.kv_cache_dtype == "fp8" else model_dtype


def kv_bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Keys and values of one page over all layers; an e4m3 cache adds one fp32 scale per
    (token, kv head) to each."""
    vector = head_dim * torch.empty((), dtype=dtype).element_size()
    if dtype == FP8_KV_DTYPE:
        vector += 4
    return 2 * num_layers * page_size * num_kv_heads * vector


@dataclass(frozen=True)
class LayerKV:
    """One layer's page pools, as the kernels take them: `k`/`v` `[pages, page_size, Hkv, D]`,
    and for an e4m3 cache the fp32 scales `[pages, page_size, Hkv]` (else None)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None

    @property
    def fp8(self) -> bool:
        """Whether this is an e4m3 cache (its attention takes other tuned configs)."""
        return self.k_scales is not None

    @property
    def scales(self) -> dict[str, torch.Tensor | None]:
        """The keyword arguments the attention and KV-write kernels take the scales as."""
        return {"k_scales": self.k_scales, "v_scales": self.v_scales}


class PagedKV:
    """The KV tensors, k/v `[num_pages + 1, page_size, Hkv, D]` per layer, and the model's
    AttentionBackend over them. The extra last page is scratch: padded batch rows of a CUDA
    graph write there, so they never touch a page a request owns.

    `kv_dtype=torch.float8_e4m3fn` (`EngineConfig.kv_cache_dtype="fp8"`) stores e4m3 keys and
    values with one fp32 scale per (token, kv head), `k_scales`/`v_scales` `[num_pages + 1,
    page_size, Hkv]` per layer (`kernels.reference.quantize_kv`): almost twice the tokens per
    GiB. Attention then runs on the dequantized values (the kernels fold the scales into the
    scores and probabilities), which is not faster than the bf16 cache: a capacity option.

    Two modes, set before each forward:
    - varlen (`set_varlen`): any mix of sequences with any number of new tokens (prefill
      chunks); loops over sequences on the host, eager only.
    - decode (`set_decode`): one new token per row, all metadata in tensors, no host sync:
      the mode captured in CUDA graphs.
    """

    def __init__(
        self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
        dtype: torch.dtype, device: torch.device | str, kv_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        shape = (num_layers, num_pages + 1, page_size, num_kv_heads, head_dim)
        stored = dtype if kv_dtype is None else kv_dtype
        if stored not in (dtype, FP8_KV_DTYPE):
            raise ValueError(f"the KV cache holds the model dtype or e4m3, got {stored}")
        self.k = torch.zeros(shape, dtype=stored, device=device)
        self.v = torch.zeros(shape, dtype=stored, device=device)
        fp8 = stored == FP8_KV_DTYPE
        self.k_scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if fp8 else None
        self.v_scales = torch.zeros(shape[:-1], dtype=torch.float32, device=device) if fp8 else None
        self.page_size = page_size
        self.scratch_page = num_pages
        self._mode = "none"
        self._slots: torch.Tensor | None = None
        self._segments: list[tuple[int, int, int, list[int]]] = []  # offset, count, kv_len, pages
        self._block_tables: torch.Tensor | None = None
        self._kv_lens: torch.Tensor | None = None
        self._prefill_meta: tuple | None = None
        self.force_kernel_prefill = False  # build the kernels' metadata off CUDA too (interpreter tests)

    @property
    def fp8(self) -> bool:
        return self.k_scales is not None

    def layer(self, i: int) -> LayerKV:
        if self.fp8:
            return LayerKV(self.k[i], self.v[i], self.k_scales[i], self.v_scales[i])
        return LayerKV(self.k[i], self.v[i])

    def slot_of(self, pages: list[int], position: int) -> int:
        return pages[position // self.page_size] * self.page_size + position % self.page_size

    def set_varlen(self, segments: list[tuple[int, int, int, list[int]]]) -> None:
        """segments: (offset in the flat batch, new tokens, KV length after them, block table).

        The slots are computed with numpy, one vector op per segment: a Python loop over every
        token (`slot_of`) takes milliseconds per large chunk, while the GPU sits idle."""
        size = self.page_size
        parts = []
        for _, count, kv_len, pages in segments:
            positions = np.arange(kv_len - count, kv_len, dtype=np.int64)
            parts.append(np.asarray(pages, dtype=np.int64)[positions // size] * size + positions % size)
        slots = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        self._slots = _upload(torch.from_numpy(slots), self.k.device)
        self._segments = segments
        self._mode = "varlen"
        self._prefill_meta = None
        if (_triton_prefill is not None and self.k.is_cuda) or self.force_kernel_prefill:
            width = max(len(pages) for _, _, _, pages in segments)
            tables = torch.full((len(segments), width), self.scratch_page, dtype=torch.int32)
            for i, (_, _, _, pages) in enumerate(segments):
                tables[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
            starts = [offset for offset, _, _, _ in segments] + [sum(c for _, c, _, _ in segments)]
            self._prefill_meta = (
                _upload(tables, self.k.device),
                _upload(torch.tensor([kv for _, _, kv, _ in segments], dtype=torch.int32), self.k.device),
                _upload(torch.tensor(starts, dtype=torch.int32), self.k.device),
                max(c for _, c, _, _ in segments),
            )

    def set_decode(self, slots: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor) -> None:
        """slots Long[B] (where each row's new key goes), block_tables int32 [B, P], kv_lens
        int32 [B] (keys per row after this token). Tensors are used as given (graph buffers)."""
        self._slots, self._block_tables, self._kv_lens = slots, block_tables, kv_lens
        self._mode = "decode"

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        flat = self.k.shape[1] * self.page_size
        if self.fp8:
            (k, k_scale), (v, v_scale) = quantize_kv(k), quantize_kv(v)
            self.k_scales[layer].view(flat, -1).index_copy_(0, self._slots, k_scale)
            self.v_scales[layer].view(flat, -1).index_copy_(0, self._slots, v_scale)
            # index_copy_ has no e4m3 kernel (CPU): the bytes are copied as bytes.
            for pool, values in ((self.k, k), (self.v, v)):
                pool[layer].view(torch.uint8).view(flat, *k.shape[1:]).index_copy_(
                    0, self._slots, values.view(torch.uint8)
                )
            return
        self.k[layer].view(flat, *k.shape[1:]).index_copy_(0, self._slots, k)
        self.v[layer].view(flat, *v.shape[1:]).index_copy_(0, self._slots, v)

    def _gathered(
        self, layer: int, index: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of the pages `index` (any shape), in `dtype` (dequantized)."""
        if not self.fp8:
            return self.k[layer][index], self.v[layer][index]
        keys = dequantize_kv(self.k[layer][index], self.k_scales[layer][index], dtype)
        return keys, dequantize_kv(self.v[layer][index], self.v_scales[layer][index], dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self._store(layer, k, v)
        if self._mode == "decode":
            return self._attend_decode(layer, q)
        if self._mode != "varlen":
            raise RuntimeError("PagedKV.attend before set_varlen/set_decode")
        if self._prefill_meta is not None and _triton_prefill is not None:
            tables, seq_lens, starts, max_query = self._prefill_meta
            pools = self.layer(layer)
            return _triton_prefill(q, pools.k, pools.v, tables, seq_lens, starts, max_query, **pools.scales)
        out = torch.empty_like(q)
        for offset, count, kv_len, pages in self._segments:
            n_pages = -(-kv_len // self.page_size)
            index = torch.tensor(pages[:n_pages], device=q.device)
            keys, values = self._gathered(layer, index, q.dtype)
            keys, values = keys.flatten(0, 1)[:kv_len], values.flatten(0, 1)[:kv_len]
            query_pos = torch.arange(kv_len - count, kv_len, device=q.device)
            mask = torch.arange(kv_len, device=q.device)[None, :] <= query_pos[:, None]
            attended = F.scaled_dot_product_attention(
                q[offset : offset + count].transpose(0, 1)[None], keys.transpose(0, 1)[None],
                values.transpose(0, 1)[None], attn_mask=mask[None, None], enable_gqa=True,
            )  # fmt: skip
            out[offset : offset + count] = attended[0].transpose(0, 1)
        return out

    def _attend_decode(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        if _triton_decode is not None and q.is_cuda:
            pools = self.layer(layer)
            return _triton_decode(q, pools.k, pools.v, self._block_tables, self._kv_lens, **pools.scales)
        batch, pages = self._block_tables.shape
        index = self._block_tables.long()
        keys, values = self._gathered(layer, index, q.dtype)
        keys = keys.view(batch, pages * self.page_size, *self.k.shape[-2:])
        values = values.view(batch, pages * self.page_size, *self.v.shape[-2:])
        visible = torch.arange(pages * self.page_size, device=q.device)[None, :] < self._kv_lens[:, None]
        attended = F.scaled_dot_product_attention(
            q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=visible[:, None, None, :], enable_gqa=True,
        )  # fmt: skip
        return attended[:, :, 0, :]


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without a stream sync (through pinned memory on a GPU)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _load_triton_kernel(name: str):
    """A Triton paged attention op from kernels/attention.py (None without Triton or a GPU)."""
    if not torch.cuda.is_available():
        return None
    try:
        from shoal.kernels import attention as kernels_attention
    except Exception:
        return None
    return getattr(kernels_attention, name, None)


_triton_decode = _load_triton_kernel("paged_decode_attention")
_triton_prefill = _load_triton_kernel("paged_prefill_attention")
