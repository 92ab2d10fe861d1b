"""CUDA graphs of the whole decode step, one per batch-size bucket.

All buckets share the runner's static `DecodeBuffers` (sized for max_running_requests) and one
private memory pool. A batch of n rows replays the smallest bucket >= n; rows n.. of that
bucket are padding (`HostBatch` points them at the KV cache's scratch page). A replay is one
graph launch; the inputs were copied in before it (non-blocking, pinned) and the frames are
copied out after it by the runner. Nothing inside needs the host.
"""

from __future__ import annotations

import bisect

import torch


class DecodeGraphs:
    def __init__(self, runner, buckets: tuple[int, ...]) -> None:
        if not buckets:
            raise ValueError("at least one graph bucket is needed")
        self.runner = runner
        self.buckets = tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        if self.max_batch > runner.max_batch:
            raise ValueError("graph buckets exceed max_running_requests")
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture()

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    def bucket_for(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def _padded_inputs(self) -> None:
        """Every row harmless padding (the host batch's padding, sent whole)."""
        host = self.runner.host
        host.reset()
        for name in host.host.names:
            getattr(self.runner.buffers, name).copy_(getattr(host.host, name))

    @torch.no_grad()
    def capture(self) -> None:
        """Warm every bucket up on a side stream (Triton compiles, cuBLAS picks kernels), then
        capture from the largest bucket down so smaller graphs reuse the pool's memory."""
        runner = self.runner
        self._padded_inputs()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                for _ in range(2):
                    runner.decode_step(runner.buffers.view(bucket))
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        pool = None
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                runner.decode_step(runner.buffers.view(bucket))
            pool = graph.pool() if pool is None else pool
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self._padded_inputs()  # warmup and capture wrote into the buffers
        runner.host.invalidate()

    def replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()
