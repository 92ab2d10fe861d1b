"""Launch one FP8 GEMM as the engine does (pre-quantized activations, split-K partials left to the
consumer), a few times, eagerly, so Nsight Compute can profile one launch of it:

    ncu --clock-control none --kernel-name regex:fp8_gemm --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 scripts/ncu_gemm.py 2560 9728 64

Counters say what timing cannot: whether a GEMM that streams its weights at 36% of the read
ceiling is waiting on memory, on its MMA chain, or on too few warps (docs/performance.md).
Usage: python scripts/ncu_gemm.py N K M [--config 'GemmConfig(...)'] [--launches 5]
"""

from __future__ import annotations

import argparse

import torch

from shoal.bench.gemm import add_gemm_case_arguments, gemm_case_config
from shoal.kernels import fp8_gemm, quant, reference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gemm_case_arguments(parser)
    parser.add_argument("--launches", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    weight = torch.randn(args.n, args.k, device=device, dtype=torch.bfloat16)
    w_q, w_scale = reference.quantize_weight(weight)
    x_q, x_scale = quant.quantize_activations(torch.randn_like(weight[: args.m]))
    config = gemm_case_config(args, device)
    print(config, flush=True)
    for _ in range(args.launches):
        fp8_gemm.fp8_gemm(x_q, x_scale, w_q, w_scale, config=config, unreduced=config.split_k > 1)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
