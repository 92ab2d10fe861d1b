"""`shoal gate correctness|performance`: the checks a release must pass.

correctness (`bench/gate_correctness.py`): FP8 greedy decoding must give the bf16 model's frames
token for token, with the prompt's relative logit error bounded, on a model with planted margins.
performance (`bench/gate_performance.py`): the decode step's frames/s per concurrency must stay
within a tolerance of the frozen baseline file. Each module's docstring says how and why.
"""

from __future__ import annotations

import argparse

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
    add = correctness.add_argument
    # fmt: off
    add("--checkpoint", help="a real checkpoint; default: the planted-margin test model")
    add("--frames", type=int, default=5)
    add("--max-logit-error", type=float, default=0.1)
    add("--block-share", type=float, default=0.5)
    add("--quantize-activations", action=argparse.BooleanOptionalAction, default=DEFAULT_QUANTIZE_INPUT,
        help="W8A8 (the engine's default) or, with --no-quantize-activations, W8A16")
    add("--path", choices=("engine", "reference"), default="engine", help="where the FP8 frames come from")
    add("--device", default=None)
    add("--bf16-partials", action="store_true",
        help="every split-K FP8 GEMM stores bf16 partials (GemmConfig.bf16_partials): the verdict before a "
        "tuned table adopts them (the Triton GEMMs run on a GPU only)")
    add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
        help="the engine path's KV cache: fp8 gates FP8 weights with an e4m3 KV cache against bf16")
    performance = sub.add_parser(
        "performance", help="decode step frames/s within tolerance of a frozen baseline",
        description=(
            f"Exit {EXIT_PASS}: pass; {EXIT_FAIL}: a concurrency more than --tolerance slower or not "
            f"measured; {EXIT_NOT_COMPARABLE}: no usable baseline entry, different context or GPU; "
            f"{EXIT_PLACEHOLDER}: the baseline is a placeholder (measured: false) and "
            "--allow-placeholder was not given. Several formats: the smallest non-zero code."
        ),
    )
    add = performance.add_argument
    add("--baseline", default=str(BASELINE), help="baseline file to read or write")
    add("--checkpoint", default=None)
    add("--tolerance", type=float, default=0.05, help="largest slowdown that passes")
    add("--weight-format", nargs="+", choices=("bf16", "fp8"), default=["bf16"], help="one or more")
    add("--results", default=None, help="a `shoal bench engine --json` file to read")
    add("--targets", action="store_true", help="also check the issue's absolute targets")
    add("--write-baseline", action="store_true",
        help="measure (or read --results) and write --baseline instead of gating; other formats kept")
    add("--allow-placeholder", action="store_true",
        help=f"compare against a placeholder baseline instead of exiting {EXIT_PLACEHOLDER}")
    add("--commit", default=None, help="--write-baseline: the commit to record (default: from the run)")
    # fmt: on


def run(args: argparse.Namespace) -> int:
    return run_correctness(args) if args.gate == "correctness" else run_performance(args)
