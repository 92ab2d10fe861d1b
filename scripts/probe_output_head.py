"""Time the output-head kernel (`kernels/output_head.py`) against cuBLAS, alone and behind a norm.

The decode step runs each head right after the final RMSNorm; under programmatic dependent launch
the head kernel's weight loads overlap that norm, which a standalone timing cannot show. So each
case is timed twice as CUDA-graph replays: the head alone, and norm + head (the step's pair).
Prints µs per call for cuBLAS (`F.linear`) and each kernel variant (rows per program / warps /
chunks ahead).

    python scripts/probe_output_head.py [--batch 1 2] [--variants 16/8/2 16/8/1 8/4/2]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

from shoal.bench.timing import time_graph_ms
from shoal.kernels.norm_rope import rms_norm
from shoal.kernels.output_head import output_head

DIM = 2560
HEADS = {"main 4097/4160": (4160, 4097), "codebook 4096": (4096, 4096)}


def time_case(x: torch.Tensor, norm_weight: torch.Tensor, pair: bool, head) -> float:
    """µs per replay of `head(normed)` behind the norm (`pair`), or of `head(x)` alone."""
    normed = torch.empty_like(x)

    def fn() -> None:
        if pair:
            rms_norm(x, norm_weight, 1e-6, out=normed)
        head(normed if pair else x)

    return 1000 * time_graph_ms(fn, repeats=50)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--variants", nargs="+", default=["16/8/2", "16/8/1", "8/4/2"])
    args = parser.parse_args()
    variants = [tuple(int(v) for v in text.split("/")) for text in args.variants]
    gen = torch.Generator().manual_seed(0)
    norm_weight = torch.ones(DIM, dtype=torch.bfloat16, device="cuda")
    print(" | ".join(["head", "batch", "pair", "cuBLAS"] + ["/".join(map(str, v)) for v in variants]))
    for name, (padded, rows) in HEADS.items():
        weight = (torch.randn(padded, DIM, generator=gen) / 50).to(torch.bfloat16).cuda()
        for batch in args.batch:
            x = torch.randn(batch, DIM, device="cuda").to(torch.bfloat16)
            out = torch.empty(batch, rows, dtype=torch.bfloat16, device="cuda")
            heads = [functools.partial(cublas_head, weight=weight, rows=rows)]
            kernel = functools.partial(output_head, weight=weight, rows=rows, out=out)
            heads += [
                functools.partial(kernel, rows_per_program=r, num_warps=w, ahead=a) for r, w, a in variants
            ]
            for pair in (False, True):
                cells = [time_case(x, norm_weight, pair, head) for head in heads]
                label = "norm+head" if pair else "head"
                print(" | ".join([name, str(batch), label] + [f"{c:.2f}" for c in cells]))


def cublas_head(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    return F.linear(x, weight)[:, :rows]


if __name__ == "__main__":
    main()
