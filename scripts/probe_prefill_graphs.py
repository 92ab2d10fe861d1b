"""The engine's prefill graphs timed as replays, per token bucket, on random S2-Pro weights.

Why: which GEMM variant the prefill projections take above 128 rows (`engine/fp8_weights.py`'s
`VARIANT_TABLE`: our FP8 kernel, block-scaled `torch._scaled_mm`, or bf16 cuBLAS over bf16
copies of the weights) is decided by timing these graphs with each variant forced everywhere.
`SHOAL_FP8_PREFILL=bf16|scaled_mm|w8a8` forces one variant,
so the comparison takes one process per setting.

Prints ms per replay and TFLOP/s of the slow model (2 x 3.64 GFLOP per token) per bucket.

Usage (GPU): [SHOAL_FP8_PREFILL=scaled_mm] python scripts/probe_prefill_graphs.py [--tokens 128 256 512 1024]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from shoal.bench.engine import random_step_core
from shoal.bench.timing import cuda_elapsed_ms, sample_ms

SLOW_FLOP_PER_TOKEN = 2 * 3.64e9  # S2-Pro's slow transformer, FP8 projections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 256, 384, 512, 1024])
    args = parser.parse_args()
    core = random_step_core([1], 332)
    graphs = core.runner.prefill_graphs
    cells = []
    for tokens in args.tokens:
        graph = graphs.graphs[graphs.bucket_for(tokens)]
        graph.replay()
        torch.cuda.synchronize()
        ms = statistics.median(sample_ms(graph.replay, 10, 1, cuda_elapsed_ms))
        cells.append(f"{tokens}: {ms:.2f} ms ({tokens * SLOW_FLOP_PER_TOKEN / ms / 1e9:.0f} TFLOP/s)")
    print(f"SHOAL_FP8_PREFILL={os.environ.get('SHOAL_FP8_PREFILL', '(the table)')}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
