"""MXFP8 (OCP Microscaling): e4m3 elements in blocks of 32 along K, one UE8M0 shared exponent each.

Blackwell's tensor cores read this format natively (`tcgen05.mma ... block_scale`); the H200 has no
such instruction, so here the format is quantized offline and validated numerically by emulation:
dequantize in fp32 and multiply. Layouts: values e4m3 [rows, K]; exponents uint8 [rows, ceil(K/32)],
byte = unbiased exponent + 127 (255 is NaN in the spec and never written here).

Scale choice: the smallest power of two with amax / scale <= 448 (NVIDIA's round-up recipe), so no
element saturates; the OCP spec's floor(log2(amax)) - 8 variant can clip up to 12.5% of the top
binade. Weights and activations use the same 1x32 blocking (K-major for both GEMM operands).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

BLOCK = 32
FP8_MAX = 448.0
EXPONENT_BIAS = 127
MIN_EXPONENT = -127  # UE8M0 byte 0 = 2**-127


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """[rows, K] float -> (e4m3 [rows, K], uint8 UE8M0 exponents [rows, ceil(K/32)])."""
    rows, k = x.shape
    blocks = _cdiv(k, BLOCK)
    xb = F.pad(x.float(), (0, blocks * BLOCK - k)).view(rows, blocks, BLOCK)
    amax = xb.abs().amax(dim=2)
    exponent = torch.ceil(torch.log2(amax / FP8_MAX)).clamp(MIN_EXPONENT, 127)
    exponent = torch.where(amax > 0, exponent, torch.full_like(exponent, MIN_EXPONENT))
    scale = torch.exp2(exponent)
    q = (xb / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    codes = (exponent + EXPONENT_BIAS).to(torch.uint8)
    return q.view(rows, blocks * BLOCK)[:, :k].contiguous(), codes


def scales(codes: Tensor) -> Tensor:
    """UE8M0 bytes -> fp32 powers of two."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"MXFP8 exponents must be uint8, got {codes.dtype}")
    if (codes == 255).any():
        raise ValueError("MXFP8 exponent byte 255 (NaN) in a scale tensor")
    return torch.exp2(codes.float() - EXPONENT_BIAS)


def dequantize(q: Tensor, codes: Tensor) -> Tensor:
    """Inverse of `quantize`, in fp32."""
    rows, k = q.shape
    if tuple(codes.shape) != (rows, _cdiv(k, BLOCK)):
        raise ValueError(f"exponents must be [{rows}, {_cdiv(k, BLOCK)}], got {list(codes.shape)}")
    return q.float() * scales(codes).repeat_interleave(BLOCK, dim=1)[:, :k]


def emulated_gemm(
    x_q: Tensor, x_codes: Tensor, w_q: Tensor, w_codes: Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    """What an MXFP8 tensor-core GEMM computes: [M, K] x [N, K] -> [M, N], fp32 accumulation.

    Products of e4m3 values times powers of two are exact in fp32, so this matches the hardware up
    to the order of fp32 accumulation."""
    return (dequantize(x_q, x_codes) @ dequantize(w_q, w_codes).t()).to(out_dtype)


def linear(x: Tensor, w_q: Tensor, w_codes: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [M, K] float: quantize activations to MXFP8 and multiply (the full W8A8 MX path)."""
    return emulated_gemm(*quantize(x), w_q, w_codes, out_dtype or x.dtype)
