"""One way to time GPU work in the benchmarks: capture it in a CUDA graph, replay, time the replays
with CUDA events, take the median.

Why graphs: a replay is one launch, so the time is the kernels' own, not Python's launch cost,
which is what the engine pays too (its decode step runs as graph replays). Why the median: a
sample now and then lands on a clock ramp or a host hiccup; the median ignores it where a mean
would not. `time_graph_ms`:
1. `warmup_calls` eager calls on a side stream, then a synchronize (Triton compiles, cuBLAS picks
   kernels and allocates its workspace, lazy buffers appear, all outside the capture);
2. capture one `fn()` into a graph;
3. `warmup_replays` replays, then a synchronize, so the first timed replay finds the graph
   uploaded and the caches as every later one does;
4. `repeats` samples, each CUDA events around `replays_per_sample` back-to-back replays.
The result is the median sample / `replays_per_sample` / `calls_per_replay` (how many calls of
the measured thing `fn` makes, e.g. one per input copy that keeps L2 cold).

`sample_ms` and `per_call_ms` take plain callables and numbers, so they are tested on the CPU.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch


def per_call_ms(samples_ms: Sequence[float], replays_per_sample: int = 1, calls_per_replay: int = 1) -> float:
    """Median of the samples, in ms per call: each sample timed `replays_per_sample` replays of
    `calls_per_replay` calls."""
    if not samples_ms:
        raise ValueError("no timing samples")
    if replays_per_sample < 1 or calls_per_replay < 1:
        raise ValueError("replays_per_sample and calls_per_replay must be at least 1")
    return statistics.median(samples_ms) / replays_per_sample / calls_per_replay


def sample_ms(
    replay: Callable[[], object], repeats: int, replays_per_sample: int,
    elapsed_ms: Callable[[Callable[[], None]], float],
) -> list[float]:  # fmt: skip
    """`repeats` samples, each `elapsed_ms(work)` of `replays_per_sample` back-to-back `replay()`s.
    `elapsed_ms` is the clock (CUDA events on the GPU; any callable in tests)."""
    if repeats < 1:
        raise ValueError("repeats must be at least 1")

    def work() -> None:
        for _ in range(replays_per_sample):
            replay()

    return [elapsed_ms(work) for _ in range(repeats)]


def cuda_elapsed_ms(work: Callable[[], None]) -> float:
    """ms between CUDA events recorded around the work `work()` enqueues on the current stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def capture_graph(fn: Callable[[], object], warmup_calls: int = 3) -> torch.cuda.CUDAGraph:
    """`fn` captured as one CUDA graph, after `warmup_calls` eager calls on a side stream (so
    compilation, autotuning and lazy allocation happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup_calls):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_graph_ms(
    fn: Callable[[], object], *, repeats: int = 30, replays_per_sample: int = 1, warmup_calls: int = 3,
    warmup_replays: int = 1, calls_per_replay: int = 1,
) -> float:  # fmt: skip
    """Median ms per call of `fn` replayed as a CUDA graph (module docstring: warm-up, samples).
    `fn` must be capturable: fixed shapes and addresses, no host sync."""
    if not torch.cuda.is_available():
        raise RuntimeError("time_graph_ms needs a CUDA GPU")
    graph = capture_graph(fn, warmup_calls)
    for _ in range(warmup_replays):
        graph.replay()
    torch.cuda.synchronize()
    samples = sample_ms(graph.replay, repeats, replays_per_sample, cuda_elapsed_ms)
    return per_call_ms(samples, replays_per_sample, calls_per_replay)
