"""Launch the sampling kernel as the decode step does (one codebook row of 4,096 logits, or S2's
main row of 4,097 with token ids and RAS; `max_top_k` 64, radix select), a few times, eagerly, so
Nsight Compute can profile one launch of it:

    ncu --clock-control none --kernel-name regex:_sample_kernel --launch-skip 3 --launch-count 1 \\
        --section WarpStateStats --section SourceCounters -o sampler python3 scripts/ncu_sampler.py
    ncu --import sampler.ncu-rep --page source --csv --print-source sass > sampler_sass.csv

The kernel is one program per row, a chain of block-wide steps: the per-instruction stall samples
say which of its steps (reductions, the radix select's passes, the scratch round trip, the top-k
network, the race) the time per call goes to.
Usage: python scripts/ncu_sampler.py [--rows 1] [--main] [--launches 5]
"""

from __future__ import annotations

import argparse

import torch

from shoal.bench.profile import sampler_case
from shoal.kernels.sample import sample_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--main", action="store_true", help="S2's main row (4,097 columns, ids, RAS)")
    parser.add_argument("--launches", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    # Peaked like a trained model's logits rather than flat: a few large values over a wide spread.
    logits, params, extra = sampler_case(args.rows, args.main, "cuda", scale=3.0)
    out = torch.empty(args.rows, dtype=torch.long, device="cuda")
    for _ in range(args.launches):
        sample_tokens(logits, *params, slot=0 if args.main else 3, max_top_k=64, out=out, **extra)
    torch.cuda.synchronize()
    print("tokens", out.tolist()[:8], flush=True)


if __name__ == "__main__":
    main()
