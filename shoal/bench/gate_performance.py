"""`shoal gate performance`: the decode step must not get slower.

Per-request decode frames/s at concurrency 1, 16 and 64 must stay within `--tolerance` (5%) of the
frozen baseline file (`bench/baselines/perf_h200.json`), per weight format. The gated
number is the decode step alone: 1000 / (ms of one step at batch = concurrency), the step timed as
CUDA-graph replays at a fixed context (`bench/engine.py: decode_step_ms`; the baseline records the
context and the gate refuses another). Whole-request rates (prefill, scheduling, host jitter) moved
by about 10% between identical H200 runs while the step time repeated within 0.3%, so a 5% gate on
them would flag noise; they are printed beside the gated numbers, not gated. Faster passes (with a
note to re-freeze). `--results FILE` reads a `shoal bench engine --json FILE` run instead of
benchmarking again; `--targets` also checks the issue's absolute targets (`TARGETS`).
`--write-baseline` freezes a run (fresh or `--results`) into the file, with date, commit, GPU,
torch/triton versions and the command. Exit codes: `EXIT_PASS` 0, `EXIT_FAIL` 1 (a row more than
the tolerance slower, or not measured), `EXIT_NOT_COMPARABLE` 2 (no entry for the format, another
context length or GPU, an unreadable or old-schema file; argparse errors are 2 too),
`EXIT_PLACEHOLDER` 3 (the entry says "measured": false and `--allow-placeholder` was not given: a
placeholder never passes).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.bench.targets import TARGETS, check_targets, select_results

BASELINE = Path(__file__).parent / "baselines" / "perf_h200.json"
CONCURRENCIES = (1, 16, 64)
EXIT_PASS = 0
EXIT_FAIL = 1  # a concurrency more than --tolerance slower than the baseline, or not measured
EXIT_NOT_COMPARABLE = 2  # no usable baseline entry, a different context length or GPU (and argparse)
EXIT_PLACEHOLDER = 3  # the baseline entry was never measured ("measured": false)
BASELINE_SCHEMA = 2
METADATA_KEYS = (
    "date", "commit", "gpu", "torch", "triton", "command", "prompt_tokens", "frames", "max_seq_len",
)  # fmt: skip


BASELINE_DESCRIPTION = (
    "Frozen decode step times of `shoal bench engine` on one H200 (S2-Pro shapes, random weights), "
    "per weight format and concurrency: `step_ms` is one decode step at batch = concurrency timed as "
    "CUDA-graph replays at `context_tokens` keys per row; `decode_frames_per_s` = 1000 / step_ms is "
    "the gated per-request rate; `request_frames_per_s` is the whole-request rate of the same run "
    '(not gated). An entry with "measured": false is a placeholder the gate will not pass (exit 3). '
    "Written by `shoal gate performance --write-baseline`."
)


class BaselineError(ValueError):
    """A baseline file the gate cannot use (missing, old schema, malformed)."""


@dataclass
class FormatBaseline:
    """One weight format's frozen numbers: decode step ms per concurrency (the gated number; the
    file's `decode_frames_per_s` is derived from it), whole-request per-request frames/s (shown,
    not gated), the context the step was timed at and where it was measured (`METADATA_KEYS`)."""

    measured: bool
    step_ms: dict[int, float]
    request_frames_per_s: dict[int, float | None]
    context_tokens: int | None
    metadata: dict[str, object]

    def to_json(self) -> dict:
        concurrency = {
            str(c): {
                "step_ms": round(ms, 4),
                "decode_frames_per_s": round(decode_frames_per_s(ms), 2),
                "request_frames_per_s": _rounded(self.request_frames_per_s.get(c), 2),
            }
            for c, ms in sorted(self.step_ms.items())
        }
        metadata = {key: self.metadata.get(key) for key in METADATA_KEYS}
        return {"measured": self.measured, **metadata, "context_tokens": self.context_tokens,
                "concurrency": concurrency}  # fmt: skip

    @classmethod
    def from_json(cls, raw: dict) -> FormatBaseline:
        rows = {int(c): row for c, row in raw["concurrency"].items()}
        return cls(
            measured=raw.get("measured") is True,  # anything but a JSON true is a placeholder
            step_ms={c: float(row["step_ms"]) for c, row in rows.items()},
            request_frames_per_s={
                c: _rounded(row.get("request_frames_per_s"), None) for c, row in rows.items()
            },
            context_tokens=None if raw.get("context_tokens") is None else int(raw["context_tokens"]),
            metadata={key: raw.get(key) for key in METADATA_KEYS},
        )


def _rounded(value: float | None, digits: int | None) -> float | None:
    if value is None:
        return None
    return float(value) if digits is None else round(float(value), digits)


def decode_frames_per_s(step_ms: float) -> float:
    """Per-request decode frames/s at batch B: each of the B rows gets one frame per step."""
    return 1000.0 / step_ms


def load_baseline(path: str | Path) -> dict[str, FormatBaseline]:
    """{weight format: entry} of a baseline file (`BASELINE_SCHEMA`); raises BaselineError."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise BaselineError(f"cannot read baseline {path}: {error}") from error
    if not isinstance(raw, dict) or raw.get("schema") != BASELINE_SCHEMA or "formats" not in raw:
        raise BaselineError(
            f"{path} is not a schema-{BASELINE_SCHEMA} baseline (decode step ms per format); "
            "write one with `shoal gate performance --write-baseline`"
        )
    try:
        return {fmt: FormatBaseline.from_json(entry) for fmt, entry in raw["formats"].items()}
    except (KeyError, TypeError, ValueError) as error:
        raise BaselineError(f"malformed baseline {path}: {error!r}") from error


def save_baseline(
    path: str | Path, formats: dict[str, FormatBaseline], description: str | None = None
) -> None:
    document = {
        "schema": BASELINE_SCHEMA, "description": description or BASELINE_DESCRIPTION,
        "formats": {fmt: formats[fmt].to_json() for fmt in sorted(formats)},
    }  # fmt: skip
    Path(path).write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")


@dataclass
class PerfRow:
    """One concurrency of the gate's table; the gated ratio is measured / baseline decode f/s."""

    concurrency: int
    baseline_step_ms: float
    measured_step_ms: float | None
    tolerance: float
    baseline_request_fps: float | None = None
    measured_request_fps: float | None = None

    @property
    def baseline_fps(self) -> float:
        return decode_frames_per_s(self.baseline_step_ms)

    @property
    def measured_fps(self) -> float | None:
        return None if self.measured_step_ms is None else decode_frames_per_s(self.measured_step_ms)

    @property
    def ratio(self) -> float | None:
        return None if self.measured_step_ms is None else self.baseline_step_ms / self.measured_step_ms

    @property
    def passed(self) -> bool:
        return self.ratio is not None and self.ratio >= 1.0 - self.tolerance

    @property
    def much_faster(self) -> bool:
        return self.ratio is not None and self.ratio > 1.0 + self.tolerance


def compare_to_baseline(
    results: Sequence[dict], baseline: FormatBaseline, tolerance: float = 0.05
) -> list[PerfRow]:
    """One row per baseline concurrency, from `run_engine_bench` rows (`decode_step_ms`,
    `per_request_frames_per_s`). A concurrency without a step timing fails."""
    by_concurrency = {int(r["concurrency"]): r for r in results}
    rows = []
    for c in sorted(baseline.step_ms):
        result = by_concurrency.get(c, {})
        step = result.get("decode_step_ms")
        request = result.get("per_request_frames_per_s")
        rows.append(
            PerfRow(
                c, baseline.step_ms[c], None if step is None else float(step), tolerance,
                baseline.request_frames_per_s.get(c), None if request is None else float(request),
            )
        )  # fmt: skip
    return rows


def format_table(rows: Sequence[PerfRow]) -> str:
    """A markdown table (pasteable into docs/performance.md); the last column is not gated."""

    def number(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    lines = [
        "| concurrency | baseline step ms | measured step ms | baseline f/s | measured f/s | ratio | result "
        "| request f/s baseline / measured (not gated) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        cells = [
            str(row.concurrency), number(row.baseline_step_ms, 3), number(row.measured_step_ms, 3),
            number(row.baseline_fps, 1), number(row.measured_fps, 1), number(row.ratio, 3),
            "PASS" if row.passed else "FAIL",
            f"{number(row.baseline_request_fps, 1)} / {number(row.measured_request_fps, 1)}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_frozen(entry: FormatBaseline) -> str:
    """A markdown table of one baseline entry, as `--write-baseline` froze it."""
    lines = [
        "| concurrency | step ms | decode f/s | request f/s (not gated) |",
        "|---|---|---|---|",
    ]
    for c, ms in sorted(entry.step_ms.items()):
        request = entry.request_frames_per_s.get(c)
        shown = "-" if request is None else f"{request:.1f}"
        lines.append(f"| {c} | {ms:.3f} | {decode_frames_per_s(ms):.1f} | {shown} |")
    return "\n".join(lines)


def read_results_file(path: str | Path) -> tuple[list[dict], dict | None]:
    """Rows and environment of a `shoal bench engine --json` file (a bare list: rows only)."""
    raw = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(raw, dict):
        return raw["results"], raw.get("environment")
    return raw, None


def engine_results(
    checkpoint: str | None, concurrencies: Sequence[int], weight_format: str = "bf16", **options
) -> list[dict]:
    """Run the engine benchmark (bench/engine.py) at the gate's concurrencies; `options` go to
    `run_engine_bench` (`step_context`, `frames`, `prompt_tokens`)."""
    from shoal.bench.engine import free_gpu, run_engine_bench

    try:
        return run_engine_bench(
            checkpoint=checkpoint, concurrencies=list(concurrencies), weight_format=weight_format, **options
        )
    finally:
        free_gpu()


def current_environment() -> dict:
    from shoal.bench.engine import environment

    return environment()


def _table_width(metadata: dict) -> int | None:
    """The engine max_seq_len a baseline was measured with: recorded, or the bench's default for
    its prompt and frames (baselines before it was recorded)."""
    if metadata.get("max_seq_len"):
        return int(metadata["max_seq_len"])
    prompt, frames = metadata.get("prompt_tokens"), metadata.get("frames")
    return int(prompt) + int(frames) + 16 if prompt and frames else None


def _not_comparable(entry: FormatBaseline, results: Sequence[dict], env: dict | None) -> str | None:
    """Why these results cannot be held against this entry, or None."""
    contexts = {int(r["decode_step_context"]) for r in results if "decode_step_context" in r}
    if entry.context_tokens is not None and contexts and contexts != {entry.context_tokens}:
        shown = ", ".join(map(str, sorted(contexts)))
        return (
            f"step timed at {shown} keys, baseline at {entry.context_tokens} "
            f"(rerun `shoal bench engine` with --step-context {entry.context_tokens})"
        )
    widths = {int(r["max_seq_len"]) for r in results if r.get("max_seq_len")}
    expected = _table_width(entry.metadata)
    if widths and expected and widths != {expected}:
        shown = ", ".join(map(str, sorted(widths)))
        return (
            f"block tables {shown} keys wide (--max-seq-len), baseline {expected}: the decode "
            "attention's split count follows the width"
        )
    gpu, measured_gpu = entry.metadata.get("gpu"), (env or {}).get("gpu")
    if gpu and measured_gpu and gpu != measured_gpu:
        return f"measured on {measured_gpu}, baseline on {gpu}"
    return None


def gate_format(
    weight_format: str, entry: FormatBaseline | None, results: Sequence[dict], env: dict | None,
    args: argparse.Namespace,
) -> int:  # fmt: skip
    """Print one weight format's table and verdict; return its exit code (`EXIT_*`)."""
    results = select_results(results, weight_format)
    if entry is None and not args.targets:
        print(
            f"performance ({weight_format}): NOT COMPARABLE: {args.baseline} has no {weight_format} entry "
            "(write one with --write-baseline, or check only --targets)"
        )
        return EXIT_NOT_COMPARABLE
    passed = True
    if entry is not None:
        reason = _not_comparable(entry, results, env)
        if reason:
            print(f"performance ({weight_format}): NOT COMPARABLE: {reason}")
            return EXIT_NOT_COMPARABLE
        context = entry.context_tokens if entry.context_tokens is not None else "?"
        print(
            f"{weight_format}: decode step at batch = concurrency, CUDA-graph replays at {context} keys; "
            f"gated: per-request decode f/s = 1000 / step ms, at most {args.tolerance:.0%} slower"
        )
        rows = compare_to_baseline(results, entry, args.tolerance)
        print(format_table(rows))
        passed = all(row.passed for row in rows)
        for row in rows:
            if row.much_faster:
                print(
                    f"note: concurrency {row.concurrency} is {row.ratio - 1:.1%} faster than the baseline; "
                    "if the gain is real, re-freeze it with `shoal gate performance --write-baseline`"
                )
    if args.targets:
        targets_passed, lines = check_targets(results, weight_format)
        print("\n".join(lines))
        passed &= targets_passed
    if entry is not None and not entry.measured:
        print(
            f'baseline {args.baseline} [{weight_format}] is a PLACEHOLDER ("measured": false): its numbers '
            "were never measured. Fill it on the H200 with `shoal gate performance --write-baseline "
            "--weight-format bf16 fp8`"
            + (" (compared anyway: --allow-placeholder)" if args.allow_placeholder else "")
        )
        if not args.allow_placeholder:
            print(f"performance ({weight_format}): PLACEHOLDER, not a pass (exit {EXIT_PLACEHOLDER})")
            return EXIT_PLACEHOLDER
    print(f"performance ({weight_format}): {'PASS' if passed else 'FAIL'} (tolerance {args.tolerance:.0%})")
    return EXIT_PASS if passed else EXIT_FAIL


def combine_exit_codes(codes: Sequence[int]) -> int:
    """0 when every format passed, else the smallest non-zero code (a real regression, 1, wins)."""
    failed = [code for code in codes if code]
    return min(failed) if failed else EXIT_PASS


def _bench_options(entry: FormatBaseline | None) -> dict:
    """Run the bench as the baseline was run: same step context, frames and prompt length."""
    if entry is None:
        return {}
    options = {"step_context": entry.context_tokens}
    options.update({key: entry.metadata.get(key) for key in ("frames", "prompt_tokens")})
    return {key: int(value) for key, value in options.items() if value is not None}


def _weight_formats(args: argparse.Namespace) -> list[str]:
    formats = args.weight_format
    return [formats] if isinstance(formats, str) else list(dict.fromkeys(formats))


def run_performance(
    args: argparse.Namespace, bench: Callable[..., list[dict]] = engine_results,
    environment: Callable[[], dict] = current_environment,
) -> int:  # fmt: skip
    """`shoal gate performance`: per weight format, decode step ms at each baseline concurrency
    against the baseline (`gate_format`), or with --write-baseline freeze them (`write_baseline`)."""
    if args.write_baseline:
        return write_baseline(args, bench, environment)
    formats = _weight_formats(args)
    try:
        baseline = load_baseline(args.baseline)
    except BaselineError as error:
        print(f"performance: NOT COMPARABLE: {error}")
        return EXIT_NOT_COMPARABLE
    if args.results:
        results, env = read_results_file(args.results)
    else:
        results = []
        for weight_format in formats:
            entry = baseline.get(weight_format)
            concurrencies = set(entry.step_ms if entry else ())
            if args.targets:
                concurrencies |= {target[1] for target in TARGETS[weight_format]}
            if concurrencies:
                options = _bench_options(entry)
                results += bench(args.checkpoint, sorted(concurrencies), weight_format, **options)
        env = environment()
    codes = [gate_format(fmt, baseline.get(fmt), results, env, args) for fmt in formats]
    return combine_exit_codes(codes)


def write_baseline(
    args: argparse.Namespace, bench: Callable[..., list[dict]] = engine_results,
    environment: Callable[[], dict] = current_environment,
) -> int:  # fmt: skip
    """Freeze the decode step ms at `CONCURRENCIES` per weight format into `args.baseline`, from a
    bench run now or from `--results FILE`; other formats' entries in the file are kept."""
    formats = _weight_formats(args)
    if args.results:
        results, env = read_results_file(args.results)
        env = env or {}  # an older bench file: the metadata stays unknown, not this machine's
    else:
        results = []
        for weight_format in formats:
            results += bench(args.checkpoint, list(CONCURRENCIES), weight_format)
        env = environment()
    entries = {}
    for weight_format in formats:
        by_concurrency = {int(r["concurrency"]): r for r in select_results(results, weight_format)}
        missing = [c for c in CONCURRENCIES if "decode_step_ms" not in by_concurrency.get(c, {})]
        if missing:
            print(
                f"write-baseline: no {weight_format} decode step timing at concurrency "
                f"{', '.join(map(str, missing))} (a GPU run of `shoal bench engine --concurrency 1 16 64 "
                "--shared-prefix 0` records them); nothing written"
            )
            return EXIT_NOT_COMPARABLE
        rows = [by_concurrency[c] for c in CONCURRENCIES]
        contexts = {int(r["decode_step_context"]) for r in rows}
        if len(contexts) != 1:
            print(f"write-baseline: {weight_format} steps timed at different contexts {sorted(contexts)}")
            return EXIT_NOT_COMPARABLE
        metadata = {key: env.get(key) for key in METADATA_KEYS}
        metadata.update(
            commit=args.commit or env.get("commit"), prompt_tokens=rows[0].get("prompt_tokens"),
            frames=rows[0].get("frames"), max_seq_len=rows[0].get("max_seq_len"),
        )  # fmt: skip
        entries[weight_format] = FormatBaseline(
            measured=True,
            step_ms={c: float(r["decode_step_ms"]) for c, r in zip(CONCURRENCIES, rows, strict=True)},
            request_frames_per_s={
                c: r.get("per_request_frames_per_s") for c, r in zip(CONCURRENCIES, rows, strict=True)
            },
            context_tokens=contexts.pop(),
            metadata=metadata,
        )
    try:
        kept = load_baseline(args.baseline)
    except BaselineError:
        kept = {}  # missing or an older schema: start afresh
    save_baseline(args.baseline, {**kept, **entries})
    for weight_format, entry in entries.items():
        print(f"{weight_format}: frozen at {entry.context_tokens} keys ({entry.metadata.get('gpu')})")
        print(format_frozen(entry))
    others = ", ".join(sorted(kept.keys() - entries.keys())) or "none"
    print(f"wrote {args.baseline} ({', '.join(entries)}; other entries kept: {others})")
    return EXIT_PASS
