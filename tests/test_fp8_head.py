"""`quant/fp8_head.py`: the fast head rounded to e4m3 with power-of-two block scales."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shoal.config import EngineConfig
from shoal.engine.core import EngineCore
from shoal.engine.decode_step import DecodeStep
from shoal.kernels.reference import dequantize_weight
from shoal.models import load_model
from shoal.quant.fp8_head import Fp8RoundedHead, round_fast_head_, round_to_e4m3_blocks


def test_rounding_uses_power_of_two_scales_and_is_exact_in_bf16() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(300, 260, generator=gen) / 50
    weight[128:256, :128] *= 1000  # a block far larger than the rest
    weight[:128, 128:256] = 0  # and a zero block
    codes, scales = round_to_e4m3_blocks(weight)
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == weight.shape
    assert scales.dtype == torch.float32 and scales.shape == (3, 3)
    assert torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # powers of two
    assert scales[0, 1] == 1 and (codes[:128, 128:256].float() == 0).all()
    blocks = torch.nn.functional.pad(weight, (0, 124, 0, 84)).view(3, 128, 3, 128).abs().amax(dim=(1, 3))
    assert (blocks / scales <= 448).all() and (blocks[blocks > 0] / scales[blocks > 0] > 224).all()
    rounded = dequantize_weight(codes, scales)
    assert torch.equal(rounded.to(torch.bfloat16).float(), rounded)  # every value exact in bf16
    # e4m3 keeps 3 mantissa bits: at most half a unit of the 4th bit off, or half the smallest
    # subnormal step (2^-10 of the scale) near zero
    error = (rounded - weight).abs()
    expanded = scales.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :260]
    assert (error <= torch.maximum(weight.abs() / 16, expanded * 2**-10)).all()
    again_codes, again_scales = round_to_e4m3_blocks(rounded)
    assert torch.equal(again_scales, scales) and torch.equal(again_codes.float(), codes.float())


def test_rounded_head_holds_the_dequantized_weight_and_saves_only_it() -> None:
    linear = nn.Linear(256, 200, bias=False).to(torch.bfloat16)
    head = Fp8RoundedHead.from_linear(linear)
    assert torch.equal(head.weight.float(), dequantize_weight(head.weight_fp8, head.weight_scale))
    assert list(head.state_dict()) == ["weight"]
    x = torch.randn(3, 256).to(torch.bfloat16)
    assert torch.equal(head(x), nn.functional.linear(x, head.weight))
    with pytest.raises(ValueError, match="no bias"):
        Fp8RoundedHead.from_linear(nn.Linear(4, 4))


def _core(golden_dir, **fields) -> EngineCore:
    model = load_model(golden_dir / "s2_tiny", device="cpu", dtype=torch.float32)
    config = EngineConfig(device="cpu", dtype="float32", num_pages=64, page_size=4, **fields)
    return EngineCore(model, config)


def test_the_fp8_engine_rounds_the_fast_head_once(golden_dir) -> None:
    """FP8 engines round the fast head in place (the reference generator then decodes with the same
    weights: `test_engine_fp8.py`); `fp8_fast_head=False` and bf16 engines keep the checkpoint's."""
    model = _core(golden_dir, weight_format="fp8").runner.model
    assert [name for name, m in model.named_modules() if isinstance(m, Fp8RoundedHead)] == ["fast_output"]
    head = model.fast_output
    assert round_fast_head_(model) == [] and model.fast_output is head
    for fields in ({"weight_format": "fp8", "fp8_fast_head": False}, {"weight_format": "bf16"}):
        model = _core(golden_dir, **fields).runner.model
        assert type(model.fast_output) is nn.Linear, fields


@pytest.mark.interpreter
def test_the_kernel_step_reads_the_codes_at_batch_one(golden_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """At batch 1 the head kernel gets the codes and scales (`fp8_fast_head`) and gives the logits
    of the bf16 weight the module holds; switched off, or at batch 2 (cuBLAS), the weight itself."""
    import shoal.kernels.output_head as output_head_module

    runner = _core(golden_dir, weight_format="fp8").runner
    model = runner.model
    step = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True)
    assert step.tuning.head_kernel_max_rows >= 1 and step.tuning.head_kernel_reads_fp8
    seen = []
    original = output_head_module.output_head

    def spy(x, weight, *args, **kwargs):
        seen.append(weight.dtype)
        return original(x, weight, *args, **kwargs)

    monkeypatch.setattr(output_head_module, "output_head", spy)
    normed = torch.randn(2, model.config.fast_dim)
    want = F.linear(normed.double(), model.fast_output.weight.double())
    with torch.no_grad():
        got = step._fast_head(normed[:1])
        step.tuning = step.tuning.with_fields(head_kernel_reads_fp8=False)
        plain = step._fast_head(normed[:1])
        both = step._fast_head(normed)
    assert seen == [torch.float8_e4m3fn, torch.float32]  # batch 2 does not reach the kernel
    for logits in (got, plain):
        assert torch.allclose(logits.double(), want[:1], rtol=1e-5, atol=1e-5)
    assert torch.allclose(both.double(), want, rtol=1e-5, atol=1e-5)
