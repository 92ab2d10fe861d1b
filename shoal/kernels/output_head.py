"""The decode step's output heads at batch 1: one PDL launch with the weights loaded before the wait.

Every frame runs ten output heads (S2's restricted main head, 4,097 x 2,560, and nine codebook
heads, 4,096 x 2,560, all bf16: the logits are not quantized). cuBLAS stays well above the read
floor at batch 1 and, launched without programmatic dependent launch, drains the GPU before it.

Here each program owns `rows_per_program` rows of the weight and streams their K columns in
chunks of 512. The weights are a constant of the step, so every program loads its first `ahead`
chunks before `wait_for_inputs`: with all programs resident at once (two per SM) a good part of
the head streams while the final norm before it still runs; after the wait the activation row
comes in chunk by chunk beside the remaining weight chunks. Each activation row is its own program
column (`grid = (row blocks, M)`), so a batch re-reads the weight from L2 per row: the engine uses
the kernel at batch 1 only (`Tuning.head_kernel_max_rows`).

Arithmetic: fp32 products summed in fp32 (per chunk in Triton's reduction order, chunks in order),
rounded once to the output dtype: a bf16 `F.linear` up to its summation order. An e4m3 weight with
power-of-two fp32 scales per 128 x 128 block (`scales`, `quant/fp8_head.py`'s rounded fast head)
halves the bytes: each activation column is multiplied by its block's scale (exact) before the
products, so the logits are those of the bf16 head holding the dequantized weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.norm_rope import cast_rne, interpreting
from shoal.kernels.out_buffer import out_buffer
from shoal.kernels.pdl import pdl_launch, wait_for_inputs

ROWS_PER_PROGRAM = 16
# An e4m3 weight's rows per program: 32 keeps a program's chunk at the bf16 chunk's 16 KB.
FP8_ROWS_PER_PROGRAM = 32
NUM_WARPS = 8
CHUNK = 512  # K columns per load round: [16, 512] bf16 is 32 values per thread at 8 warps
FP8_CHUNK = 512  # the same for an e4m3 weight (read at each call: `kernel:fp8_head_chunk`)
AHEAD = 2  # chunks loaded before the PDL wait, and in flight after it


@triton.jit
def _weight_chunk(w_rows, row_ok, chunk, k, CHUNK: tl.constexpr):
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    return tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & (cols < k)[None, :], other=0.0)


@triton.jit
def _activation_chunk(x_row, scale_row, chunk, k, CHUNK: tl.constexpr, SCALED: tl.constexpr):
    """The activation columns of `chunk`; with SCALED in fp32, each times its weight block's scale."""
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(x_row + cols, mask=cols < k, other=0.0)
    if SCALED:
        x = x.to(tl.float32) * tl.load(scale_row + cols // 128, mask=cols < k, other=0.0)
    return x


@triton.jit
def _head_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, n, k, stride_xm, stride_wn, stride_sn, stride_om,
    BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, CHUNKS: tl.constexpr, AHEAD: tl.constexpr,
    SCALED: tl.constexpr, EMULATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (p, m): weight rows [p * BLOCK_N, ...) against activation row m, over K in CHUNKS
    chunks of CHUNK columns (masked past k). The first AHEAD chunks (1 or 2) load before the wait;
    afterwards chunk c + AHEAD loads while chunk c is summed, so at most AHEAD + 1 chunks are in
    registers. SCALED: the rows' scales are row `p * BLOCK_N // 128` of `scale_ptr` (BLOCK_N
    divides 128)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1).to(tl.int64)
    row_ok = rows < n
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_wn
    scale_row = scale_ptr + (tl.program_id(0) * BLOCK_N // 128).to(tl.int64) * stride_sn
    current = _weight_chunk(w_rows, row_ok, 0, k, CHUNK)
    if AHEAD > 1 and CHUNKS > 1:
        following = _weight_chunk(w_rows, row_ok, 1, k, CHUNK)
    else:
        following = current
    wait_for_inputs(USE_PDL)
    x_row = x_ptr + m * stride_xm
    x_current = _activation_chunk(x_row, scale_row, 0, k, CHUNK, SCALED)
    if AHEAD > 1 and CHUNKS > 1:
        x_following = _activation_chunk(x_row, scale_row, 1, k, CHUNK, SCALED)
    else:
        x_following = x_current
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        if c + AHEAD < CHUNKS:  # the activation chunks roll along with the weight chunks
            upcoming = _weight_chunk(w_rows, row_ok, c + AHEAD, k, CHUNK)
            x_upcoming = _activation_chunk(x_row, scale_row, c + AHEAD, k, CHUNK, SCALED)
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
    x: Tensor, weight: Tensor, rows: int | None = None, out: Tensor | None = None,
    rows_per_program: int | None = None, num_warps: int = NUM_WARPS, ahead: int = AHEAD,
    scales: Tensor | None = None, chunk: int | None = None,
) -> Tensor:  # fmt: skip
    """`F.linear(x, weight[:rows])` for x [M, K] and weight [N, K] (both with contiguous rows,
    the same dtype): logits [M, rows] in that dtype (`out`, if given, with contiguous rows). No
    allocation with `out`, no host sync: safe in a CUDA graph. Meant for M = 1 (see the module
    docstring); any M is computed correctly (one compile per M). `rows_per_program` None reads
    `ROWS_PER_PROGRAM`, or `FP8_ROWS_PER_PROGRAM` with `scales`, at the call (`shoal bench ab`'s
    `kernel:head_rows_per_program`, `kernel:fp8_head_rows_per_program`).

    `scales` fp32 [ceil(N/128), ceil(K/128)] (block [n // 128, k // 128]): `weight` is e4m3 and
    the logits are those of its dequantized values (`q * scale`), in x's dtype.

    Under PDL the weight is read before the wait for the previous kernel: no kernel of the same
    graph or chain may write it."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    if rows_per_program is None:
        rows_per_program = ROWS_PER_PROGRAM if scales is None else FP8_ROWS_PER_PROGRAM
    if scales is not None:
        _check_scales(weight, scales, rows_per_program)
    elif x.dtype != weight.dtype:
        raise ValueError(f"x ({x.dtype}) and weight ({weight.dtype}) must match")
    if x.device != weight.device:
        raise ValueError(f"x ({x.device}) and weight ({weight.device}) must be on one device")
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
    chunk = chunk or (CHUNK if scales is None else FP8_CHUNK)
    chunk = min(chunk, triton.next_power_of_2(k))
    _head_kernel[(triton.cdiv(rows, rows_per_program), m)](
        x, weight, scales if scales is not None else x, out, rows, k, x.stride(0), weight.stride(0),
        scales.stride(0) if scales is not None else 0, out.stride(0),
        BLOCK_N=rows_per_program, CHUNK=chunk, CHUNKS=triton.cdiv(k, chunk), AHEAD=ahead,
        SCALED=scales is not None, EMULATE=interpreting(), num_warps=num_warps, **pdl_launch("head"),
    )  # fmt: skip
    return out


def _check_scales(weight: Tensor, scales: Tensor, rows_per_program: int) -> None:
    """An e4m3 weight's block scales as the kernel indexes them, on the weight's device."""
    n, k = weight.shape
    want = (-(-n // 128), -(-k // 128))
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"a weight with scales must be float8_e4m3fn, got {weight.dtype}")
    if scales.dtype != torch.float32 or tuple(scales.shape) != want or scales.stride(1) != 1:
        got = f"{scales.dtype} {list(scales.shape)}"
        raise ValueError(f"scales must be float32 {list(want)} with contiguous rows, got {got}")
    if scales.device != weight.device:
        raise ValueError("scales must be on the weight's device")
    if 128 % rows_per_program:
        raise ValueError(f"with scales, rows_per_program must divide 128, got {rows_per_program}")
