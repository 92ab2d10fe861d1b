"""The correctness gate passes a correct FP8 model and fails a broken scale layout; the performance
gate holds decode step times (synthetic `shoal bench engine` rows, no GPU) against a frozen
baseline: pass, fail, faster, placeholder, not comparable, and the baseline file's round trip."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest
import torch

from shoal.bench import gate, gate_correctness, gate_performance
from shoal.quant.fp8_linear import Fp8Linear, quantize_model_


@pytest.fixture(scope="module")
def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    reference_model = gate_correctness.planted_margin_model()
    fp8_model = copy.deepcopy(reference_model)
    quantize_model_(fp8_model)
    return reference_model, fp8_model


def test_correct_fp8_model_passes(models) -> None:
    reference_model, fp8_model = models
    result = gate_correctness.check_correctness(
        reference_model, fp8_model, gate_correctness.gate_prompt(reference_model.config)
    )
    assert result.passed, result.report()
    assert result.frames_checked == 5 and result.top1_margin_nats > 2


def test_scales_written_column_major_fail_the_gate(models) -> None:
    """The historical bug: scales stored transposed but read row-major, same shape, no error raised."""
    reference_model, fp8_model = models
    broken = copy.deepcopy(fp8_model)
    for _, layer in broken.named_modules():
        if isinstance(layer, Fp8Linear):
            layer.weight_scale = layer.weight_scale.t().contiguous().view(layer.weight_scale.shape)
    result = gate_correctness.check_correctness(
        reference_model, broken, gate_correctness.gate_prompt(reference_model.config)
    )
    assert not result.passed and "FAIL" in result.report()


STEPS = {1: 5.0, 16: 6.0, 64: 8.0}  # baseline decode step ms per concurrency
CONTEXT = 364
H200 = {
    "date": "2026-11-30T06:00:00+00:00", "commit": "abc1234", "gpu": "NVIDIA H200",
    "torch": "2.11.0+cu130", "triton": "3.6.0", "command": "python -m shoal.cli bench engine",
}  # fmt: skip


def _entry(steps: dict[int, float] = STEPS, measured: bool = True, context: int = CONTEXT) -> dict:
    """One weight format's entry as the file schema spells it (written by hand, so a schema change
    in gate_performance.py not made here too fails)."""
    return {
        "measured": measured, **H200, "prompt_tokens": 300, "frames": 128, "context_tokens": context,
        "concurrency": {
            str(c): {"step_ms": ms, "decode_frames_per_s": 1000 / ms, "request_frames_per_s": 100.0 + c}
            for c, ms in steps.items()
        },
    }  # fmt: skip


def _baseline_file(tmp_path: Path, **formats: dict) -> Path:
    path = tmp_path / "baseline.json"
    formats = formats or {"bf16": _entry()}
    path.write_text(json.dumps({"schema": 2, "description": "test", "formats": formats}))
    return path


def _step_rows(
    steps: dict[int, float], weight_format: str = "bf16", context: int = CONTEXT, prefix: int = 0
) -> list[dict]:
    """`shoal bench engine` rows carrying decode step timings; whole-request rates set apart so the
    tests can tell the gate reads the step, not them."""
    return [
        {"weight_format": weight_format, "shared_prefix": prefix, "concurrency": c, "frames": 128,
         "prompt_tokens": 300, "aggregate_frames_per_s": 50.0 * c, "per_request_frames_per_s": 50.0,
         "ttff_p50_ms": 40.0, "decode_step_ms": ms, "decode_step_context": context,
         "decode_frames_per_s": 1000 / ms}
        for c, ms in steps.items()
    ]  # fmt: skip


def _slower(fraction: float, concurrency: int, steps: dict[int, float] = STEPS) -> dict[int, float]:
    """Steps whose per-request decode f/s at `concurrency` is `fraction` lower (negative: higher)."""
    return {c: ms / (1 - fraction) if c == concurrency else ms for c, ms in steps.items()}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    gate.add_arguments(parser)
    return parser.parse_args(["performance", *argv])


def _results_file(tmp_path: Path, rows: list[dict], environment: dict | None = H200) -> Path:
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"results": rows, "fp8_sweep": None, "environment": environment}))
    return path


def _no_bench(*_args, **_kwargs):
    raise AssertionError("--results must not benchmark again")


def _gate_results(tmp_path: Path, baseline: Path, rows: list[dict], *extra: str, environment=H200) -> int:
    """Exit code of `shoal gate performance --baseline B --results (rows) [extra]`."""
    results = _results_file(tmp_path, rows, environment)
    return gate_performance.run_performance(
        _args("--baseline", str(baseline), "--results", str(results), *extra), bench=_no_bench
    )


@pytest.mark.parametrize(
    "steps,expected_rc",
    [
        (STEPS, 0),
        (_slower(0.047, 16), 0),  # 4.7% slower: within 5%
        (_slower(0.06, 16), 1),  # 6% slower: fails
        (_slower(0.06, 1), 1),
        (_slower(0.2, 64), 1),
        (_slower(-0.10, 64), 0),  # 10% faster passes (with a note)
        ({1: 5.0, 16: 6.0}, 1),  # a concurrency missing from the results fails
    ],
)
def test_performance_gate_compares_decode_steps(
    tmp_path: Path, capsys, steps: dict[int, float], expected_rc: int
) -> None:
    calls = []

    def fake_bench(checkpoint, concurrencies, weight_format, **options):
        calls.append((list(concurrencies), weight_format, options))
        return _step_rows(steps, weight_format)

    args = _args("--baseline", str(_baseline_file(tmp_path)))
    assert gate_performance.run_performance(args, bench=fake_bench, environment=lambda: H200) == expected_rc
    # measured like the baseline: same concurrencies, step context, frames and prompt length
    assert calls == [([1, 16, 64], "bf16", {"step_context": CONTEXT, "frames": 128, "prompt_tokens": 300})]
    out = capsys.readouterr().out
    assert f"performance (bf16): {'PASS' if expected_rc == 0 else 'FAIL'}" in out
    assert ("FAIL |" in out) == (expected_rc != 0)
    assert ("re-freeze" in out) == (steps == _slower(-0.10, 64))


def test_performance_gate_ignores_whole_request_rates(tmp_path: Path) -> None:
    """Whole-request rates 50% down with steps unchanged pass; steps 6% slower with whole-request
    rates up fail: only the decode step is gated."""
    baseline = _baseline_file(tmp_path)
    rows = _step_rows(STEPS)
    for row in rows:
        row["per_request_frames_per_s"] *= 0.5
        row["aggregate_frames_per_s"] *= 0.5
    assert _gate_results(tmp_path, baseline, rows) == 0
    rows = _step_rows(_slower(0.06, 64))
    for row in rows:
        row["per_request_frames_per_s"] *= 2
    assert _gate_results(tmp_path, baseline, rows) == 1


def test_performance_table_content() -> None:
    entry = gate_performance.FormatBaseline.from_json(_entry())
    rows = gate_performance.compare_to_baseline(_step_rows(_slower(0.06, 16)), entry, 0.05)
    table = gate_performance.format_table(rows).splitlines()
    assert table[0].split("|")[1:-1] == [
        " concurrency ", " baseline step ms ", " measured step ms ", " baseline f/s ", " measured f/s ",
        " ratio ", " result ", " request f/s baseline / measured (not gated) ",
    ]  # fmt: skip
    cells = [line.split("|")[1:-1] for line in table[2:]]
    assert [c[0].strip() for c in cells] == ["1", "16", "64"]
    one, sixteen = [c.strip() for c in cells[0]], [c.strip() for c in cells[1]]
    assert one == ["1", "5.000", "5.000", "200.0", "200.0", "1.000", "PASS", "101.0 / 50.0"]
    assert sixteen[1:4] == ["6.000", "6.383", "166.7"] and sixteen[4:7] == ["156.7", "0.940", "FAIL"]
    missing = gate_performance.compare_to_baseline(_step_rows({1: 5.0}), entry, 0.05)
    assert [row.passed for row in missing] == [True, False, False]
    assert "| 16 | 6.000 | - | 166.7 | - | - | FAIL |" in gate_performance.format_table(missing)


@pytest.mark.parametrize("allow", [False, True])
@pytest.mark.parametrize("steps", [STEPS, _slower(0.2, 16)])
def test_placeholder_baseline_never_passes(tmp_path: Path, capsys, allow: bool, steps) -> None:
    baseline = _baseline_file(tmp_path, bf16=_entry(measured=False))
    argv = ["--baseline", str(baseline), "--results", str(_results_file(tmp_path, _step_rows(steps)))]
    rc = gate_performance.run_performance(
        _args(*argv, *(["--allow-placeholder"] if allow else [])), bench=_no_bench
    )
    out = capsys.readouterr().out
    assert "PLACEHOLDER" in out and "| 16 |" in out  # the table is printed either way
    if allow:
        assert rc == (0 if steps is STEPS else 1)
    else:
        assert rc == gate_performance.EXIT_PLACEHOLDER == 3 and "performance (bf16): PASS" not in out


def test_repo_baseline_file_is_valid() -> None:
    """Either the placeholder (then the gate exits 3 against it, even on equal numbers) or a real
    H200 measurement with its metadata."""
    baseline = gate_performance.load_baseline(gate_performance.BASELINE)
    assert set(baseline) == {"bf16", "fp8"}
    raw = json.loads(gate_performance.BASELINE.read_text())["formats"]
    for weight_format, entry in baseline.items():
        assert sorted(entry.step_ms) == [1, 16, 64] and all(ms > 0 for ms in entry.step_ms.values())
        assert entry.context_tokens and entry.context_tokens > 0
        for row in raw[weight_format]["concurrency"].values():
            assert row["decode_frames_per_s"] == pytest.approx(1000 / row["step_ms"], rel=1e-3)
        if entry.measured:
            assert all(entry.metadata[key] for key in ("date", "gpu", "torch", "command"))
            assert "H200" in entry.metadata["gpu"]
        else:
            rows = [
                {**row, "decode_step_context": entry.context_tokens}
                for row in _step_rows(entry.step_ms, weight_format)
            ]
            args = _args("--weight-format", weight_format)
            assert (
                gate_performance.gate_format(weight_format, entry, rows, H200, args)
                == gate_performance.EXIT_PLACEHOLDER
            )


def test_write_baseline_round_trip(tmp_path: Path, capsys) -> None:
    baseline = tmp_path / "written.json"
    rows = _step_rows({1: 6.81234, 16: 7.5, 64: 8.1}) + _step_rows({1: 4.9, 16: 6.2, 64: 8.0}, "fp8")
    rows += _step_rows({1: 1.0, 16: 1.0, 64: 1.0}, prefix=200)  # shared-prefix rows are not frozen
    results = _results_file(tmp_path, rows)
    argv = ["--baseline", str(baseline), "--results", str(results), "--weight-format", "bf16", "fp8"]
    assert gate_performance.run_performance(_args(*argv, "--write-baseline"), bench=_no_bench) == 0
    assert "wrote" in capsys.readouterr().out
    raw = json.loads(baseline.read_text())
    assert raw["schema"] == 2 and set(raw["formats"]) == {"bf16", "fp8"}
    bf16 = raw["formats"]["bf16"]
    assert bf16["measured"] is True and bf16["context_tokens"] == CONTEXT
    assert {key: bf16[key] for key in H200} == H200 and bf16["frames"] == 128
    assert bf16["concurrency"]["1"]["step_ms"] == pytest.approx(6.81234, abs=1e-4)
    assert bf16["concurrency"]["1"]["decode_frames_per_s"] == pytest.approx(1000 / 6.81234, abs=0.01)
    assert bf16["concurrency"]["64"]["request_frames_per_s"] == 50.0
    # gating the same run against what was written passes; a 6% slower fp8 row then fails
    assert gate_performance.run_performance(_args(*argv), bench=_no_bench) == 0
    slower = _step_rows({1: 6.81234, 16: 7.5, 64: 8.1}) + _step_rows(
        _slower(0.06, 64, {1: 4.9, 16: 6.2, 64: 8.0}), "fp8"
    )
    argv[3] = str(_results_file(tmp_path, slower))
    assert gate_performance.run_performance(_args(*argv), bench=_no_bench) == 1


def test_write_baseline_measures_and_keeps_other_formats(tmp_path: Path) -> None:
    baseline = _baseline_file(tmp_path, fp8=_entry({1: 3.0, 16: 4.0, 64: 5.0}))
    calls = []

    def fake_bench(checkpoint, concurrencies, weight_format, **options):
        calls.append((list(concurrencies), weight_format, options))
        return _step_rows({1: 6.0, 16: 7.0, 64: 8.0}, weight_format)

    args = _args("--baseline", str(baseline), "--write-baseline", "--commit", "feedbee")
    assert gate_performance.run_performance(args, bench=fake_bench, environment=lambda: H200) == 0
    assert calls == [([1, 16, 64], "bf16", {})]
    written = gate_performance.load_baseline(baseline)
    assert written["bf16"].step_ms == {1: 6.0, 16: 7.0, 64: 8.0} and written["bf16"].measured
    assert written["bf16"].metadata["commit"] == "feedbee"
    assert written["fp8"].step_ms == {1: 3.0, 16: 4.0, 64: 5.0}  # kept


def test_write_baseline_refuses_rows_without_step_timing(tmp_path: Path, capsys) -> None:
    baseline = tmp_path / "out.json"
    rows = _step_rows(STEPS)
    del rows[1]["decode_step_ms"]  # e.g. a CPU run, or --concurrency 1 64
    assert _gate_results(tmp_path, baseline, rows, "--write-baseline") == gate_performance.EXIT_NOT_COMPARABLE
    assert not baseline.exists() and "nothing written" in capsys.readouterr().out


@pytest.mark.parametrize(
    "rows,environment",
    [
        (_step_rows(STEPS, context=332), H200),  # e.g. `--frames 64`: another context
        (_step_rows(STEPS), {**H200, "gpu": "NVIDIA A100-SXM4-80GB"}),
        # `--max-seq-len 32768`: wider block tables, more attention splits than the baseline's
        ([{**row, "max_seq_len": 32768} for row in _step_rows(STEPS)], H200),
    ],
)
def test_not_comparable_results_exit_2(tmp_path: Path, capsys, rows, environment) -> None:
    rc = _gate_results(tmp_path, _baseline_file(tmp_path), rows, environment=environment)
    assert rc == gate_performance.EXIT_NOT_COMPARABLE == 2
    assert "NOT COMPARABLE" in capsys.readouterr().out


def test_default_table_width_is_comparable(tmp_path: Path) -> None:
    """Rows that record the bench's default width (prompt + frames + 16) match a baseline that
    predates the field."""
    rows = [{**row, "max_seq_len": 300 + 128 + 16} for row in _step_rows(STEPS)]
    assert _gate_results(tmp_path, _baseline_file(tmp_path), rows) == 0


def test_old_schema_baseline_is_not_comparable(tmp_path: Path, capsys) -> None:
    path = tmp_path / "old.json"
    path.write_text(json.dumps({"measured": True, "per_request_frames_per_s": {"1": 150.0}}))
    assert _gate_results(tmp_path, path, _step_rows(STEPS)) == 2
    assert "--write-baseline" in capsys.readouterr().out


def test_exit_codes_combine_over_formats() -> None:
    assert gate_performance.combine_exit_codes([0, 0]) == 0
    assert (
        gate_performance.combine_exit_codes([3, 1]) == 1
    )  # a real regression is not hidden by a placeholder
    assert gate_performance.combine_exit_codes([0, 3]) == 3
    assert gate_performance.combine_exit_codes([2, 3]) == 2


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
    results = _results_file(tmp_path, rows)
    # the baseline has no fp8 entry: only the targets are checked
    argv = ["--baseline", str(_baseline_file(tmp_path)), "--results", str(results), "--weight-format", "fp8"]
    assert gate_performance.run_performance(_args(*argv, "--targets"), bench=_no_bench) == expected_rc
    out = capsys.readouterr().out
    assert "fp8 aggregate frames/s at concurrency 1" in out and "performance (fp8)" in out


def test_fp8_without_baseline_entry_needs_targets(tmp_path: Path, capsys) -> None:
    baseline = _baseline_file(tmp_path)
    assert "fp8" not in gate_performance.load_baseline(baseline)
    args = _args("--baseline", str(baseline), "--weight-format", "fp8")
    assert gate_performance.run_performance(args, bench=lambda *a, **k: [], environment=lambda: H200) == 2
    assert "no fp8 entry" in capsys.readouterr().out


def test_bench_prints_decode_step_columns(capsys) -> None:
    from shoal.bench.engine import print_results

    rows = _step_rows({1: 6.8, 64: 8.1}) + _rows("fp8", 300.0, 12500.0, 20.0)
    for row in rows:
        row.setdefault("ttff_p95_ms", 50.0)
        row.setdefault("gpu_memory_gib", 1.0)
    print_results(rows)
    out = capsys.readouterr().out
    assert "step ms" in out and "dec f/s" in out and "6.800" in out and "147.1" in out
    assert f"CUDA-graph replays at {CONTEXT} keys" in out


def test_bench_ratio_lines() -> None:
    from shoal.bench.engine import ratio_lines

    rows = _rows("bf16", 150.0, 5000.0, 40.0) + _rows("fp8", 300.0, 12500.0, 20.0)
    lines = ratio_lines(rows)
    assert len(lines) == 2
    assert "aggregate 2.00x" in lines[0] and "ttff p50 2.00x" in lines[0] and "aggregate 2.50x" in lines[1]
    steps = ratio_lines(_step_rows({1: 8.0}) + _step_rows({1: 4.0}, "fp8"))
    assert len(steps) == 1 and "decode step 2.00x" in steps[0]
