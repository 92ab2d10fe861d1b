"""The codec against the reference's golden outputs (codec_tiny), and every checkpoint variant."""

from __future__ import annotations

import json

import pytest
import torch

from shoal.models.codec import CodecConfig, load_codec, read_codec_state_dict, save_random_codec


@pytest.fixture(scope="module")
def tiny(golden_dir):
    directory = golden_dir / "codec_tiny"
    config = json.loads((directory / "config.json").read_text())
    golden = torch.load(directory / "golden.pt", weights_only=True)
    return directory, config, golden


def test_encode_matches_reference_codes(tiny):
    directory, _, golden = tiny
    codec = load_codec(directory / "codec.pth")
    assert codec.frame_length == golden["frame_length"] == 16
    assert codec.num_codebooks == 4 and codec.sample_rate == 44100
    codes = codec.encode(golden["audio_in"])
    assert codes.shape == golden["codes"].shape
    assert torch.equal(codes, golden["codes"])
    # mono [T] and [B, T] inputs are the same audio
    assert torch.equal(codec.encode(golden["audio_in"][0, 0]), codes)


def test_decode_matches_reference_audio(tiny):
    directory, _, golden = tiny
    codec = load_codec(directory)  # a directory holding codec.pth works too
    audio = codec.decode(golden["decode_codes"])
    assert audio.shape == golden["decode_audio"].shape
    torch.testing.assert_close(audio, golden["decode_audio"], atol=1e-5, rtol=0)


def test_prefix_decode_is_prefix_of_full_decode(tiny):
    directory, _, golden = tiny
    codec = load_codec(directory / "codec.pth")
    prefix = codec.decode(golden["decode_codes"][..., :10])
    torch.testing.assert_close(prefix, golden["decode_prefix10_audio"], atol=1e-5, rtol=0)
    torch.testing.assert_close(prefix, golden["decode_audio"][..., :160], atol=1e-5, rtol=0)


def _legacy(state: dict) -> dict:
    """Old torch weight_norm naming: parametrizations.weight.original0/1 -> weight_g/weight_v."""
    out = {}
    for key, value in state.items():
        key = key.replace("parametrizations.weight.original0", "weight_g")
        out[key.replace("parametrizations.weight.original1", "weight_v")] = value
    return out


@pytest.mark.parametrize("variant", ["wrapped", "prefixed", "wrapped_prefixed", "legacy_weight_norm"])
def test_checkpoint_variants_load_identically(tiny, tmp_path, variant):
    directory, config, golden = tiny
    state = read_codec_state_dict(directory / "codec.pth")
    if variant == "legacy_weight_norm":
        state = _legacy(state)
        assert any(k.endswith("conv.weight_g") for k in state)
    if "prefixed" in variant:
        state = {f"generator.{k}": v for k, v in state.items()}
        state["discriminator.some.weight"] = torch.zeros(1)  # GAN training leftovers are dropped
    if "wrapped" in variant:
        state = {"state_dict": state, "epoch": 3}
    torch.save(state, tmp_path / "codec.pth")
    codec = load_codec(tmp_path / "codec.pth", config=config)
    torch.testing.assert_close(
        codec.decode(golden["decode_codes"]), golden["decode_audio"], atol=1e-5, rtol=0
    )


def test_strict_loading_names_every_problem(tiny, tmp_path):
    directory, config, _ = tiny
    state = read_codec_state_dict(directory / "codec.pth")
    del state["decoder.model.0.conv.bias"]
    state["decoder.extra.weight"] = torch.zeros(3)
    state["quantizer.quantizer.quantizers.0.codebook.weight"] = torch.zeros(7, 4)
    torch.save(state, tmp_path / "codec.pth")
    with pytest.raises(ValueError) as error:
        load_codec(tmp_path / "codec.pth", config=config)
    message = str(error.value)
    assert "missing: decoder.model.0.conv.bias" in message
    assert "unexpected: decoder.extra.weight" in message
    assert "mis-shaped: quantizer.quantizer.quantizers.0.codebook.weight (7, 4)" in message


def test_full_size_default_config_rejects_tiny_checkpoint(tiny, tmp_path):
    directory, _, _ = tiny
    # no codec config beside the file: the official defaults are used, and nothing fits
    torch.save(read_codec_state_dict(directory / "codec.pth"), tmp_path / "codec.pth")
    with pytest.raises(ValueError, match="mis-shaped: encoder.block.0.conv"):
        load_codec(tmp_path / "codec.pth")


def test_random_codec_round_trip(tiny, tmp_path):
    _, config, _ = tiny
    path = save_random_codec(tmp_path / "plain", config, seed=1)
    legacy_path = save_random_codec(tmp_path / "legacy", config, seed=1, legacy=True)
    stored = torch.load(path, weights_only=True)
    assert any(".parametrizations.weight.original1" in k for k in stored)
    assert any(".in_proj.weight_g" in k for k in stored)
    assert not any(".parametrizations." in k for k in torch.load(legacy_path, weights_only=True))
    codec, legacy = load_codec(path), load_codec(legacy_path)  # config found in codec_config.json
    assert codec.config == CodecConfig.from_dict(config)
    codes = torch.randint(0, 32, (2, 4, 12))
    audio = codec.decode(codes)
    assert audio.shape == (2, 1, 12 * 16) and torch.isfinite(audio).all()
    assert audio.std() > 1e-3  # random weights still produce a signal, not silence
    torch.testing.assert_close(legacy.decode(codes), audio)
    assert not torch.equal(
        load_codec(save_random_codec(tmp_path / "other", config, seed=2)).decode(codes), audio
    )
    encoded = codec.encode(audio[:1, 0])
    assert encoded.shape == (1, 4, 12) and encoded.dtype == torch.long


def test_batch_of_different_lengths_encodes_each_clip_as_alone(tiny):
    directory, _, golden = tiny
    codec = load_codec(directory, dtype=torch.float64)  # float64: no batch-dependent argmax flips
    assert torch.equal(
        codec.encode_with_lengths(golden["audio_in"], golden["audio_in"].shape[-1:])[1],
        golden["code_lengths"],  # the reference's ceil(len / frame_length)
    )
    g = torch.Generator().manual_seed(7)
    lengths = [379, 16, 161, 1, 200]  # a whole frame, a partial one, one sample
    clips = [0.3 * torch.randn(n, generator=g, dtype=torch.float64) for n in lengths]
    batch = torch.full((len(clips), max(lengths)), 5.0, dtype=torch.float64)  # padding is ignored
    for row, clip in enumerate(clips):
        batch[row, : clip.numel()] = clip
    codes, counts = codec.encode_with_lengths(batch, torch.tensor(lengths))
    assert counts.tolist() == [24, 1, 11, 1, 13] and counts.dtype == torch.long
    assert codes.shape == (5, 4, 24) and torch.equal(codec.encode(batch, lengths), codes)
    for row, clip in enumerate(clips):
        alone = codec.encode(clip)
        assert alone.shape[-1] == counts[row]
        assert torch.equal(codes[row, :, : counts[row]], alone[0]), row
    # Without lengths every row is T samples long: the padding is audio then (row 2's last
    # frame, 1 sample of clip and 15 of padding, changes).
    unmasked, full = codec.encode_with_lengths(batch)
    assert full.tolist() == [24] * 5 and torch.equal(unmasked[2, :, :10], codes[2, :, :10])
    assert not torch.equal(unmasked[2, :, 10], codes[2, :, 10])
    with pytest.raises(ValueError, match="entries"):
        codec.encode_with_lengths(batch, [379, 16])
    with pytest.raises(ValueError, match="within"):
        codec.encode(batch, [380, 1, 1, 1, 1])
