"""`shoal bench profile`: where one decode step's time goes, kernel by kernel.

The engine bench times whole steps; this one records a few CUDA-graph replays of the step under
the PyTorch profiler and attributes the step's wall time to its kernels. With programmatic
dependent launch (`kernels/pdl.py`) a kernel starts while its predecessor still runs and waits
inside, so a kernel's own duration double-counts. What a kernel adds to the step is its *marginal*
time: its end minus the previous kernel's end (never below zero). The marginals sum to the step's
wall time, so the table answers "what would the step lose without this kernel", which is the
question fusion and kernel tuning ask.

Kernels are keyed by name and launch grid, which tells the projections apart (the FP8 GEMM has
one name but a different grid per weight shape). The analysis (`kernel_events`, `one_replay`,
`marginal_table`) works on the Chrome trace JSON alone and is tested on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class KernelEvent:
    name: str
    grid: tuple[int, ...]
    start_us: float
    duration_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.duration_us

    @property
    def key(self) -> str:
        short = self.name if len(self.name) <= 48 else self.name[:45] + "..."
        return f"{short} {list(self.grid)}"


def kernel_events(trace: dict) -> list[KernelEvent]:
    """GPU kernel events of a Chrome trace (`torch.profiler`'s export), in start order."""
    events = []
    for event in trace.get("traceEvents", []):
        if event.get("cat") != "kernel" or "dur" not in event:
            continue
        grid = tuple(int(g) for g in event.get("args", {}).get("grid", ()))
        events.append(KernelEvent(event["name"], grid, float(event["ts"]), float(event["dur"])))
    return sorted(events, key=lambda e: e.start_us)


def one_replay(events: list[KernelEvent], replays: int) -> list[KernelEvent]:
    """The kernels of the middle replay of `replays` identical ones recorded back to back."""
    if replays < 1 or len(events) % replays:
        raise ValueError(f"{len(events)} kernel events do not split into {replays} equal replays")
    per = len(events) // replays
    middle = replays // 2
    return events[middle * per : (middle + 1) * per]


def marginals(events: list[KernelEvent]) -> list[float]:
    """Per kernel, the µs it adds to the step: its end minus the latest earlier end (>= 0)."""
    out, latest_end = [], None
    for event in events:
        if latest_end is None:
            out.append(event.duration_us)
            latest_end = event.end_us
        else:
            out.append(max(0.0, event.end_us - latest_end))
            latest_end = max(latest_end, event.end_us)
    return out


def marginal_table(events: list[KernelEvent]) -> list[dict]:
    """Rows {key, count, marginal_us, mean_us, own_us} per (name, grid), largest marginal first."""
    rows: dict[str, dict] = {}
    for event, marginal in zip(events, marginals(events), strict=True):
        row = rows.setdefault(event.key, {"key": event.key, "count": 0, "marginal_us": 0.0, "own_us": 0.0})
        row["count"] += 1
        row["marginal_us"] += marginal
        row["own_us"] += event.duration_us
    for row in rows.values():
        row["mean_us"] = row["marginal_us"] / row["count"]
    return sorted(rows.values(), key=lambda r: -r["marginal_us"])


def step_summary(events: list[KernelEvent]) -> dict:
    wall = events[-1].end_us - events[0].start_us if events else 0.0
    return {"kernels": len(events), "wall_us": wall, "marginal_sum_us": sum(marginals(events))}


def print_profile(title: str, events: list[KernelEvent], top: int = 24, window: Iterable[int] = ()) -> None:
    summary = step_summary(events)
    print(f"{title}: {summary['kernels']} kernels, wall {summary['wall_us'] / 1e3:.3f} ms")
    print(f"  {'marginal µs':>11} {'share':>6} {'count':>5} {'mean':>7}  kernel [grid]")
    for row in marginal_table(events)[:top]:
        share = row["marginal_us"] / max(summary["wall_us"], 1e-9)
        counts = f"{row['count']:5d} {row['mean_us']:7.2f}"
        print(f"  {row['marginal_us']:11.1f} {100 * share:5.1f}% {counts}  {row['key']}")
    indices = list(window)
    if indices:
        print("  in order (marginal / own µs):")
        margins = marginals(events)
        for i in indices:
            if 0 <= i < len(events):
                print(f"    {i:5d} {margins[i]:7.2f} / {events[i].duration_us:7.2f}  {events[i].key}")


def profile_step(core, batch: int, context: int, replays: int = 5) -> list[KernelEvent]:
    """Kernel events of the middle of `replays` decode-step graph replays at `batch` rows."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from shoal.bench.engine import _synthetic_rows
    from shoal.bench.timing import capture_graph

    runner = core.runner
    view = _synthetic_rows(core, batch, context)
    with runner.step.holding_metadata():  # every replay at the same positions
        graph = capture_graph(lambda: runner.step(view))
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    runner.host.invalidate()
    return one_replay(kernel_events(chrome_trace(prof)), replays)


def chrome_trace(prof) -> dict:
    """A finished `torch.profiler.profile`'s Chrome trace as a dict (the profiler only exports
    it to a file)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def sampler_case(rows: int, main: bool, device: str, scale: float = 1.0):
    """Inputs of one `sample_tokens` call as the decode step makes it: (bf16 logits [rows,
    4,096] or S2's main row [rows, 4,097] times `scale`, the five per-row parameters, and for
    the main row its token ids, RAS window and semantic range)."""
    import torch

    columns = 4097 if main else 4096
    logits = (scale * torch.randn(rows, columns, device=device)).to(torch.bfloat16)
    params = (
        torch.full((rows,), 0.8, device=device), torch.full((rows,), 0.8, device=device),
        torch.full((rows,), 30, device=device, dtype=torch.long),
        torch.arange(rows, device=device, dtype=torch.long),
        torch.full((rows,), 5, device=device, dtype=torch.long),
    )  # fmt: skip
    extra = {}
    if main:
        extra = {
            "token_ids": torch.arange(columns, device=device, dtype=torch.int32),
            "window": torch.zeros(rows, 16, 11, device=device, dtype=torch.int32),
            "semantic_range": (0, columns - 2),
        }
    return logits, params, extra


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=332, help="keys per row")
    parser.add_argument(
        "--max-seq-len", type=int, default=None,
        help="block-table width, hence the attention's split count (default: context + 48, the engine "
        "bench's step; `shoal serve` uses 32768)",
    )  # fmt: skip
    parser.add_argument("--weight-format", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--top", type=int, default=24)
    parser.add_argument(
        "--layer-window", type=int, default=14, help="print this many kernels of slow layer 10"
    )
    parser.add_argument("--json", default=None, help="write every kernel event of each profiled step here")
    parser.add_argument(
        "--variant", action="append", default=[], metavar="SPEC",
        help="also profile the step with these tuned-table changes (`shoal bench ab`'s syntax); repeat",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("the step profile needs a CUDA GPU")
        return 2
    from shoal.bench.ab import applied, concrete, parse_variant
    from shoal.bench.engine import decode_step_ms, random_step_core

    variants = {"": [], **{spec: concrete(parse_variant(spec)) for spec in args.variant}}
    core = random_step_core(args.batch, args.context, args.weight_format, args.max_seq_len)
    dump = {}
    for batch in args.batch:
        for name, changes in variants.items():
            with applied(changes, core.runner.step):
                step_ms = decode_step_ms(core, [batch], args.context)[batch]
                events = profile_step(core, batch, args.context)
            label = f"decode step, {args.weight_format}, batch {batch}" + (f", {name}" if name else "")
            print(f"{label}: {step_ms:.3f} ms (graph replays, unprofiled)")
            # Slow layer 10 starts after the embedding, the first norm and 10 layers' kernels; the
            # exact offset depends on the kernel count per layer, so print a window around it.
            per_layer = max(1, len(events) // (2 * core.model.config.n_layer))
            start = 2 + 10 * per_layer
            print_profile(
                f"{label}, {args.context} keys", events, args.top, range(start, start + args.layer_window)
            )
            dump[f"{batch}{':' + name if name else ''}"] = [e.__dict__ for e in events]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(dump, f)
    return 0
