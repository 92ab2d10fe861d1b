"""Activation quantization for the FP8 GEMM: per token, per 128 columns, e4m3 with fp32 scales.

One launch reads a bf16 activation row once and writes both the e4m3 values and the scales, in the
layout the GEMM (and `torch._scaled_mm`) reads: scales of shape [M, K/128] stored
outer-dimension-major (strides (1, M)), so one 128-column group of all tokens is contiguous.

`swiglu_quantize` fuses the MLP's SwiGLU into the down-projection's activation quantization:
it reads the gate+up projection output [M, 2*I] (gate columns first, then up), computes
silu(gate) * up in fp32 registers and writes only the quantized product, so the bf16
intermediate [M, I] never touches memory.

Numerics (shared with `kernels/reference.py`, bit for bit): scale = max(amax / 448, 1e-12) in fp32,
q = round_to_nearest_even(x / scale) saturated to +-448, division correctly rounded.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.pdl import pdl_launch, wait_for_inputs

GROUP = 128
FP8_MAX = 448.0
MIN_SCALE = 1e-12
# Under Triton's CPU interpreter the fp32 -> e4m3 cast mis-rounds values just below a power of
# two, so the kernels round on the bits there (fixed when this module is imported). On the GPU the
# cast rounds in one instruction (the bit rounding gives the same codes with more instructions).
_ROUND_E4M3_ON_BITS = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


def new_activation_scales(m: int, k: int, device: torch.device | str) -> torch.Tensor:
    """An fp32 [m, ceil(k/128)] scale buffer stored group-major (strides (1, m))."""
    groups = triton.cdiv(k, GROUP)
    return torch.empty(groups, m, dtype=torch.float32, device=device).t()


def check_activation_scales(scales: torch.Tensor, m: int, k: int) -> None:
    """Raise if `scales` is not the fp32 [m, ceil(k/128)] group-major buffer the kernels expect."""
    groups = triton.cdiv(k, GROUP)
    if scales.dtype != torch.float32 or tuple(scales.shape) != (m, groups):
        raise ValueError(
            f"activation scales must be float32 [{m}, {groups}], got {scales.dtype} {scales.shape}"
        )
    if m > 1 and scales.stride() != (1, m):
        raise ValueError(f"activation scales must be group-major (strides (1, {m})), got {scales.stride()}")


def check_kv_scales(
    k_pages: Tensor, v_pages: Tensor, k_scales: Tensor | None, v_scales: Tensor | None
) -> bool:
    """True for an e4m3 KV cache, which comes with fp32 scales [num_pages, page_size, Hkv], all
    contiguous (the kernels find a vector's scale at its element offset // head_dim); False for a
    cache in a float dtype, which comes with none. Raises on any other mix."""
    if k_pages.dtype != v_pages.dtype:
        raise ValueError(f"k_pages ({k_pages.dtype}) and v_pages ({v_pages.dtype}) must have the same dtype")
    if k_pages.dtype != torch.float8_e4m3fn:
        if k_pages.element_size() == 1:
            raise ValueError(f"the only 8-bit KV cache dtype is torch.float8_e4m3fn, got {k_pages.dtype}")
        if k_scales is not None or v_scales is not None:
            raise ValueError(f"k_scales/v_scales are for float8_e4m3fn KV pages only, not {k_pages.dtype}")
        return False
    expected = tuple(k_pages.shape[:3])
    if k_scales is None or v_scales is None:
        raise ValueError(f"float8_e4m3fn KV pages need k_scales and v_scales (float32 {list(expected)})")
    if not (k_pages.is_contiguous() and v_pages.is_contiguous()):
        raise ValueError("float8_e4m3fn KV pages must be contiguous [num_pages, page_size, Hkv, head_dim]")
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if scales.dtype != torch.float32 or tuple(scales.shape) != expected or not scales.is_contiguous():
            raise ValueError(
                f"{name} must be contiguous float32 {list(expected)} (one per page slot and kv head), "
                f"got {scales.dtype} {list(scales.shape)} strides {scales.stride()}"
            )
        if scales.device != k_pages.device:
            raise ValueError(f"{name} is on {scales.device}, the KV pages on {k_pages.device}")
    return True


@triton.jit
def _round_to_e4m3_grid(x):
    """Round fp32 to the nearest e4m3 value, ties to even, in plain fp32/int arithmetic.

    The cast that follows is then exact. The interpreter needs it (its fp8 conversion mis-rounds
    values just below a power of two); on the GPU it gives the codes `cvt.rn.satfinite.e4m3x2.f32`
    gives, in about a dozen instructions per value instead of half of one."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    ulp_exponent = tl.maximum(exponent, -6) - 3  # 3 mantissa bits; subnormals below 2**-6
    ulp = ((ulp_exponent + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0  # 1.5 * 2**23 ulps: adding it forces rounding to a multiple of ulp
    rounded = (x + magic) - magic
    # A value that rounds to zero keeps its sign (-0.0), as the hardware conversion does.
    sign = (bits >> 31) << 31
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(x):
    """fp32 -> bf16, round to nearest even, done on the bits so that the result does not depend on
    the backend's conversion (Triton's CPU interpreter truncates). NaN stays NaN."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 == 0xFFFF0000
    exact = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))
    return exact.to(tl.bfloat16)


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in fp32, written once so every kernel applying SwiGLU gets the same bits."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def quantize_by(x, scale, fp8_max: tl.constexpr):
    """e4m3 of fp32 x / scale (scale broadcast against x): IEEE division rounded to nearest,
    saturated to +-fp8_max, rounded to the e4m3 grid (ties to even). On the GPU the cast itself
    rounds (`cvt.rn.satfinite.e4m3x2.f32`, one instruction per two values); the interpreter
    rounds on the bits first (`_round_to_e4m3_grid`), after which its cast is exact."""
    q = tl.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -fp8_max), fp8_max)
    if _ROUND_E4M3_ON_BITS:
        q = _round_to_e4m3_grid(q)
    return q.to(tl.float8e4nv, fp_downcast_rounding="rtne")


@triton.jit
def scale_from_amax(amax, fp8_max: tl.constexpr, min_scale: tl.constexpr):
    """The fp32 scale of a group (activations) or a vector (an FP8 KV cache's) from its amax."""
    return tl.maximum(amax / fp8_max, min_scale)


@triton.jit
def _quantize_groups(x, fp8_max: tl.constexpr, min_scale: tl.constexpr):
    """x: fp32 [G, 128] (masked-out lanes zero) -> (e4m3 [G, 128], fp32 scales [G])."""
    scale = scale_from_amax(tl.max(tl.abs(x), axis=1), fp8_max, min_scale)
    return quantize_by(x, scale[:, None], fp8_max), scale


@triton.jit
def _quantize_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg, GROUPS_PER_PROGRAM: tl.constexpr,
    SWIGLU: tl.constexpr, GROUP_SIZE: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr,
    PADDED: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, slice of GROUPS_PER_PROGRAM groups). PADDED: the grid has rows past the M
    rows of x, which quantize zeros (zero codes, the minimum scale)."""
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0)
    group0 = tl.program_id(1) * GROUPS_PER_PROGRAM
    groups = group0 + tl.arange(0, GROUPS_PER_PROGRAM)
    cols = groups[:, None] * GROUP_SIZE + tl.arange(0, GROUP_SIZE)[None, :]
    mask = cols < K
    stored = mask
    if PADDED:
        mask = mask & (row < M)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    if SWIGLU:
        gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_row + K + cols, mask=mask, other=0.0).to(tl.float32)
        x = silu_times(gate, up)
    else:
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_groups(x, FP8_MAX_, MIN_SCALE_)
    tl.store(q_ptr + row.to(tl.int64) * stride_qm + cols, q, mask=stored)
    group_count = tl.cdiv(K, GROUP_SIZE)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < group_count)


# 128-column groups per program of the quantization launch: 4 (512 columns, 4 elements per thread)
# at decode sizes, where a row's few programs start at once; 8 from more rows than any decode
# batch on (prefill), where small programs get scheduled rather than streamed. The bits do not
# depend on it.
GROUPS_PER_PROGRAM = 4
WIDE_GROUPS_PER_PROGRAM = 8
# More rows than any decode batch (`EngineConfig.graph_max_batch` <= 256): prefill. The row kernels
# take their prefill builds from here on (this one's wide programs, `norm_rope`'s block write).
PREFILL_FROM_ROWS = 257


def groups_per_program_for(rows: int) -> int:
    return GROUPS_PER_PROGRAM if rows < PREFILL_FROM_ROWS else WIDE_GROUPS_PER_PROGRAM


def _launch(
    x: torch.Tensor, k: int, swiglu: bool, out: torch.Tensor | None, scales: torch.Tensor | None,
    groups_per_program: int | None, num_warps: int, pad_rows_to: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("activations must be a 2-D tensor with unit column stride")
    m = x.shape[0]
    rows = triton.cdiv(m, pad_rows_to) * pad_rows_to
    if groups_per_program is None:
        groups_per_program = groups_per_program_for(m)
    if out is None:
        out = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    if scales is None:
        scales = new_activation_scales(rows, k, x.device)
    if out.dtype != torch.float8_e4m3fn or tuple(out.shape) != (rows, k) or out.stride(1) != 1:
        raise ValueError(f"out must be float8_e4m3fn [{rows}, {k}] with unit column stride")
    check_activation_scales(scales, rows, k)
    if rows == 0:
        return out, scales
    groups = triton.cdiv(k, GROUP)
    grid = (rows, triton.cdiv(groups, groups_per_program))
    _quantize_kernel[grid](
        x, out, scales, m, k, x.stride(0), out.stride(0), scales.stride(0), scales.stride(1),
        GROUPS_PER_PROGRAM=groups_per_program, SWIGLU=swiglu, GROUP_SIZE=GROUP, FP8_MAX_=FP8_MAX,
        MIN_SCALE_=MIN_SCALE, PADDED=rows != m, num_warps=num_warps, **pdl_launch(),
    )  # fmt: skip
    return out, scales


def quantize_activations(
    x: torch.Tensor, out: torch.Tensor | None = None, scales: torch.Tensor | None = None,
    groups_per_program: int | None = None, num_warps: int = 4, pad_rows_to: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """x bf16/fp32 [M, K] -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)] group-major), one launch.

    Pass `out` and `scales` (from `new_activation_scales`) to allocate nothing (CUDA graphs).
    `groups_per_program` None: `groups_per_program_for(M)`. `pad_rows_to`: the outputs have M
    rounded up to a multiple of it, the rows past M quantized zeros (what block-wise
    `torch._scaled_mm` wants, without a padded copy of x)."""
    return _launch(x, x.shape[-1], False, out, scales, groups_per_program, num_warps, pad_rows_to)


def swiglu_quantize(
    gate_up: torch.Tensor, out: torch.Tensor | None = None, scales: torch.Tensor | None = None,
    groups_per_program: int | None = None, num_warps: int = 4, pad_rows_to: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """gate_up [M, 2*I] (gate | up) -> quantized silu(gate) * up: (e4m3 [M, I], scales [M, I/128]);
    `pad_rows_to` as `quantize_activations`'."""
    if gate_up.shape[-1] % 2:
        raise ValueError("gate_up must have an even number of columns (gate | up)")
    return _launch(
        gate_up, gate_up.shape[-1] // 2, True, out, scales, groups_per_program, num_warps, pad_rows_to
    )
