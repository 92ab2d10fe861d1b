"""Where a concurrency-64 wave of prompts spends the GPU: its prefill's kernels by family.

Why: with 64 prompts of 300 tokens submitted at once, the concurrency-64 aggregate is about half
the decode-only rate: prefill takes about as long as the 64 frames of decode after it. Before
changing the prefill, this says how much of its wall time the GPU is busy, and on what: the FP8
GEMMs (block-scaled `torch._scaled_mm` from 257 rows, our kernel below), their activation
quantization, norms, QK-norm/RoPE/KV writes, prefill attention.

Runs one level (all prompts at once, `--frames` frames each, default 1: prefill and first frames
only) untimed to warm it, three more timed unprofiled (new prompts each), with `--host-top N`
one under cProfile (the host's time by function), then one under `torch.profiler` (CUDA kernels
only), and prints: the walls, the union of kernel intervals (GPU busy), and per kernel family and
per kernel the summed own time, count and mean.

Usage (GPU): python scripts/probe_prefill_kernels.py [--prompts 64] [--tokens 300] [--frames 1]
[--shared 0] [--top 20] [--host-top 40] [--gaps 12]
"""

from __future__ import annotations

import argparse
import re
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from shoal.bench.engine import build_random_s2, make_prompts, run_level
from shoal.bench.profile import KernelEvent, chrome_trace, kernel_events
from shoal.config import EngineConfig
from shoal.engine.engine import EngineCore

# First match wins; the names are Triton function names or cuBLAS/CUTLASS kernel names.
FAMILIES = (
    ("fp8 gemm (ours)", r"fp8_gemm|prefetch_gemm|gluon"),
    ("cuBLAS / CUTLASS gemm", r"gemm|sm90|cutlass|nvjet|xmma"),
    ("activation quant", r"quant"),
    ("prefill attention", r"attention"),
    ("norm", r"norm"),
    ("rope / kv write", r"rope|kv_write"),
    ("sampling / heads", r"sample|head|top_k"),
    ("elementwise / copies", r"elementwise|copy|fill|cat|index|gather|scatter|reduce"),
)


def family(name: str) -> str:
    lowered = name.lower()
    for label, pattern in FAMILIES:
        if re.search(pattern, lowered):
            return label
    return "other"


def busy_us(events: list[KernelEvent]) -> float:
    """Union of the kernels' intervals: time the GPU ran at least one kernel."""
    total, end = 0.0, None
    for event in sorted(events, key=lambda e: e.start_us):
        if end is None or event.start_us >= end:
            total += event.duration_us
            end = event.end_us
        elif event.end_us > end:
            total += event.end_us - end
            end = event.end_us
    return total


def print_gaps(events: list[KernelEvent], count: int) -> None:
    """The `count` longest stretches with no kernel running, with the kernels on either side and
    the time since the first kernel: which boundary the GPU waits at."""
    ordered = sorted(events, key=lambda e: e.start_us)
    gaps, end, before = [], None, None
    for event in ordered:
        if end is not None and event.start_us > end:
            gaps.append((event.start_us - end, end - ordered[0].start_us, before, event))
        if end is None or event.end_us > end:
            end, before = event.end_us, event
    print(f"longest idle stretches ({sum(g for g, *_ in gaps) / 1e3:.1f} ms idle in {len(gaps)} gaps):")
    for gap, at, left, right in sorted(gaps, key=lambda g: -g[0])[:count]:
        print(f"  {gap / 1e3:7.2f} ms at {at / 1e3:7.1f} ms: {left.name[:40]} -> {right.name[:40]}")


def print_table(title: str, rows: dict[str, list[float]], wall_us: float, top: int) -> None:
    print(title)
    print(f"  {'own µs':>10} {'of wall':>7} {'count':>6} {'mean µs':>9}  name")
    for name, durations in sorted(rows.items(), key=lambda kv: -sum(kv[1]))[:top]:
        total = sum(durations)
        short = name if len(name) <= 70 else name[:67] + "..."
        mean = total / len(durations)
        print(f"  {total:10.0f} {100 * total / wall_us:6.1f}% {len(durations):6d} {mean:9.1f}  {short}")


def host_profile(core, model, args, top: int) -> None:
    """The host's time in one unprofiled wave by function (cProfile, cumulative): where the
    launches' Python goes while the GPU waits for them."""
    import cProfile
    import pstats

    prompts = make_prompts(model, args.prompts, args.tokens, args.shared, seed=14)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    run_level(core, prompts, args.frames, args.shared)
    torch.cuda.synchronize()
    profiler.disable()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--shared", type=int, default=0, help="voice-prefix tokens shared by all prompts")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--host-top", type=int, default=0, help="print cProfile's top functions of one wave")
    parser.add_argument("--gaps", type=int, default=0, help="print the longest idle stretches of the GPU")
    args = parser.parse_args()

    model = build_random_s2("cuda", torch.bfloat16)
    config = EngineConfig(
        max_running_requests=args.prompts, max_seq_len=args.tokens + args.frames + 16, memory_fraction=0.6,
        ignore_eos=True, weight_format="fp8",
    )  # fmt: skip
    core = EngineCore(model, config)
    warm = make_prompts(model, args.prompts, args.tokens, args.shared, seed=7)
    run_level(core, warm, args.frames, args.shared)  # compiles and warms every path the level takes
    walls = []
    for seed in (11, 12, 13):  # unprofiled: the wave's own wall (new prompts: no cached prefix)
        prompts = make_prompts(model, args.prompts, args.tokens, args.shared, seed=seed)
        torch.cuda.synchronize()
        start = time.perf_counter()
        run_level(core, prompts, args.frames, args.shared)
        torch.cuda.synchronize()
        walls.append(1e3 * (time.perf_counter() - start))
    print(f"unprofiled wall, ms: {', '.join(f'{w:.1f}' for w in walls)}")
    if args.host_top:
        host_profile(core, model, args, args.host_top)
    prompts = make_prompts(model, args.prompts, args.tokens, args.shared, seed=8)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        result = run_level(core, prompts, args.frames, args.shared)
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    events = kernel_events(chrome_trace(prof))
    busy = busy_us(events)
    own = sum(e.duration_us for e in events)
    print(
        f"{args.prompts} prompts x {args.tokens} tokens (shared {args.shared}), {args.frames} frames: "
        f"wall {wall_us / 1e3:.1f} ms (profiled), GPU busy {busy / 1e3:.1f} ms "
        f"({100 * busy / wall_us:.0f}%), "
        f"kernel time summed {own / 1e3:.1f} ms, {len(events)} kernels; first frame p50 "
        f"{result['ttff_p50_ms']:.1f} ms"
    )
    by_family: dict[str, list[float]] = defaultdict(list)
    by_name: dict[str, list[float]] = defaultdict(list)
    for event in events:
        by_family[family(event.name)].append(event.duration_us)
        by_name[event.name].append(event.duration_us)
    if args.gaps:
        print_gaps(events, args.gaps)
    print_table("by family:", by_family, wall_us, args.top)
    print_table("by kernel:", by_name, wall_us, args.top)


if __name__ == "__main__":
    main()
