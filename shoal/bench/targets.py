"""Which `shoal bench engine` rows the performance gate reads, and the issue's absolute targets.

Shared by the engine benchmark (it prints the targets after its table) and the performance gate
(`bench/gate_performance.py`, which runs that benchmark): both import this module, it imports
neither.
"""

from __future__ import annotations

from collections.abc import Sequence

# The absolute targets per weight format, on `shoal bench engine` rows without a shared voice
# prefix: (what, concurrency, result key, "min" | "max", bound).
TARGETS: dict[str, list[tuple[str, int, str, str, float]]] = {
    "bf16": [
        ("aggregate frames/s", 1, "aggregate_frames_per_s", "min", 120.0),
        ("aggregate frames/s", 64, "aggregate_frames_per_s", "min", 4000.0),
    ],
    "fp8": [
        ("aggregate frames/s", 1, "aggregate_frames_per_s", "min", 330.0),
        ("aggregate frames/s", 64, "aggregate_frames_per_s", "min", 12000.0),
        ("time to first frame p50 ms (300-token prompt)", 1, "ttff_p50_ms", "max", 30.0),
    ],
}


def select_results(results: Sequence[dict], weight_format: str) -> list[dict]:
    """The rows of one weight format (rows without the key are bf16), the KV cache in the model
    dtype (the baselines' setting), no shared voice prefix, all of a level's requests at once
    (not `--closed-loop`), and the engine's default prefill overlap where both settings ran."""
    rows = [
        r
        for r in results
        if r.get("weight_format", "bf16") == weight_format
        and r.get("kv_cache_dtype", "auto") == "auto"
        and int(r.get("shared_prefix", 0)) == 0
        and not r.get("closed_loop", 0)
    ]
    if any(r.get("overlap_prefill", True) for r in rows):
        rows = [r for r in rows if r.get("overlap_prefill", True)]
    return rows


def check_targets(results: Sequence[dict], weight_format: str) -> tuple[bool, list[str]]:
    """The issue's absolute targets (`TARGETS`) on rows of `select_results`; a missing row fails."""
    by_concurrency = {int(r["concurrency"]): r for r in results}
    lines, passed = [], True
    for what, concurrency, key, kind, bound in TARGETS[weight_format]:
        row = by_concurrency.get(concurrency)
        value = None if row is None or key not in row else float(row[key])
        ok = value is not None and (value >= bound if kind == "min" else value <= bound)
        if key == "ttff_p50_ms" and row is not None and row.get("prompt_tokens", 300) != 300:
            ok = False  # the target is stated for a 300-token prompt
        passed &= ok
        shown = "-" if value is None else f"{value:.1f}"
        sign = ">=" if kind == "min" else "<="
        lines.append(
            f"{weight_format} {what} at concurrency {concurrency}: {shown} "
            f"(target {sign} {bound:g})  {'ok' if ok else 'FAIL'}"
        )
    return passed, lines
