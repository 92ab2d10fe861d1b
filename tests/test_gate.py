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
