"""The step profiler's trace analysis (`bench/profile.py`) on hand-made traces: CPU only."""

from __future__ import annotations

import pytest

from shoal.bench.profile import (
    KernelEvent,
    kernel_events,
    marginal_table,
    marginals,
    one_replay,
    step_summary,
)


def _trace(events: list[tuple[str, list[int], float, float]]) -> dict:
    rows = [{"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 99.0}]
    for name, grid, ts, dur in events:
        rows.append({"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"grid": grid}})
    return {"traceEvents": rows}


def test_kernel_events_keeps_kernels_in_start_order():
    trace = _trace([("b", [2, 1, 1], 10.0, 1.0), ("a", [1, 1, 1], 5.0, 2.0)])
    events = kernel_events(trace)
    assert [e.name for e in events] == ["a", "b"]
    assert events[0].grid == (1, 1, 1) and events[0].end_us == 7.0


def test_marginals_attribute_overlapped_kernels_to_their_own_tail():
    # b launches early (PDL) and waits inside a: only its end past a's end counts.
    events = [
        KernelEvent("a", (1,), 0.0, 10.0),
        KernelEvent("b", (1,), 2.0, 11.0),
        KernelEvent("c", (1,), 20.0, 1.0),
    ]
    assert marginals(events) == [10.0, 3.0, 8.0]
    summary = step_summary(events)
    assert summary["wall_us"] == 21.0 and summary["marginal_sum_us"] == 21.0


def test_marginal_never_negative_for_a_kernel_ending_inside_another():
    events = [KernelEvent("a", (1,), 0.0, 10.0), KernelEvent("b", (1,), 1.0, 2.0)]
    assert marginals(events) == [10.0, 0.0]


def test_table_groups_by_name_and_grid():
    events = [
        KernelEvent("gemm", (1, 96, 6), 0.0, 8.0),
        KernelEvent("norm", (1,), 8.0, 2.0),
        KernelEvent("gemm", (1, 40, 7), 10.0, 7.0),
        KernelEvent("gemm", (1, 96, 6), 17.0, 8.0),
    ]
    rows = {r["key"]: r for r in marginal_table(events)}
    assert rows["gemm [1, 96, 6]"]["count"] == 2 and rows["gemm [1, 96, 6]"]["marginal_us"] == 16.0
    assert rows["gemm [1, 40, 7]"]["mean_us"] == 7.0
    assert marginal_table(events)[0]["key"] == "gemm [1, 96, 6]"


def test_one_replay_takes_the_middle_and_refuses_uneven_counts():
    events = [KernelEvent(str(i), (1,), float(i), 1.0) for i in range(9)]
    assert [e.name for e in one_replay(events, 3)] == ["3", "4", "5"]
    with pytest.raises(ValueError):
        one_replay(events, 2)
