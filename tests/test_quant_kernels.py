"""Activation quantization kernels (`kernels/quant.py`) against the torch reference.

On a machine without CUDA the Triton interpreter runs the kernels (set before triton is imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shoal.kernels import quant  # noqa: E402
from shoal.kernels import reference as ref  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _poisoned(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((m, k), float("nan"), device=DEVICE).to(torch.float8_e4m3fn)
    scales = quant.new_activation_scales(m, k, DEVICE)
    scales.fill_(float("nan"))
    return out, scales


def _activations(m: int, k: int) -> torch.Tensor:
    """bf16 with per-group magnitude spread (outlier channels), like real hidden states."""
    x = torch.randn(m, k, device=DEVICE) * torch.exp(torch.randn(1, k, device=DEVICE))
    return x.to(torch.bfloat16)


@pytest.mark.parametrize("m,k", [(1, 128), (3, 384), (5, 200)])
def test_quantize_activations_matches_reference_bit_for_bit(m: int, k: int) -> None:
    x = _activations(m, k)
    out, scales = _poisoned(m, k)
    q, s = quant.quantize_activations(x, out=out, scales=scales, groups_per_program=2)
    assert q.data_ptr() == out.data_ptr() and s.data_ptr() == scales.data_ptr()
    q_ref, s_ref = ref.quantize_activations(x)
    assert torch.equal(s, s_ref.to(DEVICE))
    assert torch.equal(q.view(torch.uint8), q_ref.to(DEVICE).view(torch.uint8))
    err = (ref.dequantize_activations(q, s) - x.float()).norm() / x.float().norm()
    assert err < 0.05


def test_every_bf16_value_rounds_to_e4m3_as_torch_does() -> None:
    """Each row's amax is 448, so its scale is exactly 1 and the codes are the values' own e4m3
    roundings: every bf16 value in [-448, 448] (ties to even, e4m3 subnormals, signed zeros)
    quantizes to torch's cast bit for bit. The GPU rounds in its cast instruction, the
    interpreter on the bits (`quant._ROUND_E4M3_ON_BITS`): both must give these codes."""
    patterns = torch.arange(0, 0x43E1, dtype=torch.int32).to(torch.int16)  # 0x43E0 is bf16 448
    values = patterns.view(torch.bfloat16).float()
    values = torch.cat([values, -values])
    values = torch.cat([values, values.new_zeros(-len(values) % 127)]).view(-1, 127)
    x = torch.cat([values.new_full((len(values), 1), 448.0), values], dim=1).to(torch.bfloat16)
    q, s = quant.quantize_activations(x.to(DEVICE))
    assert (s == 1).all()
    expected = x.float().to(torch.float8_e4m3fn).view(torch.uint8)
    mismatched = (q.cpu().view(torch.uint8) != expected).nonzero()
    assert len(mismatched) == 0, f"{len(mismatched)} codes differ, first at {x[tuple(mismatched[0])]}"


@pytest.mark.gpu
def test_every_bf16_value_rounds_to_e4m3_as_torch_does_gpu() -> None:
    """The same on the H200, where the cast instruction rounds (`pytest -m gpu` selects only
    marked tests)."""
    test_every_bf16_value_rounds_to_e4m3_as_torch_does()


def test_scales_are_group_major_and_zero_rows_are_finite() -> None:
    x = _activations(4, 256)
    x[2] = 0
    q, s = quant.quantize_activations(x)
    assert s.shape == (4, 2) and s.stride() == (1, 4)
    assert torch.isfinite(s).all() and (q[2].float() == 0).all()
    assert (s[2] == quant.MIN_SCALE).all()


@pytest.mark.parametrize("m,i", [(2, 256), (3, 160)])
def test_swiglu_quantize_matches_reference(m: int, i: int) -> None:
    gate_up = (torch.randn(m, 2 * i, device=DEVICE) * 3).to(torch.bfloat16)
    out, scales = _poisoned(m, i)
    q, s = quant.swiglu_quantize(gate_up, out=out, scales=scales)
    q_ref, s_ref = ref.swiglu_quantize(gate_up)
    torch.testing.assert_close(s, s_ref.to(DEVICE), rtol=1e-6, atol=0)
    # exp may differ by an ulp between libraries: allow rare one-step rounding differences
    mismatch = (q.float() != q_ref.to(DEVICE).float()).float().mean().item()
    assert mismatch < 0.01
    exact = ref.swiglu(gate_up)
    err = (ref.dequantize_activations(q, s) - exact).norm() / exact.norm()
    assert err < 0.05


@pytest.mark.parametrize("swiglu", [False, True])
def test_padded_rows_quantize_zeros_and_the_rest_is_unchanged(swiglu: bool) -> None:
    """`pad_rows_to` rounds the outputs' rows up (the rows past M: zero codes, the minimum scale),
    and neither it nor the groups per program changes a bit of the M rows."""
    m, k = 5, 384
    x = _activations(m, 2 * k if swiglu else k)
    fn = quant.swiglu_quantize if swiglu else quant.quantize_activations
    q, s = fn(x)
    q_pad, s_pad = fn(x, pad_rows_to=4, groups_per_program=1)
    assert q_pad.shape == (8, k) and s_pad.shape == (8, 3) and s_pad.stride() == (1, 8)
    assert torch.equal(q_pad[:m].view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_pad[:m], s)
    assert (q_pad[m:].view(torch.uint8) == 0).all() and (s_pad[m:] == quant.MIN_SCALE).all()
    q_wide, s_wide = fn(x, groups_per_program=16)
    assert torch.equal(q_wide.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_wide, s)
    assert quant.groups_per_program_for(256) == 4 and quant.groups_per_program_for(3840) == 8


def test_rejects_wrong_scale_layout() -> None:
    x = _activations(3, 256)
    row_major = torch.empty(3, 2, device=DEVICE)
    with pytest.raises(ValueError, match="group-major"):
        quant.quantize_activations(x, scales=row_major)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 128])
@pytest.mark.parametrize("k", [2560, 4096, 9728])
def test_quantize_full_shapes_gpu(m: int, k: int) -> None:
    x = _activations(m, k)
    out, scales = _poisoned(m, k)
    q, s = quant.quantize_activations(x, out=out, scales=scales)
    q_ref, s_ref = ref.quantize_activations(x)
    torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=0)
    assert (q.float() != q_ref.float()).float().mean().item() < 1e-3
    gate_up = _activations(m, 2 * k)
    q, s = quant.swiglu_quantize(gate_up)
    exact = ref.swiglu(gate_up)
    assert ((ref.dequantize_activations(q, s) - exact).norm() / exact.norm()).item() < 0.05
