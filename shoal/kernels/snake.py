"""Snake activation fused with the residual add that precedes it, for the codec.

The codec's decoder is bound by element-wise memory traffic at high time resolution: the
reference spends five passes per Snake (mul, sin, pow, reciprocal-mul, add) and one more per
residual add. `snake(x, alpha, residual)` does `s = x + residual; y = s + sin^2(alpha s)/alpha`
in one pass on the GPU (Triton), reading x and residual once and writing s and y once.

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


def snake_reference(x: Tensor, alpha: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(x + residual, snake(x + residual)) in plain torch; alpha is [1, C, 1]."""
    if residual is not None:
        x = x + residual
    return x, x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


def _use_triton(x: Tensor) -> bool:
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def snake(x: Tensor, alpha: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Fused on CUDA, the torch reference elsewhere. Returns (sum, activation)."""
    if x.is_cuda and _use_triton(x) and _rows_strided(x) and (residual is None or _rows_strided(residual)):
        return snake_triton(x, alpha, residual)
    return snake_reference(x, alpha, residual)


def _rows_strided(t: Tensor) -> bool:
    """[B, C, T] whose (b, c) rows are equally spaced with unit stride in time (slices in T ok)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(0) == t.shape[1] * t.stride(1)


if triton is not None:

    def _snake_kernel(
        x_ptr, res_ptr, alpha_ptr, sum_ptr, out_ptr,
        numel, length, channels, x_row_stride, res_row_stride,
        HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        row = offsets // length
        col = offsets - row * length
        alpha = tl.load(alpha_ptr + row % channels, mask=mask, other=1.0).to(tl.float32)
        s = tl.load(x_ptr + row * x_row_stride + col, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_ptr + row * res_row_stride + col, mask=mask, other=0.0).to(tl.float32)
            tl.store(sum_ptr + offsets, s.to(sum_ptr.dtype.element_ty), mask=mask)
        sine = tl.sin(alpha * s)
        y = s + sine * sine / (alpha + 1e-9)
        tl.store(out_ptr + offsets, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _jitted_kernel():
    """JIT on first use, so TRITON_INTERPRET set by a test before that first call takes effect."""
    return triton.jit(_snake_kernel)


def snake_triton(x: Tensor, alpha: Tensor, residual: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The Triton path for x [B, C, T] (rows may be a slice in T); outputs are contiguous."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    batch, channels, length = x.shape
    if not _rows_strided(x):
        x = x.contiguous()
    if residual is not None and not _rows_strided(residual):
        residual = residual.contiguous()
    out = torch.empty((batch, channels, length), dtype=x.dtype, device=x.device)
    total = torch.empty_like(out) if residual is not None else x
    numel = out.numel()
    if numel == 0:
        return total, out
    block = 1024
    _jitted_kernel()[(triton.cdiv(numel, block),)](
        x, residual if residual is not None else x, alpha.reshape(-1).contiguous(), total, out,
        numel, length, channels, x.stride(1), residual.stride(1) if residual is not None else 0,
        HAS_RESIDUAL=residual is not None, BLOCK=block,
    )  # fmt: skip
    return total, out
