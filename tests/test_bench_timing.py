"""The CUDA-graph timing helper's CPU parts (bench/timing.py): sampling loop and statistics, with a
fake clock in place of CUDA events (the capture itself needs a GPU)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from shoal.bench import timing


def test_per_call_ms_is_the_median_per_replay_and_call() -> None:
    assert timing.per_call_ms([3.0, 1.0, 100.0]) == 3.0  # an outlier does not move it
    assert timing.per_call_ms([1.0, 2.0, 3.0, 4.0]) == 2.5  # even count: mean of the middle two
    assert timing.per_call_ms([50.0, 40.0, 60.0], replays_per_sample=10) == 5.0
    assert timing.per_call_ms([50.0, 40.0, 60.0], replays_per_sample=10, calls_per_replay=4) == 1.25


@pytest.mark.parametrize("samples,replays,calls", [([], 1, 1), ([1.0], 0, 1), ([1.0], 1, 0)])
def test_per_call_ms_rejects_bad_input(samples: list[float], replays: int, calls: int) -> None:
    with pytest.raises(ValueError):
        timing.per_call_ms(samples, replays, calls)


def test_sample_ms_times_back_to_back_replays() -> None:
    """Each sample wraps `replays_per_sample` replays; the fake clock reads 2 ms per replay."""
    replays = []

    def fake_clock(work: Callable[[], None]) -> float:
        before = len(replays)
        work()
        return 2.0 * (len(replays) - before)

    samples = timing.sample_ms(
        lambda: replays.append(1), repeats=5, replays_per_sample=7, elapsed_ms=fake_clock
    )
    assert samples == [14.0] * 5 and len(replays) == 35
    assert timing.per_call_ms(samples, replays_per_sample=7, calls_per_replay=2) == 1.0
    with pytest.raises(ValueError):
        timing.sample_ms(lambda: None, repeats=0, replays_per_sample=1, elapsed_ms=fake_clock)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_time_graph_ms_needs_cuda() -> None:
    with pytest.raises(RuntimeError, match="CUDA"):
        timing.time_graph_ms(lambda: None)
