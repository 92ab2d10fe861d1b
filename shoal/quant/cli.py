"""`shoal quantize CHECKPOINT OUT`: write an FP8 block-scaled copy of any checkpoint load_model reads."""

from __future__ import annotations

import argparse
import logging

from shoal.quant.fp8_linear import DEFAULT_QUANTIZE_INPUT, load_quantized, quantize_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="source checkpoint directory or Hugging Face repo id")
    parser.add_argument("out", help="output directory for the FP8 checkpoint")
    parser.add_argument(
        "--quantize-activations", action=argparse.BooleanOptionalAction, default=DEFAULT_QUANTIZE_INPUT,
        help="also quantize activations per token per 128 columns at run time (W8A8 instead of W8A16)",
    )  # fmt: skip
    parser.add_argument("--no-verify", action="store_true", help="skip reloading and checking the output")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = quantize_checkpoint(args.checkpoint, args.out, args.quantize_activations)
    if not args.no_verify:
        load_quantized(out)  # raises LayoutError if any layer's scales would be misread
    print(f"wrote {out}")
    return 0
