"""Decode attention with an FP8 KV cache under a few launch configs, beside the bf16 cache's tuned
one, at S2-Pro shapes (`shoal bench attention`'s cases): the FP8 kernel holds more registers per
thread (187 against 128 at the batch-64 config, read from the sm_90 build on any machine), so
fewer programs fit on an SM; smaller key blocks or fewer stages bring it back to 128. Each config
also with `fp8_kv_f16_mma` (tiles widened to f16 in one conversion, f16 MMAs): "f16".

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
    variants = [(32, 3), (32, 2), (64, 2), (32, 4)]  # (block_n, num_stages) for the FP8 cache
    f16_variants = [None, (32, 2), (64, 2), (128, 2)]  # None: the tuned config
    for batch in args.batch:
        tuned = decode_config(batch)
        for context in args.context:
            case = DecodeCase([context] * batch, contiguous=False)
            bf16 = case.paged(tuned)
            cells = [f"bf16 {tuned.block_n}/{tuned.num_stages} {bf16 * 1e3:7.1f} us"]
            fp8 = case.paged_fp8(tuned)
            cells.append(f"fp8 same {fp8 * 1e3:7.1f} ({fp8 / bf16:.2f}x)")
            for block_n, stages in variants:
                t = case.paged_fp8(replace(tuned, block_n=block_n, num_stages=stages))
                cells.append(f"fp8 {block_n}/{stages} {t * 1e3:7.1f} ({t / bf16:.2f}x)")
            for variant in f16_variants:
                config = replace(tuned, fp8_kv_f16_mma=True)
                if variant is not None:
                    config = replace(config, block_n=variant[0], num_stages=variant[1])
                t = case.paged_fp8(config)
                name = "same" if variant is None else f"{variant[0]}/{variant[1]}"
                cells.append(f"f16 {name} {t * 1e3:7.1f} ({t / bf16:.2f}x)")
            print(f"b={batch} ctx={context}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
