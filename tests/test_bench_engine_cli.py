"""`shoal bench engine`'s options reach `run_engine_bench` (no engine is built here)."""

from __future__ import annotations

import argparse

import pytest

from shoal.bench import engine


def parser() -> argparse.ArgumentParser:
    built = argparse.ArgumentParser()
    engine.add_arguments(built)
    return built


def bench_calls(monkeypatch, argv: list[str]) -> list[dict]:
    """The keyword arguments of each `run_engine_bench` call `shoal bench engine ARGV` makes."""
    calls = []
    monkeypatch.setattr(engine, "run_engine_bench", lambda *args, **kwargs: calls.append(kwargs) or [])
    monkeypatch.setattr(engine, "print_results", lambda results: None)
    assert engine.run(parser().parse_args(["--device", "cpu", *argv])) == 0
    return calls


@pytest.mark.parametrize(
    "argv,buckets",
    [
        ([], None),
        (
            ["--prefill-graph-buckets", "1024", "4096", "8192", "--prefill-graph-segments", "32"],
            [1024, 4096, 8192],
        ),
    ],
)
def test_prefill_graph_options_reach_the_bench(monkeypatch, argv: list[str], buckets) -> None:
    calls = bench_calls(monkeypatch, ["--shared-prefix", "0", "--no-naive", *argv])
    assert len(calls) == 1 and calls[0]["prefill_graph_buckets"] == buckets
    assert calls[0]["prefill_graph_segments"] == (
        32 if buckets else engine.EngineConfig.prefill_graph_segments
    )


def test_prefill_budgets_reach_the_bench_side_by_side(monkeypatch) -> None:
    calls = bench_calls(monkeypatch, ["--no-naive", "--max-prefill-tokens", "8192", "2048"])
    assert [c["max_prefill_tokens"] for c in calls] == [(8192, 2048), (8192, 2048)]  # per shared prefix
    calls = bench_calls(monkeypatch, ["--shared-prefix", "0"])
    assert calls[-1]["max_prefill_tokens"] == ()  # the config's default
    with pytest.raises(SystemExit):
        parser().parse_args(["--max-prefill-tokens", "0"])
