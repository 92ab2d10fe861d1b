"""The decode step's output heads at batch 1: one PDL launch with the weights loaded before the wait.

Every frame runs ten output heads (S2's restricted main head, 4,097 x 2,560, and nine codebook
heads, 4,096 x 2,560, all bf16: the logits are not quantized). On cuBLAS each took 8.2 µs at
batch 1 against a 4.9 µs read floor (21 MB at 4.3 TB/s; docs/performance.md run 82), and, being
launched without programmatic dependent launch, it drained the GPU before it and kept the
sampler after it from starting early.

Here each program owns `rows_per_program` rows of the weight and streams their K columns in
chunks of 512 (five at S2's 2,560). The weights are a constant of the step, so every program
loads its first `ahead` chunks *before* `wait_for_inputs`: with all programs resident at once
(257 programs of 256 threads, 115 registers each: two per SM) 40% of the head streams while the
final norm before it still runs; after the wait the activation row comes in chunk by chunk beside
the remaining weight chunks, `ahead` chunks in flight. Holding a program's whole rows in registers
instead (194 registers at 16 rows: one program per SM, two waves) made the head slower than
cuBLAS alone (11.1 against 9.9 µs, docs/performance.md run 87). Each activation row is its own
program column (`grid = (row blocks, M)`), so a batch re-reads the weight from L2 per row: the
engine uses the kernel at batch 1 only (`DecodeStep`'s `head_kernel_max_rows`).

Arithmetic: fp32 products summed in fp32 (per chunk in Triton's reduction order, chunks in
order), rounded once to the output dtype, which is what a bf16 `F.linear` does up to its
summation order.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.norm_rope import cast_rne, interpreting
from shoal.kernels.out_buffer import out_buffer
from shoal.kernels.pdl import pdl_launch, wait_for_inputs

ROWS_PER_PROGRAM = 16
NUM_WARPS = 8
CHUNK = 512  # K columns per load round: [16, 512] bf16 is 32 values per thread at 8 warps
AHEAD = 2  # chunks loaded before the PDL wait, and in flight after it


@triton.jit
def _weight_chunk(w_rows, row_ok, chunk, k, CHUNK: tl.constexpr):
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    return tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < k)[None, :], other=0.0)


@triton.jit
def _activation_chunk(x_row, chunk, k, CHUNK: tl.constexpr):
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    return tl.load(x_row + cols, mask=cols < k, other=0.0)


@triton.jit
def _head_kernel(
    x_ptr, w_ptr, out_ptr, n, k, stride_xm, stride_wn, stride_om,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, AHEAD: tl.constexpr,
    EMULATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (p, m): weight rows [p * BLOCK_N, ...) against activation row m, over K in CHUNKS
    chunks of CHUNK columns (masked past k). The first AHEAD chunks (1 or 2) load before the wait;
    afterwards chunk c + AHEAD loads while chunk c is summed, so at most AHEAD + 1 chunks are in
    registers."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    row_ok = rows < n
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    current = _weight_chunk(w_rows, row_ok, 0, k, CHUNK)
    if AHEAD > 1 and CHUNKS > 1:
        following = _weight_chunk(w_rows, row_ok, 1, k, CHUNK)
    else:
        following = current
    wait_for_inputs(USE_PDL)
    x_row = x_ptr + m * stride_xm
    x_current = _activation_chunk(x_row, 0, k, CHUNK)
    x_following = _activation_chunk(x_row, 1, k, CHUNK) if AHEAD > 1 and CHUNKS > 1 else x_current
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        if c + AHEAD < CHUNKS:  # the activation chunks roll along with the weight chunks
            upcoming = _weight_chunk(w_rows, row_ok, c + AHEAD, k, CHUNK)
            x_upcoming = _activation_chunk(x_row, c + AHEAD, k, CHUNK)
        else:
            upcoming = current
            x_upcoming = x_current
        acc += tl.sum(current.to(tl.float32) * x_current.to(tl.float32)[None, :], 1)
        if AHEAD > 1:
            current, following = following, upcoming
            x_current, x_following = x_following, x_upcoming
        else:
            current, x_current = upcoming, x_upcoming
    logits = cast_rne(acc, out_ptr.dtype.element_ty, EMULATE)
    tl.store(out_ptr + m * stride_om + rows, logits, mask=row_ok)


def output_head(
    x: Tensor,
    weight: Tensor,
    rows: int | None = None,
    out: Tensor | None = None,
    rows_per_program: int = ROWS_PER_PROGRAM,
    num_warps: int = NUM_WARPS,
    ahead: int = AHEAD,
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
    if ahead not in (1, 2):
        raise ValueError(f"ahead must be 1 or 2, got {ahead}")
    m, k = x.shape
    out = out_buffer(out, m, rows, x.dtype, x.device)
    if m == 0 or rows == 0:
        return out
    if k == 0:
        return out.zero_()
    chunk = min(CHUNK, triton.next_power_of_2(k))
    _head_kernel[(triton.cdiv(rows, rows_per_program), m)](
        x, weight, out, rows, k, x.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=rows_per_program, CHUNK=chunk, CHUNKS=triton.cdiv(k, chunk), AHEAD=ahead,
        EMULATE=interpreting(), num_warps=num_warps, **pdl_launch("head"),
    )  # fmt: skip
    return out
