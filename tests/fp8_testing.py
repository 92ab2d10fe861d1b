"""Shared by the FP8 kernel tests: the device, S2-Pro's projection shapes, random block-scaled
weights and the relative error that also catches unwritten (NaN-poisoned) outputs."""

from __future__ import annotations

import torch

from shoal.kernels import reference as ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Real S2-Pro projection shapes (N, K); the fast transformer's layers have the same ones.
S2_SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}


def fp8_weight(n: int, k: int, magnitude: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """Random weights with per-channel magnitude spread, so the 128x128 block scales differ."""
    w = torch.randn(n, k, device=DEVICE) * torch.exp(0.5 * torch.randn(n, 1, device=DEVICE))
    w = w * torch.exp(0.5 * torch.randn(1, k, device=DEVICE))
    return ref.quantize_weight(w * magnitude)


def poisoned_out(m: int, n: int) -> torch.Tensor:
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "output has unwritten (NaN) elements"
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()
