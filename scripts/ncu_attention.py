"""Launch the paged decode attention as the FP8 decode step does (S2-Pro's 32 query and 8 kv
heads, e4m3 output for the o projection, the tuned config of the batch), a few times, eagerly, so
Nsight Compute can profile one launch of it:

    ncu --clock-control none --kernel-name regex:_paged_attention_kernel --launch-skip 3 \\
        --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy \\
        -o attention python3 scripts/ncu_attention.py --batch 16
    ncu --import attention.ncu-rep --page source --csv --print-source sass > attention_sass.csv

Why: at batch 16 and a few hundred keys the kernel stays well above its read floor, and its
cp.async pipeline makes a SASS read on the CPU say little about where the time goes; the stall
samples per instruction do.
`--table-keys` sets the block table's width (the engine bench's is context + 48; `shoal serve`'s
32,768): the split count follows it.
Usage: python scripts/ncu_attention.py [--batch 16] [--context 332] [--table-keys 380] [--launches 5]
"""

from __future__ import annotations

import argparse

import torch

from shoal.bench.attention import HEAD_DIM, HQ, DecodeCase
from shoal.kernels.attention import choose_num_splits, decode_config, paged_decode_attention
from shoal.kernels.quant import new_activation_scales


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=332, help="keys per row")
    parser.add_argument("--table-keys", type=int, default=0, help="block table width (default context + 48)")
    parser.add_argument("--launches", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    table_keys = args.table_keys or args.context + 48
    case = DecodeCase([args.context] * args.batch, contiguous=False, capacity=table_keys)
    q, k, v, tables, _ = case.inputs[0]
    config = decode_config(args.batch)
    splits = choose_num_splits(args.batch, k.shape[2], tables.shape[1] * k.shape[1], config)
    print(f"batch {args.batch}, {args.context} keys, table {tables.shape[1] * k.shape[1]} keys: {config}")
    print(f"splits {splits}, programs {args.batch * k.shape[2] * splits}", flush=True)
    out8 = torch.empty(args.batch, HQ * HEAD_DIM, dtype=torch.float8_e4m3fn, device="cuda")
    scales = new_activation_scales(args.batch, HQ * HEAD_DIM, "cuda")
    for _ in range(args.launches):
        paged_decode_attention(q, k, v, tables, case.seq_lens, out_fp8=(out8, scales))
    torch.cuda.synchronize()
    print("scale sum", float(scales.sum()), flush=True)


if __name__ == "__main__":
    main()
