"""Where the engine's frame interval at concurrency 1 goes beyond the decode graph: the GPU
timeline of one request's steady decoding, split at the step's copies (or its first kernel).

Why: the per-request rate at concurrency 1 (`shoal bench engine`) is a little below the graph
step's rate. Between two steps' graphs the
stream carries the metadata copy in, the frames' copy out and the graph launch; this probe
measures each of them on the GPU's clock (PyTorch profiler, CUDA activities), so the decision
to fold them into the graph rests on numbers.

Per decoded frame (median over the request's steady frames, µs): the graph's span (first kernel
start to last kernel end), the copy in and the copy out (their durations), and the idle time
from the end of one step's graph to the start of the next (the copies included), with the
interval between the starts of two graphs.

Usage (GPU): python scripts/probe_frame_gap.py [--frames 48] [--prompt 300]
(`SHOAL_ADVANCE_ON_DEVICE=1`: the engine with `EngineConfig.advance_on_device`.)
"""

from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

from shoal.bench.engine import build_random_s2, make_prompts, run_level
from shoal.bench.profile import chrome_trace
from shoal.config import EngineConfig
from shoal.engine.core import EngineCore

# A graph's kernels run back to back (PDL); a pause longer than this between two kernels is taken
# to be a boundary between two steps' graphs.
STEP_BOUNDARY_US = 8.0
# The decode step's first kernel (`kernels/step_inputs.py`'s token embedding) also starts a step:
# with `advance_on_device` no copy separates two steps' graphs and the pause may be shorter.
STEP_FIRST_KERNEL = "_embed_tokens_kernel"


def gpu_events(trace: dict) -> list[tuple[str, str, float, float]]:
    """(category, name, start µs, duration µs) of the trace's kernels and copies, by start."""
    events = []
    for event in trace.get("traceEvents", []):
        category = event.get("cat")
        if category in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in event:
            events.append((category, event["name"], float(event["ts"]), float(event["dur"])))
    return sorted(events, key=lambda e: e[2])


def frame_table(events: list[tuple[str, str, float, float]]) -> dict[str, float]:
    """Median per-step figures of a steady decode timeline (see the module docstring)."""
    steps: list[dict] = []
    current: dict | None = None
    pending_copies: list[tuple[str, float, float]] = []
    for category, name, start, duration in events:
        if category != "kernel":
            pending_copies.append((name, start, duration))
            continue
        new_step = (
            current is None
            or start - current["end"] > STEP_BOUNDARY_US
            or bool(pending_copies)
            or name.startswith(STEP_FIRST_KERNEL)
        )
        if new_step:
            if current is not None:
                steps.append(current)
            current = {"start": start, "end": start + duration, "kernels": 0, "copies": pending_copies}
            pending_copies = []
        current["end"] = max(current["end"], start + duration)
        current["kernels"] += 1
    if current is not None:
        steps.append(current)
    big = [s for s in steps if s["kernels"] > 100]  # decode graphs, not the prefill's small launches
    rows = []
    for before, after in zip(big, big[1:], strict=False):
        copies = after["copies"]
        h2d = sum(d for n, _, d in copies if "HtoD" in n)
        d2h = sum(d for n, _, d in copies if "DtoH" in n)
        rows.append(
            {
                "span": after["end"] - after["start"],
                "interval": after["start"] - before["start"],
                "idle": after["start"] - before["end"],
                "h2d": h2d,
                "d2h": d2h,
                "copies": len(copies),
                "kernels": after["kernels"],
            }
        )
    steady = rows[2:-2] if len(rows) > 8 else rows
    return {key: statistics.median(r[key] for r in steady) for key in steady[0]} | {"steps": len(steady)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=48)
    parser.add_argument("--prompt", type=int, default=300)
    args = parser.parse_args()
    model = build_random_s2("cuda", torch.bfloat16)
    config = EngineConfig(
        max_running_requests=1, max_seq_len=args.prompt + args.frames + 16, memory_fraction=0.5,
        ignore_eos=True, weight_format="fp8",
    )  # fmt: skip
    core = EngineCore(model, config)
    for seed in (1, 2):  # compile and warm every path the timed request takes
        run_level(core, make_prompts(model, 1, args.prompt, 0, seed=seed), args.frames, 0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        result = run_level(core, make_prompts(model, 1, args.prompt, 0, seed=3), args.frames, 0)
        torch.cuda.synchronize()
    table = frame_table(gpu_events(chrome_trace(prof)))
    print(f"per-request {result['per_request_frames_per_s']:.1f} f/s under the profiler")
    print("median per steady step (µs): " + ", ".join(f"{k} {v:.1f}" for k, v in table.items()))


if __name__ == "__main__":
    main()
