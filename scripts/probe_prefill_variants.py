"""The small kernels of an eager prefill chunk at S2-Pro shapes, each timed in several builds.

Why: a concurrency-64 wave's prefill can spend several times what their bytes take on its
QK-norm/RoPE/KV writes and activation quantization. This times, on one 3,840-token chunk (13
prompts of 300 tokens, the engine's chunk at concurrency 64) replayed as CUDA graphs:
- the QK-norm/RoPE/KV write: the per-head build (one warp per token and head) and the block
  build (`kernels/norm_rope_block.py`) at several tokens per program and warps;
- the activation quantization (plain, and SwiGLU of the 19,456-wide gate|up) at 4, 8 and 16
  groups per program;
- the prefill attention at several `AttentionConfig`s;
each with the floor its bytes give at 4.0 TB/s (copy rate: read + write).

Usage (GPU): python scripts/probe_prefill_variants.py [--tokens 3840] [--prompt 300]
"""

from __future__ import annotations

import argparse

import torch

from shoal.bench.timing import time_graph_ms
from shoal.kernels import attention, norm_rope, norm_rope_block, quant
from shoal.models.layers import rope_table

HQ, HKV, D, DIM, INTER = 32, 8, 128, 2560, 9728  # S2-Pro
COPY_TB_S = 4.0


def line(name: str, ms: float, bytes_moved: float, base: float | None = None) -> str:
    floor_us = bytes_moved / COPY_TB_S / 1e6
    ratio = f" {ms / base:6.3f}x" if base else ""
    return f"  {name:<44} {ms * 1e3:8.1f} µs  (floor {floor_us:6.1f} µs, {floor_us / (ms * 1e3):4.0%}){ratio}"


def rope_variants(tokens: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(tokens, (HQ + 2 * HKV) * D, device="cuda", generator=gen).to(torch.bfloat16)
    positions = torch.arange(tokens, device="cuda") % 300
    table = rope_table(4096, D, 1e6).cuda()
    q_w = torch.randn(D, device="cuda", generator=gen).to(torch.bfloat16)
    k_w = torch.randn(D, device="cuda", generator=gen).to(torch.bfloat16)
    pages = torch.zeros((tokens // 16 + 2, 16, HKV, D), dtype=torch.bfloat16, device="cuda")
    v_pages = pages.clone()
    slots = torch.arange(tokens, device="cuda")
    q_out = torch.empty(tokens, HQ, D, dtype=torch.bfloat16, device="cuda")
    moved = tokens * (HQ + 2 * HKV) * D * 2 * 2  # read qkv, write q + k + v

    def run() -> None:
        norm_rope.qk_norm_rope_kv_write(
            qkv, positions, table, pages, v_pages, slots, HQ, HKV, q_w, k_w, q_out=q_out
        )

    print(f"QK-norm/RoPE/KV write, {tokens} tokens:")
    saved = (norm_rope.BLOCK_KERNEL_FROM_TOKENS, norm_rope_block.BLOCK_T, norm_rope_block.NUM_WARPS)
    norm_rope.BLOCK_KERNEL_FROM_TOKENS = 1 << 30
    base = time_graph_ms(run, repeats=15, replays_per_sample=10)
    print(line("per head (1 warp per token and head)", base, moved))
    norm_rope.BLOCK_KERNEL_FROM_TOKENS = 1
    for block, warps in ((16, 4), (8, 2), (32, 4), (32, 8), (64, 8)):
        norm_rope_block.BLOCK_T, norm_rope_block.NUM_WARPS = block, warps
        ms = time_graph_ms(run, repeats=15, replays_per_sample=10)
        print(line(f"block {block} tokens, {warps} warps", ms, moved, base))
    norm_rope.BLOCK_KERNEL_FROM_TOKENS, norm_rope_block.BLOCK_T, norm_rope_block.NUM_WARPS = saved


def quant_variants(tokens: int) -> None:
    x = torch.randn(tokens, DIM, device="cuda").to(torch.bfloat16)
    gate_up = torch.randn(tokens, 2 * INTER, device="cuda").to(torch.bfloat16)
    for name, fn, src, k in (
        ("quantize 2560 columns", quant.quantize_activations, x, DIM),
        ("SwiGLU + quantize 2 x 9728 columns", quant.swiglu_quantize, gate_up, INTER),
    ):
        out = torch.empty(tokens, k, dtype=torch.float8_e4m3fn, device="cuda")
        scales = quant.new_activation_scales(tokens, k, "cuda")
        moved = src.numel() * 2 + tokens * k + tokens * (k // 128) * 4
        print(f"{name}, {tokens} rows:")
        base = None
        for groups, warps in ((4, 4), (8, 4), (16, 4), (16, 8), (32, 8)):
            ms = time_graph_ms(
                lambda fn=fn, src=src, out=out, scales=scales, g=groups, w=warps: fn(
                    src, out=out, scales=scales, groups_per_program=g, num_warps=w
                ),
                repeats=15,
                replays_per_sample=10,
            )
            base = base or ms
            print(line(f"{groups} groups per program, {warps} warps", ms, moved, base))


def attention_variants(tokens: int, prompt: int) -> None:
    seqs = tokens // prompt
    tokens = seqs * prompt
    pages_per_seq = -(-prompt // 16)
    k_pages = torch.randn(seqs * pages_per_seq, 16, HKV, D, device="cuda").to(torch.bfloat16)
    v_pages = torch.randn_like(k_pages)
    tables = torch.arange(seqs * pages_per_seq, device="cuda", dtype=torch.int32).view(seqs, pages_per_seq)
    lens = torch.full((seqs,), prompt, device="cuda", dtype=torch.int32)
    starts = torch.arange(0, tokens + 1, prompt, device="cuda", dtype=torch.int32)
    q = torch.randn(tokens, HQ, D, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    flops = 4 * seqs * HQ * D * prompt * (prompt + 1) / 2
    print(f"prefill attention, {seqs} prompts of {prompt} tokens ({flops / 1e9:.1f} GFLOP causal):")
    base = None
    for block_m, block_n, warps, stages in (
        (16, 64, 4, 2), (16, 64, 4, 3), (16, 32, 4, 2), (16, 128, 4, 2), (16, 64, 8, 2),
        (32, 64, 8, 2), (32, 32, 8, 2), (32, 128, 8, 2), (64, 64, 8, 2),
    ):  # fmt: skip
        config = attention.AttentionConfig(
            block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages
        )
        try:
            ms = time_graph_ms(
                lambda c=config: attention.paged_prefill_attention(
                    q, k_pages, v_pages, tables, lens, starts, prompt, config=c, out=out
                ),
                repeats=15,
                replays_per_sample=10,
            )
        except Exception as error:  # e.g. out of shared memory for a large tile
            print(f"  block_m {block_m} block_n {block_n} warps {warps} stages {stages}: {str(error)[:80]}")
            continue
        base = base or ms
        tflops = flops / ms / 1e9
        name = f"block_m {block_m:3d} block_n {block_n:3d} warps {warps} stages {stages}"
        print(f"  {name}: {ms * 1e3:7.1f} µs ({tflops:5.0f} TFLOP/s) {ms / base:6.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3840)
    parser.add_argument("--prompt", type=int, default=300)
    args = parser.parse_args()
    rope_variants(args.tokens)
    quant_variants(args.tokens)
    attention_variants(args.tokens, args.prompt)


if __name__ == "__main__":
    main()
