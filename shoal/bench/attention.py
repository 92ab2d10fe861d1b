"""Decode-attention benchmark (GPU only; torch + triton): paged Triton kernels vs torch SDPA.

Shapes are S2-Pro's slow layer (32 q heads, 8 kv heads, head_dim 128, bf16). For batch 1/16/64 x
context 1k/4k/8k it times `paged_decode_attention` (pages scattered at random, page size 16)
against `F.scaled_dot_product_attention(enable_gqa=True)` on contiguous KV, and 64 requests
sharing a 1k voice prefix (+ 64 own tokens each) with and without the shared-prefix kernel.
Every time is the median of CUDA-graph replays over several input copies (so a small KV does
not sit in L2); "GB/s" is the fewest bytes the step must read divided by the time, next to the
device-to-device copy bandwidth measured in the same run.

    python -m shoal.bench.attention            # the table
    python -m shoal.bench.attention --sweep    # also try every config in SWEEP, best per shape
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from shoal.kernels.attention import (
    DEFAULT_CONFIG,
    PAGE_SIZE,
    AttentionConfig,
    paged_decode_attention,
    shared_prefix_decode_attention,
)

HQ, HKV, HEAD_DIM = 32, 8, 128
BATCHES = (1, 16, 64)
CONTEXTS = (1024, 4096, 8192)
L2_FLUSH_BYTES = 256 << 20  # inputs cycled until at least this much is touched per replay
SWEEP = [
    replace(DEFAULT_CONFIG, block_n=n, num_warps=w, num_stages=s, target_programs=t)
    for n, w, s, t in itertools.product((32, 64, 128), (4, 8), (1, 2, 3), (132, 264, 528))
]


def time_graph_ms(fn: Callable[[], object], repeats: int = 50) -> float:
    """Median ms of one `fn()` replayed in a CUDA graph (warmed up and compiled first)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 1 GiB, bytes read + written per second."""
    src = torch.empty(1 << 29, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_graph_ms(lambda: dst.copy_(src), repeats=20)
    return 2 * src.numel() * 2 / ms / 1e6


def kv_bytes(tokens: int) -> int:
    return tokens * HKV * HEAD_DIM * 2 * 2


class DecodeCase:
    """`copies` independent inputs for one (batch, lens) shape, paged and contiguous."""

    def __init__(self, seq_lens: list[int], shared_prefix: int = 0, contiguous: bool = True) -> None:
        batch, longest = len(seq_lens), max(seq_lens)
        touched = kv_bytes(sum(seq_lens) - (batch - 1) * shared_prefix)
        self.copies = max(1, min(64, math.ceil(L2_FLUSH_BYTES / touched)))
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        pages_per_seq = -(-longest // PAGE_SIZE)
        shared_pages = shared_prefix // PAGE_SIZE
        own_pages = pages_per_seq - shared_pages
        num_pages = shared_pages + batch * own_pages
        self.inputs = []
        for _ in range(self.copies):
            perm = torch.randperm(num_pages, device="cuda").to(torch.int32)
            tables = torch.empty(batch, pages_per_seq, dtype=torch.int32, device="cuda")
            tables[:, :shared_pages] = perm[:shared_pages]
            tables[:, shared_pages:] = perm[shared_pages:].view(batch, own_pages)
            shape = (num_pages, PAGE_SIZE, HKV, HEAD_DIM)
            k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
            q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            dense = None
            if contiguous:  # SDPA's [B, H, L, D] layout, all rows at the longest length
                dense = (
                    torch.randn(batch, HKV, longest, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                    torch.randn(batch, HKV, longest, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                )
            self.inputs.append((q, k, v, tables, dense))
        self.prefix = torch.full((batch,), shared_prefix, dtype=torch.int32, device="cuda")
        self.groups = torch.tensor([0, batch], dtype=torch.int32, device="cuda")

    def paged(self, config: AttentionConfig) -> float:
        def step() -> None:
            for q, k, v, tables, _ in self.inputs:
                paged_decode_attention(q, k, v, tables, self.seq_lens, config=config)

        return time_graph_ms(step) / self.copies

    def shared(self, config: AttentionConfig) -> float:
        batch = self.seq_lens.shape[0]

        def step() -> None:
            for q, k, v, tables, _ in self.inputs:
                shared_prefix_decode_attention(
                    q, k, v, tables, self.seq_lens, self.prefix, self.groups, batch, config=config
                )

        return time_graph_ms(step) / self.copies

    def sdpa(self) -> float:
        def step() -> None:
            for q, _, _, _, (k, v) in self.inputs:
                F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)

        return time_graph_ms(step) / self.copies


def check_against_sdpa() -> None:
    """A quick correctness guard before timing: paged kernel vs SDPA on the same values."""
    case = DecodeCase([777, 1500], contiguous=False)
    q, k, v, tables, _ = case.inputs[0]
    out = paged_decode_attention(q, k, v, tables, case.seq_lens)
    for b, length in enumerate([777, 1500]):
        positions = torch.arange(length, device="cuda")
        pages = tables[b].long()[positions // PAGE_SIZE]
        keys = k[pages, positions % PAGE_SIZE].permute(1, 0, 2)[None]
        values = v[pages, positions % PAGE_SIZE].permute(1, 0, 2)[None]
        ref = F.scaled_dot_product_attention(q[b : b + 1, :, None], keys, values, enable_gqa=True)[:, :, 0]
        error = ((out[b : b + 1].float() - ref.float()).norm() / ref.float().norm()).item()
        assert error < 1e-2, f"paged decode attention disagrees with SDPA: {error:.2e}"


def best_config(run: Callable[[AttentionConfig], float]) -> tuple[float, AttentionConfig]:
    best = (math.inf, DEFAULT_CONFIG)
    for config in SWEEP:
        try:
            best = min(best, (run(config), config), key=lambda item: item[0])
        except Exception as error:  # a config the compiler rejects (e.g. out of shared memory)
            print(f"  skipped {config}: {type(error).__name__}")
    return best


def run_attention_bench(sweep: bool = False) -> list[dict]:
    """Print the table; return its rows (times in µs) for callers such as the gate."""
    check_against_sdpa()
    copy_gbs = copy_bandwidth_gbs()
    print(f"device: {torch.cuda.get_device_name()}, copy bandwidth {copy_gbs:.0f} GB/s (read+write)")
    rows = []
    for batch, context in itertools.product(BATCHES, CONTEXTS):
        case = DecodeCase([context] * batch)
        ours, sdpa = case.paged(DEFAULT_CONFIG), case.sdpa()
        row = {"case": f"decode b={batch} ctx={context}", "bytes": kv_bytes(batch * context)}
        row.update(ours_us=ours * 1e3, sdpa_us=sdpa * 1e3)
        if sweep:
            tuned, config = best_config(case.paged)
            row.update(tuned_us=tuned * 1e3, config=config)
        rows.append(row)
        del case
    prefix, own, batch = 1024, 64, 64
    case = DecodeCase([prefix + own] * batch, shared_prefix=prefix)
    row = {"case": f"shared {prefix}-token prefix b={batch} +{own}", "bytes": kv_bytes(prefix + batch * own)}
    row.update(ours_us=case.shared(DEFAULT_CONFIG) * 1e3, sdpa_us=case.sdpa() * 1e3)
    row["unshared_us"] = case.paged(DEFAULT_CONFIG) * 1e3
    if sweep:
        tuned, config = best_config(case.shared)
        row.update(tuned_us=tuned * 1e3, config=config)
    rows.append(row)
    header = f"{'case':34} {'min bytes':>10} {'ours µs':>9} {'SDPA µs':>9} {'speedup':>8}"
    print(f"{header} {'GB/s':>7} {'of copy':>8}")
    for row in rows:
        gbs = row["bytes"] / row["ours_us"] / 1e3
        print(
            f"{row['case']:34} {row['bytes'] / 1e6:9.1f}M {row['ours_us']:9.1f} {row['sdpa_us']:9.1f} "
            f"{row['sdpa_us'] / row['ours_us']:7.2f}x {gbs:7.0f} {gbs / copy_gbs:7.0%}"
        )
        if "unshared_us" in row:
            print(f"{'  same, prefix read per request':34} {'':10} {row['unshared_us']:9.1f}")
        if "tuned_us" in row:
            c = row["config"]
            print(
                f"{'  best swept config':34} {'':10} {row['tuned_us']:9.1f}   block_n={c.block_n} "
                f"warps={c.num_warps} stages={c.num_stages} target_programs={c.target_programs}"
            )
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", action="store_true", help="also try every config in SWEEP per shape")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("the attention benchmark needs a CUDA GPU")
        return 2
    run_attention_bench(sweep=args.sweep)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    raise SystemExit(run(parser.parse_args()))
