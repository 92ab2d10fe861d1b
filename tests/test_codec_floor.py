"""The codec floor counter (shoal/bench/codec_floor.py) counts what the streaming call does.

Checked on the demo codec against counts worked out by hand from its config, on a real CPU
forward and on the meta device (which the full-size numbers use)."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.bench import codec_floor
from shoal.bench.codec_floor import CallCost, Hardware, codec_config, count_call, meta_codec
from shoal.models.codec import random_codec

BATCH, CHUNK = 2, 2
BF16 = 2


@pytest.fixture(scope="module")
def config():
    return codec_config("demo")


@pytest.fixture(scope="module")
def cpu_call(config) -> CallCost:
    return count_call(random_codec(config, seed=0, dtype=torch.bfloat16), BATCH, CHUNK)


def samples_per_frame_at_block(config, block: int) -> int:
    """Time steps per frame at the output of decoder block `block` (1-based)."""
    return math.prod(config.downsample_factor) * math.prod(config.decoder_rates[:block])


def test_dilated_conv_counts_equal_hand_counts(cpu_call, config):
    layer = cpu_call.by_name()["decoder.model.2.block.3.block.1"]  # block 2, unit 2: k7, dilation 3
    steps = BATCH * CHUNK * samples_per_frame_at_block(config, 2)
    channels = config.decoder_dim // 4
    context = (7 - 1) * 3
    assert layer.kind == "conv"
    assert layer.flops == 2 * steps * channels * channels * 7
    assert layer.weight_bytes == (channels * channels * 7 + channels) * BF16
    assert layer.act_read_bytes == steps * channels * BF16  # new rows only: the context is state
    assert layer.act_write_bytes == steps * channels * BF16
    assert layer.state_bytes == 2 * BATCH * context * channels * BF16  # read, then rewritten
    assert layer.recompute_flops == 0


def test_linear_counts_equal_hand_counts(cpu_call, config):
    layer = cpu_call.by_name()["quantizer.upsample.0.1.pwconv1"]  # ConvNeXt MLP in, at 2x the frame rate
    rows = BATCH * CHUNK * config.downsample_factor[-1]
    dim, hidden = config.latent_dim, 4 * config.latent_dim
    assert layer.kind == "linear"
    assert layer.flops == 2 * rows * dim * hidden
    assert layer.weight_bytes == (dim * hidden + hidden) * BF16
    assert layer.act_read_bytes == rows * dim * BF16
    assert layer.act_write_bytes == rows * hidden * BF16
    assert layer.state_bytes == 0


def test_transposed_conv_and_attention_count_their_streaming_recompute(cpu_call, config):
    layers = cpu_call.by_name()
    transposed = layers["decoder.model.1.block.1"]  # 64 -> 32 channels, k16 s8, one carried input
    inputs = BATCH * CHUNK * math.prod(config.downsample_factor)
    cin, cout, kernel = config.decoder_dim, config.decoder_dim // 2, 2 * config.decoder_rates[0]
    assert transposed.flops == 2 * BATCH * (inputs // BATCH + 1) * cin * cout * kernel
    assert transposed.recompute_flops == transposed.flops // (inputs // BATCH + 1)
    attention = layers["quantizer.post_module.layers.0.attention"]
    heads, head_dim, window = config.transformer.n_head, config.transformer.head_dim, config.window_size
    keys = window - 1 + CHUNK
    assert attention.flops == 2 * BATCH * heads * CHUNK * keys * 2 * head_dim
    assert attention.recompute_flops == attention.flops - attention.flops * window // keys
    assert attention.state_bytes == 2 * 2 * BATCH * heads * (window - 1) * head_dim * BF16


def test_decoder_conv_flops_equal_the_analytic_sum(cpu_call, config):
    """Every conv and transposed conv of the decoder, summed from the config alone."""
    steps = BATCH * CHUNK * math.prod(config.downsample_factor)  # rows into the decoder
    expected = 2 * steps * config.latent_dim * config.decoder_dim * 7
    channels = config.decoder_dim
    for rate in config.decoder_rates:
        expected += 2 * (steps + BATCH) * channels * (channels // 2) * 2 * rate  # + one carried input per row
        steps, channels = steps * rate, channels // 2
        expected += 3 * 2 * steps * channels * channels * (7 + 1)  # k7 dilated + k1 per residual unit
    expected += 2 * steps * channels * 7
    counted = sum(
        layer.flops for layer in cpu_call.layers if layer.name.startswith("decoder.model.")
    )  # fmt: skip
    assert counted == expected


def test_meta_device_counts_equal_a_real_cpu_forward(cpu_call, config):
    """Except one layout copy: the CPU attention returns its output time-major, so the CPU run's
    `flatten` of it is a view where the meta kernel's needs a copy."""
    meta = count_call(meta_codec(config), BATCH, CHUNK)
    assert [layer.name for layer in meta.layers] == [layer.name for layer in cpu_call.layers]
    for fast, real in zip(meta.layers, cpu_call.layers, strict=True):
        fields = codec_floor.COUNTED_FIELDS
        if real.kind == "attention":
            fields = ("flops", "recompute_flops", "state_bytes", "weight_bytes")
        for name in fields:
            assert getattr(fast, name) == getattr(real, name), (real.name, name)


def test_costs_grow_linearly_with_the_chunk(config):
    """Conv, linear and Snake work and activations grow exactly with the chunk; weights and carried
    state are per call; the rest (attention over the cached window) is nearly affine."""
    codec = meta_codec(config)
    calls = {chunk: count_call(codec, BATCH, chunk) for chunk in (1, 2, 4)}

    def total(chunk: int, name: str, kinds=("conv", "linear", "snake")) -> int:
        return sum(getattr(layer, name) for layer in calls[chunk].layers if layer.kind in kinds)

    for name in ("flops", "act_read_bytes", "act_write_bytes"):
        assert total(4, name) == 2 * total(2, name) == 4 * total(1, name), name
    vector = [total(chunk, "vector_flops") for chunk in (1, 2, 4)]  # + Snake's 1 / alpha per call
    assert vector[2] - vector[1] == 2 * (vector[1] - vector[0])
    for name in ("weight_bytes", "state_bytes"):
        assert calls[1].total(name) == calls[2].total(name) == calls[4].total(name), name
    step_1_2 = calls[2].total("flops") - calls[1].total("flops")
    step_2_4 = calls[4].total("flops") - calls[2].total("flops")
    assert step_2_4 == pytest.approx(2 * step_1_2, rel=0.01)
    hardware = Hardware()
    assert calls[4].floor_seconds(hardware) < 4 * calls[1].floor_seconds(hardware)  # fixed costs amortise


def test_report_runs_from_the_command_line(capsys):
    assert codec_floor.main(["--size", "demo", "--batch", "2", "--chunk", "2", "--layers", "3"]) == 0
    out = capsys.readouterr().out
    assert "audio-s/s" in out and "decoder block 4" in out and "top 3 layers" in out
