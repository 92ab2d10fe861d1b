"""Snake activation fused with the bias and residual add that precede it, for the codec.

The codec's decoder is bound by element-wise memory traffic at high time resolution: the
reference spends five passes per Snake (mul, sin, pow, reciprocal-mul, add), one more per
residual add and one per conv bias. `snake(x, alpha, residual, bias)` does
`s = x + residual + bias; y = s + sin^2(alpha s) / alpha` in one pass on the GPU (Triton),
computed in fp32, reading x and residual once and writing s (only when asked) and y once.

Layouts: channels first `[B, C, T]` (the full decode) or time-major `[B, T, C]`
(`channels_last=True`, the streaming decode, whose convolutions run channels-last). Inputs may
be any strided view (e.g. a time slice of a transposed conv's output); the sum is contiguous,
and the activation too unless `out` gives it a place: a view with unit last stride, e.g. the
rows after a causal conv's carried context in the buffer the conv reads (`StepContext`), which
saves the streaming decode a concatenation per conv.

On the CPU (and as the test oracle) the torch form below is used; it is the reference
arithmetic exactly: `x + (alpha + 1e-9).reciprocal() * sin(alpha * x).pow(2)`.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CPU wheel normally ships triton
    triton = None


def snake_reference(
    x: Tensor, alpha: Tensor, residual: Tensor | None = None, bias: Tensor | None = None,
    channels_last: bool = False,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(x + residual + bias, snake of that) in plain torch; alpha and bias hold one value per channel."""
    shape = (1, 1, -1) if channels_last else (1, -1, 1)
    if residual is not None:
        x = x + residual
    if bias is not None:
        x = x + bias.reshape(shape)
    alpha = alpha.reshape(shape)
    return x, x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def _use_triton(x: Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def snake(
    x: Tensor, alpha: Tensor, residual: Tensor | None = None, bias: Tensor | None = None,
    channels_last: bool = False, need_sum: bool = True, out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Fused on CUDA, the torch reference elsewhere. Returns (sum, activation); with
    `need_sum=False` the fused path skips writing the sum and returns x in its place. With `out`
    the activation is written there (and `out` returned)."""
    if x.is_cuda and _use_triton(x) and x.dim() == 3:
        return snake_triton(x, alpha, residual, bias, channels_last, need_sum, out)
    total, activation = snake_reference(x, alpha, residual, bias, channels_last)
    if out is None:
        return total, activation
    return total, out.copy_(activation)


if triton is not None:

    def _snake_kernel(
    x_ptr, res_ptr, alpha_ptr, bias_ptr, sum_ptr, out_ptr, rows, inner, cols,
    xs0, xs1, xs2, rs0, rs1, rs2, os0, os1,
    CHANNELS_LAST: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
    WRITE_SUM: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
    ):  # fmt: skip
        # Logical [B, D1, D2] as rows (B * D1) x cols (D2); the output is contiguous in that order.
        r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        c = tl.program_id(1) * COLS + tl.arange(0, COLS)
        rmask, cmask = r < rows, c < cols
        mask = rmask[:, None] & cmask[None, :]
        i0, i1 = (r // inner).to(tl.int64), (r % inner).to(tl.int64)
        c64 = c.to(tl.int64)
        if CHANNELS_LAST:  # channel = column
            alpha = tl.load(alpha_ptr + c, mask=cmask, other=1.0).to(tl.float32)[None, :]
        else:  # channel = row % channels
            alpha = tl.load(alpha_ptr + r % inner, mask=rmask, other=1.0).to(tl.float32)[:, None]
        x_off = (i0 * xs0 + i1 * xs1)[:, None] + (c64 * xs2)[None, :]
        s = tl.load(x_ptr + x_off, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r_off = (i0 * rs0 + i1 * rs1)[:, None] + (c64 * rs2)[None, :]
            s += tl.load(res_ptr + r_off, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            if CHANNELS_LAST:
                s += tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)[None, :]
            else:
                s += tl.load(bias_ptr + r % inner, mask=rmask, other=0.0).to(tl.float32)[:, None]
        if WRITE_SUM:  # contiguous
            sum_off = r.to(tl.int64)[:, None] * cols + c64[None, :]
            tl.store(sum_ptr + sum_off, s.to(sum_ptr.dtype.element_ty), mask=mask)
        sine = tl.sin(alpha * s)
        y = s + sine * sine / (alpha + 1e-9)
        out_off = (i0 * os0 + i1 * os1)[:, None] + c64[None, :]
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)

    def _snake_flat_kernel(
    x_ptr, res_ptr, alpha_ptr, bias_ptr, sum_ptr, out_ptr, per_batch, channels, xs0, rs0, os0,
    HAS_RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_SUM: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # Time-major tensors whose [T, C] block per batch row is contiguous, as flat runs of
        # `per_batch` elements: no lanes padded up to a power-of-two channel count (C = 96
        # wastes a quarter of a 128-wide tile), whole 16-byte vectors. Same arithmetic, same bits.
        b = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < per_batch
        channel = offs % channels
        alpha = tl.load(alpha_ptr + channel, mask=mask, other=1.0).to(tl.float32)
        s = tl.load(x_ptr + b * xs0 + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_ptr + b * rs0 + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(bias_ptr + channel, mask=mask, other=0.0).to(tl.float32)
        if WRITE_SUM:  # contiguous
            tl.store(sum_ptr + b * per_batch + offs, s.to(sum_ptr.dtype.element_ty), mask=mask)
        sine = tl.sin(alpha * s)
        y = s + sine * sine / (alpha + 1e-9)
        tl.store(out_ptr + b * os0 + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jitted_kernel():
    """JIT on first use, so TRITON_INTERPRET set by a test before that first call takes effect."""
    return triton.jit(_snake_kernel)


@functools.cache
def _jitted_flat_kernel():
    return triton.jit(_snake_flat_kernel)


FLAT_BLOCK = 2048  # elements per program of the flat kernel


def _rows_contiguous(t: Tensor, cols: int) -> bool:
    """Whether each batch row of [B, T, C] is one contiguous run of T * C elements."""
    return t.stride(2) == 1 and (t.stride(1) == cols or t.shape[1] == 1)


def snake_triton(
    x: Tensor, alpha: Tensor, residual: Tensor | None = None, bias: Tensor | None = None,
    channels_last: bool = False, need_sum: bool = True, out: Tensor | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The Triton path for x [B, C, T] (or [B, T, C] with channels_last), any strides; `out`,
    if given, any view of that shape with unit last stride."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    batch, inner, cols = x.shape
    if out is None:
        out = torch.empty((batch, inner, cols), dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (batch, inner, cols) or (out.numel() and out.stride(2) != 1):
        raise ValueError(f"out must be a [{batch}, {inner}, {cols}] view with unit last stride")
    write_sum = need_sum and (residual is not None or bias is not None)
    total = torch.empty((batch, inner, cols), dtype=x.dtype, device=x.device) if write_sum else x
    if out.numel() == 0:
        return total, out
    res = residual if residual is not None else x
    if channels_last and all(_rows_contiguous(t, cols) for t in (x, res, out)):
        per_batch = inner * cols
        _jitted_flat_kernel()[(batch, triton.cdiv(per_batch, FLAT_BLOCK))](
            x, res, alpha.reshape(-1), bias if bias is not None else alpha, total, out,
            per_batch, cols, x.stride(0), res.stride(0), out.stride(0),
            HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None, WRITE_SUM=write_sum,
            BLOCK=FLAT_BLOCK,
        )  # fmt: skip
        return total, out
    if channels_last:  # cols = channels (96 .. 1536): a few hundred time steps per program
        block_cols = min(triton.next_power_of_2(cols), 256)
        block_rows = max(1, 4096 // block_cols)
    else:  # cols = time
        block_cols = min(triton.next_power_of_2(cols), 1024)
        block_rows = max(1, 2048 // block_cols)
    rows = batch * inner
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))
    _jitted_kernel()[grid](
        x, res, alpha.reshape(-1), bias if bias is not None else alpha, total, out,
        rows, inner, cols, *x.stride(), *res.stride(), out.stride(0), out.stride(1),
        CHANNELS_LAST=channels_last, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        WRITE_SUM=write_sum, ROWS=block_rows, COLS=block_cols,
    )  # fmt: skip
    return total, out
