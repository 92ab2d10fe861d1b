"""The correctness gate passes a correct FP8 model and fails a broken scale layout; the performance
gate's comparison against a frozen baseline (CPU, reference path)."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import torch

from shoal.bench import gate
from shoal.quant.fp8_linear import Fp8Linear, quantize_model_


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    reference_model = gate.planted_margin_model()
    fp8_model = copy.deepcopy(reference_model)
    quantize_model_(fp8_model)
    return reference_model, fp8_model


def test_correct_fp8_model_passes(models) -> None:
    reference_model, fp8_model = models
    result = gate.check_correctness(reference_model, fp8_model, gate.gate_prompt(reference_model.config))
    assert result.passed, result.report()
    assert result.frames_checked == 5 and result.top1_margin_nats > 2


def test_scales_written_column_major_fail_the_gate(models) -> None:
    """The historical bug: scales stored transposed but read row-major, same shape, no error raised."""
    reference_model, fp8_model = models
    broken = copy.deepcopy(fp8_model)
    for _, layer in broken.named_modules():
        if isinstance(layer, Fp8Linear):
            layer.weight_scale = layer.weight_scale.t().contiguous().view(layer.weight_scale.shape)
    result = gate.check_correctness(reference_model, broken, gate.gate_prompt(reference_model.config))
    assert not result.passed and "FAIL" in result.report()


def _baseline_file(tmp_path: Path) -> Path:
    path = tmp_path / "baseline.json"
    path.write_text(json.dumps({"per_request_frames_per_s": {"1": 200.0, "16": 150.0, "64": 100.0}}))
    return path


@pytest.mark.parametrize(
    "measured,expected_rc",
    [
        ({1: 200.0, 16: 143.0, 64: 120.0}, 0),  # 16 is 4.7% slower: within 5%
        ({1: 200.0, 16: 142.0, 64: 120.0}, 1),  # 16 is 5.3% slower
        ({1: 200.0, 16: 150.0}, 1),  # a concurrency missing from the results fails
    ],
)
def test_performance_gate(tmp_path: Path, capsys, measured: dict[int, float], expected_rc: int) -> None:
    calls = []

    def fake_bench(checkpoint, concurrencies):
        calls.append(list(concurrencies))
        return [{"concurrency": c, "per_request_frames_per_s": v} for c, v in measured.items()]

    args = argparse.Namespace(baseline=str(_baseline_file(tmp_path)), checkpoint=None, tolerance=0.05)
    assert gate.run_performance(args, bench=fake_bench) == expected_rc
    assert calls == [[1, 16, 64]]
    out = capsys.readouterr().out
    assert "concurrency" in out and ("PASS" if expected_rc == 0 else "FAIL") in out


def test_repo_baseline_file_is_readable() -> None:
    baseline = gate.load_baseline(gate.BASELINE)
    assert sorted(baseline) == [1, 16, 64] and all(v > 0 for v in baseline.values())


def _rows(weight_format: str, agg1: float, agg64: float, ttff: float, prefix: int = 0) -> list[dict]:
    return [
        {"weight_format": weight_format, "shared_prefix": prefix, "concurrency": 1, "prompt_tokens": 300,
         "aggregate_frames_per_s": agg1, "per_request_frames_per_s": agg1 * 1.05, "ttff_p50_ms": ttff},
        {"weight_format": weight_format, "shared_prefix": prefix, "concurrency": 64, "prompt_tokens": 300,
         "aggregate_frames_per_s": agg64, "per_request_frames_per_s": agg64 / 50, "ttff_p50_ms": 200.0},
    ]  # fmt: skip


@pytest.mark.parametrize(
    "agg1,agg64,ttff,expected_rc",
    [
        (340.0, 12500.0, 28.0, 0),
        (320.0, 12500.0, 28.0, 1),
        (340.0, 11000.0, 28.0, 1),
        (340.0, 12500.0, 31.0, 1),
    ],
)
def test_performance_gate_reads_bench_output_and_checks_fp8_targets(
    tmp_path: Path, capsys, agg1: float, agg64: float, ttff: float, expected_rc: int
) -> None:
    # bf16 rows and a shared-prefix fp8 row that would pass must not be the ones read
    rows = (
        _rows("bf16", 999.0, 99999.0, 1.0)
        + _rows("fp8", agg1, agg64, ttff)
        + _rows("fp8", 999, 99999, 1, 200)
    )
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"results": rows, "fp8_sweep": None}))

    def no_bench(*_args, **_kwargs):
        raise AssertionError("--results must not benchmark again")

    args = argparse.Namespace(
        baseline=str(_baseline_file(tmp_path)), checkpoint=None, tolerance=0.05,
        weight_format="fp8", results=str(results), targets=True,
    )  # fmt: skip
    assert gate.run_performance(args, bench=no_bench) == expected_rc
    out = capsys.readouterr().out
    assert "fp8 aggregate frames/s at concurrency 1" in out and "performance (fp8)" in out


def test_fp8_without_baseline_entry_needs_targets(tmp_path: Path) -> None:
    args = argparse.Namespace(
        baseline=str(_baseline_file(tmp_path)), checkpoint=None, tolerance=0.05,
        weight_format="fp8", results=None, targets=False,
    )  # fmt: skip
    assert gate.load_baseline(args.baseline, "fp8") is None
    assert gate.run_performance(args, bench=lambda *a, **k: []) == 1


def test_bench_ratio_lines() -> None:
    from shoal.bench.engine import ratio_lines

    rows = _rows("bf16", 150.0, 5000.0, 40.0) + _rows("fp8", 300.0, 12500.0, 20.0)
    lines = ratio_lines(rows)
    assert len(lines) == 2
    assert "aggregate 2.00x" in lines[0] and "ttff p50 2.00x" in lines[0] and "aggregate 2.50x" in lines[1]
