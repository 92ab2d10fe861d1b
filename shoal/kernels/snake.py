"""Snake activation fused with the bias and residual add that precede it, for the codec.

The codec's decoder is bound by element-wise memory traffic at high time resolution: the
reference spends five passes per Snake (mul, sin, pow, reciprocal-mul, add), one more per
residual add and one per conv bias. `snake(x, alpha, residual, bias)` does
`s = x + residual + bias; y = s + sin^2(alpha s) / alpha` in one pass on the GPU (Triton),
computed in fp32, reading x and residual once and writing s (only when asked) and y once.

Layouts: channels first `[B, C, T]` (the full decode) or time-major `[B, T, C]`
(`channels_last=True`, the streaming decode, whose convolutions run channels-last). Inputs may
be any strided view (e.g. a time slice of a transposed conv's output); outputs are contiguous.

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
    channels_last: bool = False, need_sum: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Fused on CUDA, the torch reference elsewhere. Returns (sum, activation); with
    `need_sum=False` the fused path skips writing the sum and returns x in its place."""
    if x.is_cuda and _use_triton(x) and x.dim() == 3:
        return snake_triton(x, alpha, residual, bias, channels_last, need_sum)
    return snake_reference(x, alpha, residual, bias, channels_last)


if triton is not None:

    def _snake_kernel(
        x_ptr, res_ptr, alpha_ptr, bias_ptr, sum_ptr, out_ptr,
        rows, inner, cols,
        xs0, xs1, xs2, rs0, rs1, rs2,
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
        out_off = r.to(tl.int64)[:, None] * cols + c64[None, :]
        if WRITE_SUM:
            tl.store(sum_ptr + out_off, s.to(sum_ptr.dtype.element_ty), mask=mask)
        sine = tl.sin(alpha * s)
        y = s + sine * sine / (alpha + 1e-9)
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jitted_kernel():
    """JIT on first use, so TRITON_INTERPRET set by a test before that first call takes effect."""
    return triton.jit(_snake_kernel)


def snake_triton(
    x: Tensor, alpha: Tensor, residual: Tensor | None = None, bias: Tensor | None = None,
    channels_last: bool = False, need_sum: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The Triton path for x [B, C, T] (or [B, T, C] with channels_last), any strides."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    batch, inner, cols = x.shape
    out = torch.empty((batch, inner, cols), dtype=x.dtype, device=x.device)
    write_sum = need_sum and (residual is not None or bias is not None)
    total = torch.empty_like(out) if write_sum else x
    if out.numel() == 0:
        return total, out
    if channels_last:  # cols = channels (96 .. 1536): a few hundred time steps per program
        block_cols = min(triton.next_power_of_2(cols), 256)
        block_rows = max(1, 4096 // block_cols)
    else:  # cols = time
        block_cols = min(triton.next_power_of_2(cols), 1024)
        block_rows = max(1, 2048 // block_cols)
    rows = batch * inner
    res = residual if residual is not None else x
    grid = (triton.cdiv(rows, block_rows), triton.cdiv(cols, block_cols))
    _jitted_kernel()[grid](
        x, res, alpha.reshape(-1), bias if bias is not None else alpha, total, out,
        rows, inner, cols, *x.stride(), *res.stride(),
        CHANNELS_LAST=channels_last, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        WRITE_SUM=write_sum, ROWS=block_rows, COLS=block_cols,
    )  # fmt: skip
    return total, out
