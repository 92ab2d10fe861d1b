"""`shoal bench engine|codec|gemm|attention|profile|ab|serve|formats`: dispatch to one benchmark module.

Each module exposes `add_arguments(parser)` and `run(args) -> int`, and is imported only when
chosen, so the engine benchmark runs on a GPU box without the web stack."""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, tuple[str, str]] = {
    "engine": ("shoal.bench.engine", "batched decode engine: frames/s and time to first frame"),
    "codec": ("shoal.bench.codec", "codec decode throughput"),
    "gemm": ("shoal.bench.gemm", "FP8/bf16 GEMM kernels at decode shapes"),
    "attention": ("shoal.bench.attention", "paged attention kernels"),
    "profile": ("shoal.bench.profile", "one decode step, kernel by kernel (marginal time)"),
    "ab": ("shoal.bench.ab", "decode-step tunables A/B in one process, variants interleaved"),
    "serve": ("shoal.bench.serve", "HTTP/WebSocket load against a running server"),
    "formats": ("shoal.bench.formats", "audio format encoding per API process count (sizes --api-workers)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    listing = "; ".join(f"{name}: {help_text}" for name, (_, help_text) in BENCHMARKS.items())
    parser.add_argument("benchmark", choices=sorted(BENCHMARKS), metavar="BENCHMARK", help=listing)
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")


def run(args: argparse.Namespace) -> int:
    module_name, help_text = BENCHMARKS[args.benchmark]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"shoal bench {args.benchmark}", description=help_text)
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(args.rest)) or 0)
