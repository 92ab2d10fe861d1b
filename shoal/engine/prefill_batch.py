"""One request's prefill chunk on static buffers, so that it can be replayed as a CUDA graph.

Why: an eager prefill launches about fifteen kernels and a few dozen small torch ops per layer
from Python. For a 300-token S2-Pro prompt the host needs 20-40 ms to launch its 36 layers while
the GPU needs about 16 ms for the prefill and the first frame together (docs/performance.md run
36), so the time to first frame is bound by the host and moves with its speed. Replayed, the
whole chunk is one launch.

`PrefillBatch` holds the inputs of `DecodeStep.prefill` for one chunk of at most the largest
bucket's tokens (tokens, positions, KV slots, the request's block table, its key count and the
varlen query bounds) plus the two outputs (last layer's output, final-normed), and a pinned host
staging copy. `fill` writes a chunk and pads it to its bucket with two host-to-device copies;
`compute(bucket)` runs the fused prefill on the static views (what `graphs.PrefillGraphs`
captures; without graphs it runs eagerly on the same buffers, which is how the CPU tests reach
the fill).

Rows [:count] of a bucket are the chunk; rows count.. are padding: token 0 (a text token, so no
codebook embedding is added), position 0, keys and values written into the KV cache's scratch
page (never in a live request's block table), and past the chunk's query length, so the varlen
attention computes no output row for them. Every other op of the prefill is row-wise (embedding,
norms, GEMMs, per-token activation quantization), so a padding row cannot reach a live row.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import Tensor


class PrefillBatch:
    """Static buffers for one prefill chunk (module docstring); `step` is a kernel `DecodeStep`."""

    def __init__(self, step, buckets: tuple[int, ...], num_rows: int, max_pages: int) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"prefill graph buckets must be positive token counts, got {buckets}")
        self.step = step
        self.kv = step.kv
        self.buckets = tuple(sorted(set(buckets)))
        self.max_tokens = self.buckets[-1]
        device = self.kv.k.device
        pin = device.type == "cuda"
        rows, self.num_rows, self.max_pages = self.max_tokens, num_rows, max_pages
        # Two flat buffers, one copy each: int64 tokens | positions | slots, and int32 block
        # table | key count | query start and end.
        self._long = torch.zeros(rows * (num_rows + 2), dtype=torch.long, device=device)
        self._int = torch.zeros(max_pages + 3, dtype=torch.int32, device=device)
        self._host_long = torch.zeros(self._long.numel(), dtype=torch.long, pin_memory=pin)
        self._host_int = torch.zeros(self._int.numel(), dtype=torch.int32, pin_memory=pin)
        self.tokens, self.positions, self.slots = self._long_views(self._long)
        self.tables, self.seq_lens, self.starts = self._int_views(self._int)
        host_long, host_int = self._long_views(self._host_long), self._int_views(self._host_int)
        self._np_tokens, self._np_positions, self._np_slots = (v.numpy() for v in host_long)
        self._np_tables, self._np_seq_lens, self._np_starts = (v.numpy() for v in host_int)
        dim = step.model.config.dim
        self.states = torch.zeros(2, rows, dim, dtype=step.model.embeddings.weight.dtype, device=device)
        self.hidden, self.normed = self.states[0], self.states[1]
        # Recorded after each fill's copies out of the staging (a GPU only).
        self._uploaded = torch.cuda.Event() if pin else None
        self.reset()

    def _long_views(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        rows, width = self.max_tokens, self.num_rows
        tokens = flat[: rows * width].view(rows, width)
        return tokens, flat[rows * width : rows * (width + 1)], flat[rows * (width + 1) :]

    def _int_views(self, flat: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        pages = self.max_pages
        return flat[:pages].view(1, pages), flat[pages : pages + 1], flat[pages + 1 :]

    def fits(self, count: int) -> bool:
        return 1 <= count <= self.max_tokens

    def bucket_for(self, count: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, count)]

    def _pad_rows(self, start: int, end: int) -> None:
        """Host rows [start, end) padding: token 0, position 0, a slot in the scratch page."""
        page = self.kv.page_size
        self._np_tokens[start:end] = 0
        self._np_positions[start:end] = 0
        self._np_slots[start:end] = self.kv.scratch_page * page + np.arange(end - start) % page

    def _upload(self) -> None:
        self._long.copy_(self._host_long, non_blocking=True)
        self._int.copy_(self._host_int, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def _wait_for_staging(self) -> None:
        """The previous fill's non-blocking copies read the staging; in the engine they were done
        long ago (that step's frames were read back since), so this does not wait there."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def reset(self) -> None:
        """Every row padding and an empty query (before and after graph capture)."""
        self._wait_for_staging()
        self._pad_rows(0, self.max_tokens)
        self._np_tables[:] = self.kv.scratch_page
        self._np_seq_lens[:] = 0
        self._np_starts[:] = 0
        self._upload()
        self.states.zero_()

    def fill(self, columns: Tensor, start: int, pages: list[int]) -> int:
        """A chunk: `columns` Long [count, N+1] (the request's columns start..start+count), whose
        keys go to positions start.. of the request's block table `pages`. Returns the bucket."""
        count = columns.shape[0]
        if not self.fits(count):
            raise ValueError(f"a chunk of {count} tokens does not fit the largest bucket ({self.max_tokens})")
        if columns.shape[1] != self.num_rows:
            raise ValueError(f"chunk columns must be [count, {self.num_rows}], got {list(columns.shape)}")
        page = self.kv.page_size
        end = start + count
        if len(pages) * page < end or len(pages) > self.max_pages:
            raise ValueError(f"{len(pages)} pages cannot hold {end} keys (at most {self.max_pages} pages)")
        bucket = self.bucket_for(count)
        self._wait_for_staging()
        self._np_tokens[:count] = columns.numpy()
        positions = np.arange(start, end, dtype=np.int64)
        self._np_positions[:count] = positions
        table = np.asarray(pages, dtype=np.int64)
        self._np_slots[:count] = table[positions // page] * page + positions % page
        self._pad_rows(count, bucket)
        self._np_tables[0, : len(pages)] = table
        self._np_tables[0, len(pages) :] = self.kv.scratch_page
        self._np_seq_lens[0] = end
        self._np_starts[:] = (0, count)
        self._upload()
        return bucket

    def compute(self, bucket: int) -> None:
        """The fused prefill of the bucket's rows into `hidden` / `normed` (what graphs capture)."""
        hidden, normed = self.step.prefill(
            self.tokens[:bucket], self.positions[:bucket], self.slots[:bucket],
            (self.tables, self.seq_lens, self.starts, bucket),
        )  # fmt: skip
        self.hidden[:bucket].copy_(hidden)
        self.normed[:bucket].copy_(normed)
