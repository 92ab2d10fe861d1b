"""Does the paged KV cache's layout cost decode attention its last few percent against SDPA?

Why: at batch 16 and 64 the paged decode attention runs at 0.93-0.99x of SDPA on contiguous KV
(docs/performance.md run 147), both near the read ceiling, and no launch config closed the gap
(run 153). The pool is `[page, token, kv head, dim]`: one kv head's 16 keys of a page are 16
runs of 256 bytes, 2 KB apart (the other heads' keys in between), where SDPA's contiguous
`[batch, head, token, dim]` reads one head's keys as one run. Before changing the layout of
every kernel that touches the pool, this measures the access pattern alone: a kernel that only
reads (and sums) the keys and values of batch x context tokens through a block table, one
program per (row, kv head, split), in the engine's layout and in a head-major one
(`[page, kv head, token, dim]`: one 4 KB run per head and page), beside SDPA's time on
contiguous KV for the same batch and context.

Usage (GPU): python scripts/probe_kv_layout.py [--batch 16 64] [--context 1024 4096] [--splits 4]
CPU (logic only): TRITON_INTERPRET=1 python scripts/probe_kv_layout.py --check
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

PAGE = 16
KV_HEADS = 8
HEAD_DIM = 128
Q_HEADS = 32


@triton.jit
def _read_pages_kernel(
    k_ptr, v_ptr, tables_ptr, out_ptr, pages_per_row, token_stride, head_stride,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, KV_HEADS: tl.constexpr, SPLITS: tl.constexpr,
    PAGES_PER_SPLIT: tl.constexpr,
):  # fmt: skip
    """Sum of one (row, kv head, split)'s keys and values: the attention's reads, no math."""
    row = tl.program_id(0)
    head = tl.program_id(1) // SPLITS
    split = tl.program_id(1) % SPLITS
    tokens = tl.arange(0, PAGE)
    dims = tl.arange(0, HEAD_DIM)
    offsets = tokens[:, None] * token_stride + head * head_stride + dims[None, :]
    acc = tl.zeros([PAGE, HEAD_DIM], dtype=tl.float32)
    first = split * PAGES_PER_SPLIT
    for i in range(0, PAGES_PER_SPLIT):
        page = tl.load(tables_ptr + row * pages_per_row + first + i).to(tl.int64)
        base = page * PAGE * KV_HEADS * HEAD_DIM
        acc += tl.load(k_ptr + base + offsets).to(tl.float32)
        acc += tl.load(v_ptr + base + offsets).to(tl.float32)
    tl.store(out_ptr + (row * KV_HEADS + head) * SPLITS + split, tl.sum(tl.sum(acc, 1), 0))


def read_pages(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, head_major: bool, splits: int):
    """Launch the read over pools `[pages, PAGE, KV_HEADS, D]` (token-major, the engine's) or
    `[pages, KV_HEADS, PAGE, D]` (`head_major`); returns the per-program sums."""
    rows, pages_per_row = tables.shape
    if pages_per_row % splits:
        raise ValueError(f"{pages_per_row} pages per row do not split in {splits}")
    token_stride, head_stride = (HEAD_DIM, PAGE * HEAD_DIM) if head_major else (KV_HEADS * HEAD_DIM, HEAD_DIM)
    out = torch.empty(rows * KV_HEADS * splits, dtype=torch.float32, device=k.device)
    _read_pages_kernel[(rows, KV_HEADS * splits)](
        k, v, tables, out, pages_per_row, token_stride, head_stride,
        PAGE=PAGE, HEAD_DIM=HEAD_DIM, KV_HEADS=KV_HEADS, SPLITS=splits,
        PAGES_PER_SPLIT=pages_per_row // splits, num_warps=4,
    )  # fmt: skip
    return out


def reference_sums(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, splits: int) -> torch.Tensor:
    """The same sums from the token-major pools in torch."""
    rows, pages_per_row = tables.shape
    per_split = pages_per_row // splits
    gathered = (k.float() + v.float())[tables.long()]  # [rows, pages, PAGE, H, D]
    sums = torch.zeros(rows, KV_HEADS, splits, dtype=torch.float32, device=k.device)
    for s in range(splits):
        part = gathered[:, s * per_split : (s + 1) * per_split]
        sums[:, :, s] = part.sum(dim=(1, 2, 4))
    return sums.flatten()


def make_case(batch: int, context: int, device: str, seed: int = 0):
    """Pools holding the batch's pages (in a shuffled order, as a busy pool's are) and a table."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_row = context // PAGE
    total = batch * pages_per_row
    k = torch.randn(total, PAGE, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    v = torch.randn(total, PAGE, KV_HEADS, HEAD_DIM, generator=generator).to(torch.bfloat16)
    tables = torch.randperm(total, generator=generator).view(batch, pages_per_row).to(torch.int32)
    return k.to(device), v.to(device), tables.to(device)


def check() -> None:
    """Both layouts read exactly the pages of the table (small case, interpreter or GPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    k, v, tables = make_case(2, 4 * PAGE, device)
    expected = reference_sums(k, v, tables, 2)
    token_major = read_pages(k, v, tables, head_major=False, splits=2)
    head_major = read_pages(
        k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), tables, head_major=True, splits=2
    )
    torch.testing.assert_close(token_major, expected, rtol=1e-4, atol=1e-2)
    torch.testing.assert_close(head_major, expected, rtol=1e-4, atol=1e-2)
    print("both layouts read the table's pages: OK")


def time_case(batch: int, context: int, splits: int) -> tuple[float, float, float, float]:
    """(MB read, token-major µs, head-major µs, SDPA µs on contiguous KV) for one case."""
    from shoal.bench.timing import time_graph_ms

    k, v, tables = make_case(batch, context, "cuda")
    k_head, v_head = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
    token_ms = time_graph_ms(lambda: read_pages(k, v, tables, False, splits), replays_per_sample=20)
    head_ms = time_graph_ms(lambda: read_pages(k_head, v_head, tables, True, splits), replays_per_sample=20)
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(batch, KV_HEADS, context, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    sdpa_ms = time_graph_ms(lambda: sdpa(q, kc, vc, enable_gqa=True), replays_per_sample=20)
    megabytes = 2 * k.numel() * k.element_size() / 1e6
    return megabytes, token_ms * 1e3, head_ms * 1e3, sdpa_ms * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--splits", type=int, default=4)
    parser.add_argument("--check", action="store_true", help="only check both layouts' sums")
    args = parser.parse_args()
    check()
    if args.check:
        return
    header = ("batch", 5), ("keys", 6), ("MB", 7), ("token-major us", 15), ("head-major us", 14)
    print(" ".join(f"{name:>{width}}" for name, width in (*header, ("ratio", 6), ("SDPA us", 8))))
    for batch in args.batch:
        for context in args.context:
            megabytes, token_us, head_us, sdpa_us = time_case(batch, context, args.splits)
            print(
                f"{batch:>5} {context:>6} {megabytes:>7.1f} {token_us:>15.1f} {head_us:>14.1f} "
                f"{token_us / head_us:>6.3f} {sdpa_us:>8.1f}"
            )


if __name__ == "__main__":
    main()
