"""The fused Snake(+residual) Triton kernel against the torch reference, in the interpreter."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the kernel's (lazy) JIT

triton = pytest.importorskip("triton")

from shoal.kernels.snake import snake, snake_reference, snake_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(2, 5, 37), (1, 3, 1500)])
def test_snake_kernel_matches_reference(shape, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=gen)).to(DEVICE)
    alpha = (0.2 + 2 * torch.rand(1, shape[1], 1, generator=gen)).to(DEVICE)
    residual = torch.randn(shape, generator=gen).to(DEVICE) if with_residual else None
    total, out = snake_triton(x, alpha, residual)
    ref_total, ref_out = snake_reference(x, alpha, residual)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-6)


def test_snake_kernel_reads_time_slices_without_copy():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(2, 4, 50, generator=gen).to(DEVICE)
    residual_base = torch.randn(2, 4, 60, generator=gen).to(DEVICE)
    x, residual = base[..., 3:41], residual_base[..., :38]  # trimmed like a transposed conv output
    alpha = torch.rand(1, 4, 1, generator=gen).to(DEVICE) + 0.5
    total, out = snake_triton(x, alpha, residual)
    ref_total, ref_out = snake_reference(x, alpha, residual)
    torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-6)


def test_snake_kernel_bf16_computes_in_fp32():
    x = torch.linspace(-4, 4, 3 * 64).view(1, 3, 64).to(DEVICE, torch.bfloat16)
    alpha = torch.tensor([0.5, 1.0, 1.7]).view(1, 3, 1).to(DEVICE, torch.bfloat16)
    _, out = snake_triton(x, alpha)
    _, ref = snake_reference(x.float(), alpha.float())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0, rtol=8e-3)  # one bf16 rounding


def test_dispatch_uses_reference_on_cpu():
    x, alpha = torch.randn(1, 2, 8), torch.ones(1, 2, 1)
    total, out = snake(x, alpha)
    assert total is x
    torch.testing.assert_close(out, snake_reference(x, alpha)[1], atol=0, rtol=0)


@pytest.mark.parametrize("need_sum", [False, True])
def test_snake_kernel_time_major_with_bias_and_strided_inputs(need_sum):
    """The streaming layout: x [B, T, C] a time slice of a bigger buffer, residual transposed."""
    gen = torch.Generator().manual_seed(2)
    channels = 24
    x = (2 * torch.randn(3, 70, channels, generator=gen)).to(DEVICE)[:, 5:62]
    residual = torch.randn(3, channels, 57, generator=gen).to(DEVICE).transpose(1, 2)
    alpha = (0.3 + torch.rand(1, channels, 1, generator=gen)).to(DEVICE)
    bias = torch.randn(channels, generator=gen).to(DEVICE)
    total, out = snake_triton(x, alpha, residual, bias, channels_last=True, need_sum=need_sum)
    ref_total, ref_out = snake_reference(x, alpha, residual, bias, channels_last=True)
    assert out.is_contiguous() and out.shape == (3, 57, channels)
    torch.testing.assert_close(out, ref_out, atol=2e-6, rtol=1e-6)
    if need_sum:
        torch.testing.assert_close(total, ref_total, atol=1e-6, rtol=0)
    else:
        assert total is x
    _, bias_only = snake_triton(x, alpha, None, bias, channels_last=True)
    torch.testing.assert_close(bias_only, snake_reference(x, alpha, None, bias, channels_last=True)[1])
