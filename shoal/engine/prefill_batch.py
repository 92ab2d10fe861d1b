"""A step's prefill chunks on static buffers, so that they can be replayed as a CUDA graph.

Why: an eager prefill launches about fifteen kernels and a few dozen small torch ops per layer
from Python; for a 300-token S2-Pro prompt the host takes longer to launch its 36 layers than the
GPU takes for the prefill and the first frame together. Replayed, the whole chunk is one launch.

`PrefillBatch` holds the inputs of `DecodeStep.prefill` for up to `segments` chunks (one per
request, `EngineConfig.prefill_graph_segments`) of at most the largest bucket's tokens in all,
the two outputs and a pinned host staging copy. `fill` writes the chunks one after the other and
pads them to a bucket; `compute(bucket)` runs the fused prefill on the static views (what
`graphs.PrefillGraphs` captures; without graphs it runs eagerly, which is how the CPU tests reach
the fill).

Rows past the chunks are padding: token 0 (a text token), position 0, keys and values written into
the KV cache's scratch page, and past every segment's query rows, so the varlen attention computes
no output row for them. Every other op of the prefill is row-wise, so a padding row cannot reach a
live row.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import Tensor

Chunk = tuple[Tensor, int, list[int]]  # (columns Long [count, N+1], first position, block table)


class PrefillBatch:
    """Static buffers for a step's prefill chunks (module docstring); `step` is a kernel
    `DecodeStep`."""

    def __init__(
        self, step, buckets: tuple[int, ...], num_rows: int, max_pages: int, segments: int = 1
    ) -> None:
        if not buckets or min(buckets) < 1:
            raise ValueError(f"prefill graph buckets must be positive token counts, got {buckets}")
        if segments < 1:
            raise ValueError(f"prefill graph segments must be at least 1, got {segments}")
        self.segments = segments
        self.step = step
        self.kv = step.kv
        self.buckets = tuple(sorted(set(buckets)))
        self.max_tokens = self.buckets[-1]
        device = self.kv.k.device
        pin = device.type == "cuda"
        rows, self.num_rows, self.max_pages = self.max_tokens, num_rows, max_pages
        # Two flat buffers, one copy each: int64 tokens | positions | slots, and int32 block
        # tables | key counts | query bounds.
        self._long = torch.zeros(rows * (num_rows + 2), dtype=torch.long, device=device)
        self._int = torch.zeros(segments * (max_pages + 2) + 1, dtype=torch.int32, device=device)
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
        pages, segments = self.max_pages, self.segments
        tables = flat[: segments * pages].view(segments, pages)
        return tables, flat[segments * pages : segments * (pages + 1)], flat[segments * (pages + 1) :]

    def fits(self, count: int) -> bool:
        return 1 <= count <= self.max_tokens

    def takes(self, counts: list[int]) -> bool:
        """Whether chunks of these token counts fit: at most `segments`, a bucket in all."""
        return 1 <= len(counts) <= self.segments and min(counts) >= 1 and self.fits(sum(counts))

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
        """One chunk: `columns` Long [count, N+1] (the request's columns start..start+count),
        whose keys go to positions start.. of the request's block table `pages`. Returns the
        bucket."""
        return self.fill_chunks([(columns, start, pages)])

    def fill_chunks(self, chunks: list[Chunk]) -> int:
        """Chunks of distinct requests, each as `fill` takes one, packed in order (chunk i's
        rows follow chunk i-1's). Returns the bucket."""
        counts = [columns.shape[0] for columns, _, _ in chunks]
        if not self.takes(counts):
            raise ValueError(
                f"chunks of {counts} tokens do not fit {self.segments} segment(s) of at most "
                f"{self.max_tokens} tokens in all"
            )
        page = self.kv.page_size
        for (columns, start, pages), count in zip(chunks, counts, strict=True):
            if columns.shape[1] != self.num_rows:
                raise ValueError(f"chunk columns must be [count, {self.num_rows}], got {list(columns.shape)}")
            if len(pages) * page < start + count or len(pages) > self.max_pages:
                raise ValueError(
                    f"{len(pages)} pages cannot hold {start + count} keys (at most {self.max_pages} pages)"
                )
        total = sum(counts)
        bucket = self.bucket_for(total)
        self._wait_for_staging()
        self._np_tables[:] = self.kv.scratch_page
        self._np_seq_lens[:] = 0
        self._np_starts[:] = total  # segments without a chunk: no query rows
        offset = 0
        for segment, ((columns, start, pages), count) in enumerate(zip(chunks, counts, strict=True)):
            rows = slice(offset, offset + count)
            self._np_tokens[rows] = columns.numpy()
            positions = np.arange(start, start + count, dtype=np.int64)
            self._np_positions[rows] = positions
            table = np.asarray(pages, dtype=np.int64)
            self._np_slots[rows] = table[positions // page] * page + positions % page
            self._np_tables[segment, : len(pages)] = table
            self._np_seq_lens[segment] = start + count
            self._np_starts[segment] = offset
            offset += count
        self._pad_rows(total, bucket)
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
