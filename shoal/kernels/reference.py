"""Plain-torch versions of the FP8 kernels: the CPU path and the oracle the kernels are tested against.

(The attention, norm, RoPE and window references are test oracles: `tests/kernel_references.py`;
the sampling kernel's is `models.sampling.sample_reference`.) Layouts:

- weights: e4m3 [N, K] (nn.Linear layout) with fp32 scales [ceil(N/128), ceil(K/128)], one per
  128x128 block, row-major contiguous: `scale[n // 128, k // 128]`;
- activations: e4m3 [M, K] with fp32 scales [M, ceil(K/128)], one per token per 128 columns;
- FP8 KV cache: e4m3 keys/values [..., Hkv, D] with fp32 scales [..., Hkv], one per (token, kv
  head): amax / 448 of the bf16 vector the cache would hold otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
FP8_MAX = 448.0
MIN_SCALE = 1e-12
MIN_POW2_EXPONENT = -100


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(x, (0, cols - x.shape[1], 0, rows - x.shape[0]))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _quantize_last_dim(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., L] -> (e4m3 [..., L], fp32 [...]): one scale per last-dim vector, amax / 448,
    values divided (IEEE, round to nearest) and rounded to e4m3 (ties to even)."""
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(MIN_SCALE)
    q = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, K] -> (e4m3 [M, K], fp32 [M, ceil(K/128)]): amax / 448 per token per 128 columns."""
    m, k = x.shape
    groups = _cdiv(k, BLOCK)
    q, scale = _quantize_last_dim(_pad_to(x.float(), m, groups * BLOCK).view(m, groups, BLOCK))
    return q.view(m, groups * BLOCK)[:, :k].contiguous(), scale


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate | up) -> silu(gate) * up in fp32, the formula the fused kernel uses."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return gate / (1.0 + torch.exp(-gate)) * up


def swiglu_quantize(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(gate) * up, quantized like `quantize_activations` (no bf16 rounding in between)."""
    return quantize_activations(swiglu(gate_up))


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_activations`, in fp32."""
    m, k = q.shape
    expanded = scale.repeat_interleave(BLOCK, dim=1)[:, :k]
    return q.float() * expanded


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (e4m3 [..., D], fp32 [...]): one scale per vector (a token's kv head), the
    same rule as an activation group's."""
    return _quantize_last_dim(x.float())


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_kv`: q * scale in fp32, then cast to `dtype`."""
    return (q.float() * scale[..., None].float()).to(dtype)


def _power_of_two_scales(amax: torch.Tensor) -> torch.Tensor:
    """The smallest 2^e >= amax / 448 with e >= MIN_POW2_EXPONENT (every code times it then a
    normal fp32 and bf16 number), 1 where amax is 0."""
    exponent = torch.ceil(torch.log2(amax / FP8_MAX)).clamp_min(MIN_POW2_EXPONENT)
    scale = torch.where(amax > 0, torch.exp2(exponent), torch.ones_like(amax))
    # log2 of a ratio can land a hair below an exact power of two: make sure nothing overflows 448
    return torch.where(amax / scale > FP8_MAX, scale * 2, scale)


def quantize_weight(w: torch.Tensor, power_of_two_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (e4m3 [N, K], fp32 [ceil(N/128), ceil(K/128)]): amax / 448 per 128x128 block, or
    with `power_of_two_scales` the smallest power of two at least that (`_power_of_two_scales`:
    code times scale is then exact in bf16, and quantizing the dequantized weight again returns the
    same codes and scales)."""
    n, k = w.shape
    bn, bk = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    blocks = _pad_to(w.float(), bn * BLOCK, bk * BLOCK).view(bn, BLOCK, bk, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = _power_of_two_scales(amax) if power_of_two_scales else (amax / FP8_MAX).clamp_min(MIN_SCALE)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(bn * BLOCK, bk * BLOCK)[:n, :k].contiguous(), scale.contiguous()


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize_weight`, in fp32: q[n, k] * scale[n // 128, k // 128]."""
    n, k = q.shape
    expanded = scale.repeat_interleave(BLOCK, dim=0)[:n].repeat_interleave(BLOCK, dim=1)[:, :k]
    return q.float() * expanded


def fp8_gemm(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # fmt: skip
    """W8A8: dequant(x) @ dequant(w).T in fp32, rounded once to `out_dtype`. [M, K] x [N, K] -> [M, N]."""
    return (dequantize_activations(x_q, x_scale) @ dequantize_weight(w_q, w_scale).t()).to(out_dtype)


def fp8_weight_gemm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """W8A16: x (kept as given, bf16) @ dequant(w).T in fp32, rounded once to `out_dtype`."""
    return (x.float() @ dequantize_weight(w_q, w_scale).t()).to(out_dtype)


def fp8_linear(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, quantize_input: bool,
    swiglu_input: bool = False, out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:  # fmt: skip
    """What `kernels.fp8_gemm.fp8_linear` computes, for any mode: optional SwiGLU on the input
    (x is then gate | up), optional per-token activation quantization, then the block-scaled GEMM."""
    a = swiglu(x) if swiglu_input else x.float()
    if quantize_input:
        return fp8_gemm(*quantize_activations(a), w_q, w_scale, out_dtype)
    if swiglu_input:  # the kernel feeds the SwiGLU product to the tensor cores as bf16
        a = a.to(torch.bfloat16)
    return fp8_weight_gemm(a, w_q, w_scale, out_dtype)
