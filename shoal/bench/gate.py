"""`shoal gate correctness|performance`: the checks a release must pass.

correctness (`bench/gate_correctness.py`): FP8 greedy decoding must give the bf16 model's frames
token for token, with the prompt's relative logit error bounded, on a model with planted margins.
performance (`bench/gate_performance.py`): the decode step's frames/s per concurrency must stay
within a tolerance of the frozen baseline file. Each module's docstring says how and why.
"""

from __future__ import annotations

import argparse
import sys

from shoal.bench.gate_correctness import run_correctness
from shoal.bench.gate_performance import (
    BASELINE,
    EXIT_FAIL,
    EXIT_NOT_COMPARABLE,
    EXIT_PASS,
    EXIT_PLACEHOLDER,
    run_performance,
)
from shoal.config import KV_CACHE_DTYPES
from shoal.quant.fp8_linear import DEFAULT_QUANTIZE_INPUT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="gate", required=True)
    correctness = sub.add_parser("correctness", help="FP8 greedy frames equal bf16; logit error bounded")
    correctness.add_argument("--checkpoint", help="a real checkpoint; default: the planted-margin test model")
    correctness.add_argument("--frames", type=int, default=5)
    correctness.add_argument("--max-logit-error", type=float, default=0.1)
    correctness.add_argument("--block-share", type=float, default=0.5)
    correctness.add_argument(
        "--quantize-activations",
        action=argparse.BooleanOptionalAction,
        default=DEFAULT_QUANTIZE_INPUT,
        help="W8A8 (the engine's default) or, with --no-quantize-activations, W8A16",
    )
    correctness.add_argument(
        "--path", choices=("engine", "reference"), default="engine", help="where the FP8 frames come from"
    )
    correctness.add_argument("--device", default=None)
    correctness.add_argument(
        "--bf16-partials",
        action="store_true",
        help="every split-K FP8 GEMM stores bf16 partials (GemmConfig.bf16_partials): the gate's "
        "verdict before a tuned table adopts them (the Triton GEMMs run on a GPU only)",
    )
    correctness.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the engine path's KV cache (EngineConfig.kv_cache_dtype): fp8 gates FP8 weights with an "
        "e4m3 KV cache against the bf16 model",
    )
    performance = sub.add_parser(
        "performance",
        help="decode step frames/s within tolerance of a frozen baseline",
        description=(
            f"Exit {EXIT_PASS}: pass; {EXIT_FAIL}: a concurrency more than --tolerance slower or not "
            f"measured; {EXIT_NOT_COMPARABLE}: no usable baseline entry, different context or GPU; "
            f"{EXIT_PLACEHOLDER}: the baseline is a placeholder (measured: false) and "
            "--allow-placeholder was not given. Several formats: the smallest non-zero code."
        ),
    )
    performance.add_argument("--baseline", default=str(BASELINE), help="baseline file to read or write")
    performance.add_argument("--checkpoint", default=None)
    performance.add_argument("--tolerance", type=float, default=0.05, help="largest slowdown that passes")
    performance.add_argument(
        "--weight-format", nargs="+", choices=("bf16", "fp8"), default=["bf16"], help="one or more"
    )
    performance.add_argument("--results", default=None, help="a `shoal bench engine --json` file to read")
    performance.add_argument("--targets", action="store_true", help="also check the issue's absolute targets")
    performance.add_argument(
        "--write-baseline",
        action="store_true",
        help="measure (or read --results) and write --baseline instead of gating; other formats kept",
    )
    performance.add_argument(
        "--allow-placeholder",
        action="store_true",
        help=f"compare against a placeholder baseline instead of exiting {EXIT_PLACEHOLDER}",
    )
    performance.add_argument(
        "--commit", default=None, help="--write-baseline: the commit to record (default: from the run)"
    )


def run(args: argparse.Namespace) -> int:
    return run_correctness(args) if args.gate == "correctness" else run_performance(args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="shoal gate")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
