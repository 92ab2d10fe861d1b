"""`scripts/probe_prefill_gemm_scaling.py`: its row-wise requantization and error report on the CPU
(the timing needs a GPU), so the GPU run's error columns mean what they say."""

from __future__ import annotations

import torch
from script_testing import load_script


def test_the_numerics_check_passes() -> None:
    load_script("probe_prefill_gemm_scaling").check()


def test_row_scales_lose_more_to_outlier_channels() -> None:
    """One scale per row costs more than one per 128 columns (the weight's blocks differ in
    magnitude), and a few columns 30x larger than the rest widen the gap: the error report tells
    the two paths and the two inputs apart."""
    script = load_script("probe_prefill_gemm_scaling")
    g = torch.Generator().manual_seed(3)
    w_q, w_scale = script.make_weight(128, 512, g)
    plain = torch.randn(16, 512, generator=g)
    outliers = plain.clone()
    outliers[:, ::64] *= 30.0
    flat = script.errors(plain.to(torch.bfloat16), w_q, w_scale)
    spiky = script.errors(outliers.to(torch.bfloat16), w_q, w_scale)
    assert flat["block"] < flat["row"] and spiky["block"] < spiky["row"]
    assert spiky["row"] / spiky["block"] > 1.5 * flat["row"] / flat["block"], (flat, spiky)
