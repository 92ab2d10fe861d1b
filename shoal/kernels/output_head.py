"""The decode step's output heads at batch 1: one PDL launch with the weights loaded before the wait.

Every frame runs ten output heads (S2's restricted main head, 4,097 x 2,560, and nine codebook
heads, 4,096 x 2,560, all bf16: the logits are not quantized). On cuBLAS each took 8.2 µs at
batch 1 against a 4.9 µs read floor (21 MB at 4.3 TB/s; docs/performance.md run 82), and, being
launched without programmatic dependent launch, it drained the GPU before it and kept the
sampler after it from starting early.

Here each program owns `rows_per_program` rows of the weight and holds all K columns of them in
registers (16 rows x 2,560 columns over 256 threads: 160 values each). The weights are a constant
of the step, so every program loads its rows *before* `wait_for_inputs`: with all programs
resident at once (257 programs of 256 threads, two per SM) the whole head streams while the final
norm before it still runs, and after the wait only the activation row (5 KB) is read. That is the
design's limit too: a second activation row costs a dependent round trip to L2, so larger batches
keep cuBLAS (`DecodeStep`'s `head_kernel_max_rows`).

Arithmetic: fp32 products summed in fp32 (Triton's reduction order), rounded once to the output
dtype, which is what a bf16 `F.linear` does up to its summation order. K need not be a power of
two: the row is held as a power-of-two part and a tail (2,560 = 2,048 + 512).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.norm_rope import cast_rne, interpreting
from shoal.kernels.pdl import pdl_launch, wait_for_inputs

ROWS_PER_PROGRAM = 16
NUM_WARPS = 8


@triton.jit
def _head_kernel(
    x_ptr, w_ptr, out_ptr, n, k, stride_xm, stride_wn, stride_om,
    ROWS_X: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_K: tl.constexpr, TAIL_K: tl.constexpr,
    EMULATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program p: weight rows [p * BLOCK_N, ...) against every activation row. The row's columns
    are [0, HEAD_K) (HEAD_K a power of two <= k) and, with TAIL_K > 0, [HEAD_K, HEAD_K + TAIL_K)
    masked past k. The ROWS_X activation rows (unrolled: a
    compile per batch size) are read one ahead of their use."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < n
    head_cols = tl.arange(0, HEAD_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    w_head = tl.load(w_rows + head_cols[None, :], mask=row_ok[:, None], other=0.0)
    if TAIL_K > 0:
        tail_cols = HEAD_K + tl.arange(0, TAIL_K)
        tail_ok = tail_cols < k
        w_tail = tl.load(w_rows + tail_cols[None, :], mask=row_ok[:, None] & tail_ok[None, :], other=0.0)
    wait_for_inputs(USE_PDL)
    x_head = tl.load(x_ptr + head_cols)
    if TAIL_K > 0:
        x_tail = tl.load(x_ptr + tail_cols, mask=tail_ok, other=0.0)
    for m in tl.static_range(ROWS_X):
        if m + 1 < ROWS_X:  # the next row's load in flight during this row's sums
            next_head = tl.load(x_ptr + (m + 1) * stride_xm + head_cols)
            if TAIL_K > 0:
                next_tail = tl.load(x_ptr + (m + 1) * stride_xm + tail_cols, mask=tail_ok, other=0.0)
        else:
            next_head = x_head
            if TAIL_K > 0:
                next_tail = x_tail
        acc = tl.sum(w_head.to(tl.float32) * x_head.to(tl.float32)[None, :], 1)
        if TAIL_K > 0:
            acc += tl.sum(w_tail.to(tl.float32) * x_tail.to(tl.float32)[None, :], 1)
        logits = cast_rne(acc, out_ptr.dtype.element_ty, EMULATE)
        tl.store(out_ptr + m * stride_om + rows, logits, mask=row_ok)
        x_head = next_head
        if TAIL_K > 0:
            x_tail = next_tail


def _split_columns(k: int) -> tuple[int, int]:
    """(HEAD_K, TAIL_K): the largest power of two <= k, and the rest rounded up to a power of two
    (0 when k is one)."""
    head = 1 << (k.bit_length() - 1)
    return head, (triton.next_power_of_2(k - head) if k > head else 0)


def output_head(
    x: Tensor,
    weight: Tensor,
    rows: int | None = None,
    out: Tensor | None = None,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
) -> Tensor:
    """`F.linear(x, weight[:rows])` for x [M, K] and weight [N, K] (both with contiguous rows,
    the same dtype): logits [M, rows] in that dtype (`out`, if given, with contiguous rows). No
    allocation with `out`, no host sync: safe in a CUDA graph. Meant for M = 1 (see the module
    docstring); any M is computed correctly (one compile per M).

    Under PDL the weight is read before the wait for the previous kernel: no kernel of the same
    graph or chain may write it."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype != weight.dtype or x.device != weight.device:
        raise ValueError(f"x ({x.dtype}, {x.device}) and weight ({weight.dtype}, {weight.device}) must match")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("rows of x and the weight must be contiguous")
    rows = weight.shape[0] if rows is None else rows
    if not 0 <= rows <= weight.shape[0]:
        raise ValueError(f"rows must lie in [0, {weight.shape[0]}], got {rows}")
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program must be a power of two, got {rows_per_program}")
    m, k = x.shape
    if out is None:
        out = torch.empty(m, rows, dtype=x.dtype, device=x.device)
    elif out.shape != (m, rows) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {x.dtype} [{m}, {rows}] with contiguous rows")
    if m == 0 or rows == 0:
        return out
    if k == 0:
        return out.zero_()
    head_k, tail_k = _split_columns(k)
    _head_kernel[(triton.cdiv(rows, rows_per_program),)](
        x, weight, out, rows, k, x.stride(0), weight.stride(0), out.stride(0),
        ROWS_X=m, BLOCK_N=rows_per_program, HEAD_K=head_k, TAIL_K=tail_k, EMULATE=interpreting(),
        num_warps=num_warps, **pdl_launch("head"),
    )  # fmt: skip
    return out
