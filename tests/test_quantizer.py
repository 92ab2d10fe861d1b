"""The offline FP8 quantizer, the checkpoint layout, Fp8Linear and the load-time layout check (CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from shoal.kernels import reference as ref
from shoal.models import load_model
from shoal.models.writer import random_state_dict, tiny_config, write_checkpoint
from shoal.quant import fp8
from shoal.quant.cli import add_arguments, run
from shoal.quant.fp8_linear import (
    Fp8Linear,
    LayoutError,
    load_quantized,
    quantize_model_,
    verify_model_layout,
)


def _linear(n: int, k: int, seed: int = 0) -> nn.Linear:
    """Weights with per-channel magnitude spread, so the 128x128 block scales differ a lot (seeded:
    with unseeded weights a transposed 2x2 scale grid was, once in a while, close enough to the
    right one for the layout probe to pass)."""
    linear = nn.Linear(k, n, bias=False)
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp(torch.randn(n, 1, generator=g)) * torch.exp(torch.randn(1, k, generator=g))
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * spread)
    return linear


def test_weight_quantization_round_trip() -> None:
    w = torch.randn(300, 200) * torch.exp(torch.randn(300, 1))
    w_q, w_scale, probe = fp8.quantize_weight(w)
    assert w_q.dtype == torch.float8_e4m3fn and w_scale.shape == (3, 2) and w_scale.is_contiguous()
    assert ((ref.dequantize_weight(w_q, w_scale) - w).norm() / w.norm()) < 0.04
    assert w_q.float().abs().amax() <= 448
    expected = ref.dequantize_weight(w_q, w_scale).double() @ fp8.probe_input(200).double()
    torch.testing.assert_close(probe, expected.float())


def test_probe_input_is_exact_in_every_activation_mode() -> None:
    p = fp8.probe_input(384)
    assert set(p.unique().tolist()) == {-1.0, 1.0}
    q, s = ref.quantize_activations(p[None])
    torch.testing.assert_close(ref.dequantize_activations(q, s)[0], p, rtol=1e-6, atol=0)


@pytest.mark.parametrize("quantize_input", [False, True])
def test_fp8_linear_matches_float_linear(quantize_input: bool) -> None:
    linear = _linear(256, 384)
    layer = Fp8Linear.from_linear(linear, quantize_input)
    x = torch.randn(3, 5, 384)
    y = layer(x)
    assert y.shape == (3, 5, 256)
    exact = linear(x)
    assert ((y - exact).norm() / exact.norm()) < (0.08 if quantize_input else 0.04)
    layer.check_layout("probe")


@pytest.mark.parametrize("breakage", ["transposed-contiguous", "transposed-view", "swapped-rows", "shape"])
def test_layout_check_catches_broken_scales(breakage: str) -> None:
    layer = Fp8Linear.from_linear(_linear(256, 256))  # a square 2x2 scale grid: shape checks alone pass
    layer.check_layout()
    scale = layer.weight_scale
    # the premise: the grid is far from symmetric (and its rows differ), so each breakage matters
    assert not torch.allclose(scale, scale.t(), rtol=0.3) and not torch.allclose(scale[0], scale[1], rtol=0.3)
    if breakage == "transposed-contiguous":
        layer.weight_scale = scale.t().contiguous()
    elif breakage == "transposed-view":
        layer.weight_scale = scale.t()
    elif breakage == "swapped-rows":
        layer.weight_scale = scale.flip(0).contiguous()
    else:
        layer.weight_scale = scale.reshape(4, 1)
    with pytest.raises(LayoutError):
        layer.check_layout("broken")


def _tiny_checkpoint(directory: Path) -> Path:
    """An S2-layout checkpoint with projections wide enough for several 128x128 blocks."""
    config = tiny_config("s2").replace(dim=256, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=384)
    config = config.replace(fast_dim=256, fast_head_dim=64, fast_intermediate_size=384)
    state = random_state_dict(config, seed=1)
    generator = torch.Generator().manual_seed(1)  # a fixed model: the logit comparison below is not a tail
    for name in state:  # channel spread, as in trained weights
        if name.endswith(("wqkv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight")):
            state[name] = state[name] * torch.exp(torch.randn(1, state[name].shape[1], generator=generator))
    write_checkpoint(directory, config, state)
    return directory


def test_quantize_cli_writes_a_checkpoint_that_loads_and_verifies(tmp_path: Path) -> None:
    source = _tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "fp8"
    parser = __import__("argparse").ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([str(source), str(out)])) == 0
    section = json.loads((out / "config.json").read_text())["quantization"]
    assert section["format"] == "fp8_block" and section["weight_block"] == [128, 128]
    assert (
        "layers.0.feed_forward.w2" in section["modules"]
        and "fast_layers.1.attention.wqkv" in section["modules"]
    )
    assert (out / "tokenizer.json").exists()
    model = load_quantized(out, dtype=torch.float32)
    assert verify_model_layout(model) == len(section["modules"])
    layer = model.get_submodule("layers.0.feed_forward.w1")
    assert isinstance(layer, Fp8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale.shape == (3, 2)
    # the quantized model computes nearly what the float one does
    reference_model = load_model(source, dtype=torch.float32)
    generator = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, 300, (reference_model.config.num_codebooks + 1, 6), generator=generator)
    prompt[1:] = 0
    exact = reference_model.prefill_logits(prompt)
    approx = model.prefill_logits(prompt)
    assert ((approx - exact).norm() / exact.norm()) < 0.25  # random deep nets amplify rounding


def test_load_quantized_rejects_a_transposed_scale_on_disk(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    source = _tiny_checkpoint(tmp_path / "src")
    out = tmp_path / "fp8"
    model = load_model(source, dtype=torch.float32)
    modules = quantize_model_(model)
    fp8.write_quantized_checkpoint(source, out, model.state_dict(), modules, False)
    state = load_file(str(out / fp8.WEIGHTS_FILE))
    name = "layers.1.attention.wo.weight_scale"  # 256 x 256: a 2 x 2 grid
    state[name] = state[name].t().contiguous()
    save_file(state, str(out / fp8.WEIGHTS_FILE))
    with pytest.raises(LayoutError, match="layers.1.attention.wo"):
        load_quantized(out, dtype=torch.float32)
    load_quantized(out, dtype=torch.float32, verify=False)  # loads, but would compute garbage


@pytest.mark.parametrize("family", ["s1", "1.5"])
def test_flat_config_families_quantize_and_load(tmp_path: Path, family: str) -> None:
    """S1-mini / 1.5 have flat configs: the added "quantization" section must not make the
    strict flat-config parser reject the quantized checkpoint."""
    source = tmp_path / "src"
    write_checkpoint(source, tiny_config(family))
    out = tmp_path / "fp8"
    model = load_model(source, dtype=torch.float32)
    modules = quantize_model_(model)
    fp8.write_quantized_checkpoint(source, out, model.state_dict(), modules, False)
    loaded = load_quantized(out, dtype=torch.float32)
    assert loaded.family == family and verify_model_layout(loaded) == len(modules)
    assert isinstance(loaded.get_submodule("layers.0.attention.wqkv"), Fp8Linear)
