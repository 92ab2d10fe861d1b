"""CUDA graphs of the whole decode step, one per batch-size bucket.

All buckets share one set of static buffers (`DecodeBuffers` sized for the largest bucket)
and one private memory pool. A batch of n rows replays the smallest bucket >= n; rows n.. of
that bucket are padding, pointed at the KV cache's scratch page so their writes land nowhere
that matters. A replay is: H2D copies of the host-built inputs (non-blocking, pinned), padding
fills, one graph launch, one D2H copy of the frames. Nothing inside needs the host.
"""

from __future__ import annotations

import bisect

import torch
from torch import Tensor

from shoal.engine.runner import DecodeBuffers


class DecodeGraphs:
    def __init__(self, runner, buckets: tuple[int, ...]) -> None:
        if not buckets:
            raise ValueError("at least one graph bucket is needed")
        self.runner = runner
        self.buckets = tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        self.buffers = DecodeBuffers.allocate(
            self.max_batch, runner.max_pages, runner.window_size, runner.num_rows, runner.device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.host_frames = torch.zeros(self.max_batch, runner.num_rows, dtype=torch.int32).pin_memory()
        self._done = torch.cuda.Event()
        self._pad(0, self.max_batch)
        self.capture()

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    def bucket_for(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def _pad(self, start: int, end: int) -> None:
        """Make rows [start, end) harmless padding (device-side fills, no host sync)."""
        if start >= end:
            return
        b = self.buffers
        scratch = self.runner.kv.scratch_page
        b.tokens[start:end].zero_()
        b.positions[start:end].zero_()
        b.slots[start:end].fill_(scratch * self.runner.page_size)
        b.block_tables[start:end].fill_(scratch)
        b.kv_lens[start:end].fill_(1)
        b.window[start:end].zero_()
        b.frame_index[start:end].zero_()
        b.temperature[start:end].fill_(1.0)
        b.top_p[start:end].fill_(1.0)
        b.top_k[start:end].fill_(1)
        b.repetition_penalty[start:end].fill_(1.0)
        b.seed[start:end].zero_()

    @torch.no_grad()
    def capture(self) -> None:
        """Warm every bucket up on a side stream (Triton compiles, cuBLAS picks kernels), then
        capture from the largest bucket down so smaller graphs reuse the pool's memory."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                for _ in range(2):
                    self.runner.decode_step(self.buffers.view(bucket))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = None
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.runner.decode_step(self.buffers.view(bucket))
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self._pad(0, self.max_batch)  # warmup and capture wrote into the buffers

    def launch(self, host: DecodeBuffers, batch: int) -> int:
        """Queue inputs and the replay of `batch` live rows; returns the bucket replayed.
        Asynchronous: call `frames()` for the result."""
        bucket = self.bucket_for(batch)
        self._pad(batch, bucket)
        self.buffers.copy_from(host)
        self.graphs[bucket].replay()
        self.host_frames[:batch].copy_(self.buffers.frames[:batch], non_blocking=True)
        self._done.record()
        return bucket

    def frames(self, batch: int) -> Tensor:
        self._done.synchronize()
        return self.host_frames[:batch].clone()

    def run(self, host: DecodeBuffers, batch: int) -> Tensor:
        self.launch(host, batch)
        return self.frames(batch)
