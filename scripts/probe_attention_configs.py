"""Decode attention under a few launch configs beside the tuned one and SDPA, at S2-Pro shapes:
for a batch bucket whose tuned config trails SDPA at long contexts, to see whether another block
size, stage count or split target closes the gap before `shoal bench ab` checks it in the step.

Usage (GPU): python scripts/probe_attention_configs.py --batch 16 --context 1024 4096 8192 \
    --configs 64/2/264 128/2/264 64/2/528
(each config: block_n/num_stages/target_programs[/min_split_tokens], or comma-separated
field=value pairs such as `num_stages=2,block_n=128`, applied to the tuned entry of the
batch); `--capacity 32768` sizes the block tables as `shoal serve` does (splits follow the width).
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from shoal.bench.ab import parse_fields
from shoal.bench.attention import DecodeCase
from shoal.kernels.attention import AttentionConfig, decode_config


def config_from_text(tuned: AttentionConfig, text: str) -> AttentionConfig:
    """`text` applied to `tuned`: block_n/num_stages/target_programs[/min_split_tokens] or
    comma-separated field=value pairs."""
    if "=" in text:
        return replace(tuned, **parse_fields(text))
    block_n, stages, target, *min_split = (int(part) for part in text.split("/"))
    config = replace(tuned, block_n=block_n, num_stages=stages, target_programs=target)
    return replace(config, min_split_tokens=min_split[0]) if min_split else config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--capacity", type=int, default=0, help="block table width in keys (0: the context)")
    parser.add_argument(
        "--configs", nargs="+", default=["64/2/264", "128/2/264", "64/2/528"],
        help="block_n/num_stages/target_programs[/min_split_tokens] or field=value[,field=value]",
    )  # fmt: skip
    args = parser.parse_args()
    for batch in args.batch:
        tuned = decode_config(batch)
        for context in args.context:
            case = DecodeCase([context] * batch, capacity=args.capacity)
            ours, sdpa = case.paged(tuned), case.sdpa()
            name = f"{tuned.block_n}/{tuned.num_stages}/{tuned.target_programs}"
            cells = [f"sdpa {sdpa * 1e3:6.1f}", f"tuned {name} {ours * 1e3:6.1f} ({sdpa / ours:.2f}x sdpa)"]
            for text in args.configs:
                t = case.paged(config_from_text(tuned, text))
                cells.append(f"{text} {t * 1e3:6.1f} ({sdpa / t:.2f}x)")
            print(f"b={batch} ctx={context}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main()
