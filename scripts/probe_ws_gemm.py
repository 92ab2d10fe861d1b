"""The FP8 GEMM with a warp-specialized K loop (`GemmConfig.warp_specialize`: a producer warp
group issues the TMA copies, two consumer groups multiply 64 weight rows each) against the tuned
table's config, per S2-Pro shape and M, called as the decode step calls it (split-K partials left
to the consumer). Each warp-specialized candidate is timed beside the plain loop on the same
tiles, so the tile change and the loop change are told apart.

Usage (GPU): python scripts/probe_ws_gemm.py [--m 1 16 64] [--shapes down qkv]
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch

from shoal.bench.gemm import ROTATION_BYTES, SHAPES, _weight_sets, precompile, time_variant
from shoal.kernels import fp8_gemm, quant
from shoal.kernels.fp8_gemm import BLOCK_K, H200_SMS, GemmConfig


def candidates(n: int, k: int, m: int) -> list[GemmConfig]:
    """Warp-specialized tiles (128 swapped weight rows) at about 1, 2 and 3 programs per SM and
    the tuned split, two stage counts each (the shared memory allows 2-3 programs per SM)."""
    tuned = fp8_gemm.pick_config(n, k, m, fp8_activations=True)
    block_m = 16 if m <= 16 else 64
    tiles = -(-n // 128) * -(-m // block_m)
    k_blocks = -(-k // BLOCK_K)
    splits = {max(1, min(k_blocks // 2, math.ceil(t * H200_SMS / tiles))) for t in (1, 2, 3)}
    splits.add(tuned.split_k)
    stages = (4, 6) if block_m == 16 else (3, 4)
    return [
        GemmConfig(block_m, 128, split, 4, stage, swap_ab=True, tma=True, scales_ahead=True,
                   bf16_partials=tuned.bf16_partials and split > 1, warp_specialize=True)
        for split in sorted(splits) for stage in stages
    ]  # fmt: skip


def _call(config: GemmConfig):
    return lambda x, w: fp8_gemm.fp8_gemm(x[0], x[1], w["w_q"], w["w_scale"], config=config, unreduced=True)


def _input(m: int, k: int):
    return quant.quantize_activations(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))


def _compile(job: tuple) -> str | None:
    n, k, m, config = job
    try:
        _call(config)(_input(m, k), _weight_sets(n, k, 1)[0])
        torch.cuda.synchronize()
        return None
    except Exception as error:  # noqa: BLE001 - reported; the timing pass skips it too
        return f"{type(error).__name__}: {str(error)[:120]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = parser.parse_args()
    jobs = []
    for name in args.shapes:
        n, k = SHAPES[name]
        for m in args.m:
            for config in candidates(n, k, m):
                jobs += [(n, k, m, config), (n, k, m, dataclasses.replace(config, warp_specialize=False))]
    print(f"compiling {len(jobs)} kernels", flush=True)
    precompile(jobs, _compile)
    print(f"{'shape':>8} {'M':>3} {'config':<58} {'plain us':>9} {'ws us':>7} {'ws TB/s':>8} {'vs tuned':>8}")
    for name in args.shapes:
        n, k = SHAPES[name]
        sets = _weight_sets(n, k, max(2, -(-ROTATION_BYTES // (n * k))))
        for m in args.m:
            x = _input(m, k)
            tuned = fp8_gemm.pick_config(n, k, m, fp8_activations=True)
            base = time_variant(_call(tuned), x, sets, 20, 3)
            print(f"{name:>8} {m:>3} tuned {tuned.block_m}x{tuned.block_n} split {tuned.split_k} "
                  f"stages {tuned.num_stages} tma {tuned.tma}: {base * 1e6:.1f} us "
                  f"({n * k / base / 1e12:.2f} TB/s)", flush=True)  # fmt: skip
            for config in candidates(n, k, m):
                try:
                    ws = time_variant(_call(config), x, sets, 20, 3)
                    plain_config = dataclasses.replace(config, warp_specialize=False)
                    plain = time_variant(_call(plain_config), x, sets, 20, 3)
                except Exception as error:  # noqa: BLE001 - out of shared memory, etc.
                    print(f"{name:>8} {m:>3} split {config.split_k} stages {config.num_stages}: {error}")
                    continue
                label = f"{config.block_m}x128 split {config.split_k} stages {config.num_stages}"
                print(f"{name:>8} {m:>3} {label:<58} {plain * 1e6:>9.1f} {ws * 1e6:>7.1f} "
                      f"{n * k / ws / 1e12:>8.2f} {ws / base:>7.3f}x", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
