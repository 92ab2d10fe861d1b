"""Decode attention with an FP8 KV cache under a few launch configs, beside the bf16 cache's tuned
one, at S2-Pro shapes (`shoal bench attention`'s cases): the FP8 kernel holds more registers per
thread (187 against 128 at the batch-64 config, read from the sm_90 build on any machine), so
fewer programs fit on an SM; smaller key blocks or fewer stages bring it back to 128. Since run
77 the FP8 kernel widens to f16 (one conversion per two values) and has its own tuned table.

Usage (GPU): python scripts/probe_fp8_kv_attention.py [--batch 64] [--context 332 4096]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from shoal.bench.attention import DecodeCase
from shoal.kernels.attention import decode_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64])
    parser.add_argument("--context", type=int, nargs="+", default=[332, 4096])
    args = parser.parse_args()
    variants = [(32, 2), (32, 3), (64, 2), (64, 3), (128, 2), (128, 3)]  # (block_n, num_stages), FP8 cache
    for batch in args.batch:
        tuned = decode_config(batch)
        for context in args.context:
            case = DecodeCase([context] * batch, contiguous=False)
            bf16 = case.paged(tuned)
            cells = [f"bf16 {tuned.block_n}/{tuned.num_stages} {bf16 * 1e3:7.1f} us"]
            fp8_tuned = decode_config(batch, kv_fp8=True)
            fp8 = case.paged_fp8(fp8_tuned)
            name = f"{fp8_tuned.block_n}/{fp8_tuned.num_stages}"
            cells.append(f"fp8 tuned {name} {fp8 * 1e3:7.1f} ({fp8 / bf16:.2f}x)")
            for block_n, stages in variants:
                t = case.paged_fp8(replace(fp8_tuned, block_n=block_n, num_stages=stages))
                cells.append(f"fp8 {block_n}/{stages} {t * 1e3:7.1f} ({t / bf16:.2f}x)")
            print(f"b={batch} ctx={context}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
