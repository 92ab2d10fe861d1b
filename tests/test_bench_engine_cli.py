"""`shoal bench engine`'s options reach `run_engine_bench` (no engine is built here)."""

from __future__ import annotations

import argparse

import pytest

from shoal.bench import engine


def bench_calls(monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> list[dict]:
    """The keyword arguments of every `run_engine_bench` call `shoal bench engine argv` makes."""
    calls = []
    monkeypatch.setattr(engine, "run_engine_bench", lambda *args, **kwargs: calls.append(kwargs) or [])
    monkeypatch.setattr(engine, "print_results", lambda results: None)
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    assert engine.run(parser.parse_args(["--device", "cpu", "--no-naive", *argv])) == 0
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
    calls = bench_calls(monkeypatch, ["--shared-prefix", "0", *argv])
    assert len(calls) == 1 and calls[0]["prefill_graph_buckets"] == buckets
    assert calls[0]["prefill_graph_segments"] == (
        32 if buckets else engine.EngineConfig.prefill_graph_segments
    )


def test_prefill_budgets_reach_the_bench_side_by_side(monkeypatch) -> None:
    calls = bench_calls(monkeypatch, ["--max-prefill-tokens", "8192", "2048"])
    assert [c["max_prefill_tokens"] for c in calls] == [(8192, 2048), (8192, 2048)]  # per shared prefix
    assert bench_calls(monkeypatch, ["--shared-prefix", "0"])[-1]["max_prefill_tokens"] == ()  # the default
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-prefill-tokens", "0"])


def test_kv_layouts_run_side_by_side(monkeypatch) -> None:
    argv = ["--shared-prefix", "0", "--kv-layout", "token_major", "head_major"]
    assert [c["kv_layout"] for c in bench_calls(monkeypatch, argv)] == ["token_major", "head_major"]
    # an e4m3 cache has no head-major pool: that combination is skipped
    calls = bench_calls(monkeypatch, [*argv, "--kv-cache-dtype", "auto", "fp8"])
    assert [(c["kv_cache_dtype"], c["kv_layout"]) for c in calls] == [
        ("auto", "token_major"), ("auto", "head_major"), ("fp8", "token_major")
    ]  # fmt: skip
