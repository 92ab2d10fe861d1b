"""CUDA graphs of the engine's fixed-shape GPU work, one per bucket.

`DecodeGraphs`: the whole decode step per batch-size bucket, on the runner's static
`DecodeBuffers`, one private memory pool. A batch of n rows replays the smallest bucket >= n; rows
n.. are padding (`HostBatch` points them at the KV cache's scratch page). Nothing inside needs the
host. `FirstFrameGraphs`: a request's first frame at the end of its prefill, on the runner's
`FirstFrameBatch`, captured into the decode graphs' pool (both run on one stream, one after the
other) with the same buckets, hence the same FP8 GEMM row counts. `PrefillGraphs`: a step's
prefill chunks packed into a token bucket (`prefill_batch.PrefillBatch`), the whole slow model in
one launch, with a pool of its own.

All capture the same way (`BucketGraphs.capture`): warm every bucket up on a side stream, then
capture from the largest bucket down so smaller graphs reuse the pool's memory.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch


class BucketGraphs:
    """One CUDA graph per bucket of `body(bucket)`, a function of static buffers only.

    `reset()` makes every row of those buffers harmless padding (before warm-up and again after
    capture, which wrote into them). `pool`: a memory pool of graphs captured before these
    (`BucketGraphs.pool`), shared when the two sets never run concurrently. `capture_stream`:
    where to capture (graphs replayed beside others need their own: cuBLAS's workspace is the
    capture stream's)."""

    def __init__(
        self, buckets: tuple[int, ...], body: Callable[[int], None], reset: Callable[[], None],
        pool: tuple | None = None, capture_stream: torch.cuda.Stream | None = None,
    ) -> None:  # fmt: skip
        if not buckets:
            raise ValueError("at least one graph bucket is needed")
        self.buckets = tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        self._body, self._reset = body, reset
        self.pool = pool
        self.capture_stream = capture_stream  # None: torch's shared capture stream
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def can_run(self, batch: int) -> bool:
        return batch <= self.max_batch

    def bucket_for(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    @torch.no_grad()
    def capture(self) -> None:
        """Warm every bucket up on a side stream (Triton compiles, cuBLAS picks kernels), then
        capture from the largest bucket down so smaller graphs reuse the pool's memory."""
        self._reset()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for bucket in self.buckets:
                for _ in range(2):
                    self._body(bucket)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        for bucket in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.capture_stream):
                self._body(bucket)
            self.pool = graph.pool() if self.pool is None else self.pool
            self.graphs[bucket] = graph
        torch.cuda.synchronize()
        self._reset()  # warm-up and capture wrote into the buffers

    def replay(self, bucket: int) -> None:
        self.graphs[bucket].replay()


class DecodeGraphs(BucketGraphs):
    """The whole decode step over the runner's static `DecodeBuffers`."""

    def __init__(self, runner, buckets: tuple[int, ...]) -> None:
        if buckets and max(buckets) > runner.max_batch:
            raise ValueError("graph buckets exceed max_running_requests")
        self.runner = runner
        super().__init__(
            buckets, lambda bucket: runner.decode_step(runner.buffers.view(bucket)), self._padded_inputs
        )
        self.capture()
        runner.host.invalidate()

    def _padded_inputs(self) -> None:
        """Every row harmless padding (the host batch's padding, sent whole)."""
        host = self.runner.host
        host.reset()
        for name in host.host.names:
            getattr(self.runner.buffers, name).copy_(getattr(host.host, name))
        host.invalidate()


class FirstFrameGraphs(BucketGraphs):
    """`FirstFrameBatch.compute` (runner.py) per bucket: head, main-token sampling and fast loop
    of the rows that complete their prefill, over that batch's static buffers. `pool`: the decode
    graphs' pool (`DecodeGraphs.pool`); capture after them, and after `Fp8Projections.reserve`."""

    def __init__(self, batch, pool: tuple | None) -> None:
        super().__init__(batch.buckets, batch.compute, batch.reset, pool)
        self.capture()


class PrefillGraphs(BucketGraphs):
    """`PrefillBatch.compute` (prefill_batch.py) per token bucket. Capture after the decode and
    first-frame graphs (FP8 GEMM buffers of the row counts they share are reserved by then).
    `capture_stream`: a stream of their own when they replay beside the decode graphs."""

    def __init__(self, batch, capture_stream: torch.cuda.Stream | None = None) -> None:
        super().__init__(batch.buckets, batch.compute, batch.reset, None, capture_stream)
        self.capture()
