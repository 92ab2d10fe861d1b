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


@pytest.mark.parametrize("need_sum", [False, True])
def test_snake_kernel_writes_into_a_view_after_carried_context(need_sum):
    """`out`: the activation lands in rows [context:] of a [B, context + T, C] buffer (what a causal
    conv reads), the carried rows before it untouched, the sum still contiguous."""
    gen = torch.Generator().manual_seed(3)
    channels, context, steps = 24, 6, 40
    x = torch.randn(2, steps, channels, generator=gen).to(DEVICE)
    residual = torch.randn(2, steps, channels, generator=gen).to(DEVICE)
    alpha = (0.3 + torch.rand(1, channels, 1, generator=gen)).to(DEVICE)
    joined = torch.full((2, context + steps, channels), 7.0, device=DEVICE)
    total, out = snake_triton(
        x, alpha, residual, channels_last=True, need_sum=need_sum, out=joined[:, context:]
    )
    ref_total, ref_out = snake_reference(x, alpha, residual, channels_last=True)
    assert out.data_ptr() == joined[:, context:].data_ptr()
    assert (joined[:, :context] == 7.0).all()
    torch.testing.assert_close(joined[:, context:], ref_out, atol=2e-6, rtol=1e-6)
    if need_sum:
        assert total.is_contiguous()
        torch.testing.assert_close(total, ref_total, atol=0, rtol=0)
    channels_first = torch.empty(2, channels, steps, device=DEVICE).transpose(1, 2)  # right shape, strided
    with pytest.raises(ValueError, match="unit last stride"):
        snake_triton(x, alpha, channels_last=True, out=channels_first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flat_time_major_path_equals_the_tiled_path(dtype):
    """Time-major inputs whose rows are contiguous take the flat kernel (no padded channel lanes);
    the same values through strided views take the tiled kernel: the same bits."""
    from shoal.kernels import snake as snake_module

    gen = torch.Generator().manual_seed(4)
    batch, steps, channels = 3, 45, 96  # 4,320 elements per row: a partial last block
    x = (2 * torch.randn(batch, steps, channels, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(batch, steps, channels, generator=gen).to(DEVICE, dtype)
    alpha = (0.3 + torch.rand(1, channels, 1, generator=gen)).to(DEVICE)
    bias = torch.randn(channels, generator=gen).to(DEVICE)
    assert all(snake_module._rows_contiguous(t, channels) for t in (x, residual))
    flat_total, flat_out = snake_triton(x, alpha, residual, bias, channels_last=True)

    def strided(t):  # the same values, channel stride 2: not flat
        wide = torch.zeros(batch, steps, 2 * channels, dtype=dtype, device=DEVICE)
        wide[..., ::2] = t
        return wide[..., ::2]

    assert not snake_module._rows_contiguous(strided(x), channels)
    tiled_total, tiled_out = snake_triton(strided(x), alpha, strided(residual), bias, channels_last=True)
    assert torch.equal(flat_total, tiled_total) and torch.equal(flat_out, tiled_out)
    ref_total, ref_out = snake_reference(x.float(), alpha, residual.float(), bias, channels_last=True)
    torch.testing.assert_close(
        flat_out.float(), ref_out, atol=2e-6, rtol=1e-6 if dtype == torch.float32 else 8e-3
    )
