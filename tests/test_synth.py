"""`shoal demo-checkpoint` then `shoal synth` on it, end to end on the CPU: every output format
decodes back (PyAV) at the right rate and length, with and without a reference clip."""

from __future__ import annotations

import io
from pathlib import Path

import av
import numpy as np
import pytest

from shoal.cli import main
from shoal.server.audio import encode_audio
from shoal.synth import output_format

MAX_FRAMES = 12
FRAME_LENGTH = 2048  # samples per frame at 44.1 kHz, as in the official codec
TEXT = "Hello from Shoal. Ünïcödé and 中文 are bytes too."


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("demo") / "checkpoint"
    assert main(["demo-checkpoint", str(directory)]) == 0
    return directory


@pytest.fixture(scope="module")
def reference_clip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rate = 22050  # not the codec rate: the clip is resampled on the way in
    t = np.arange(rate) / rate
    path = tmp_path_factory.mktemp("ref") / "voice.wav"
    path.write_bytes(encode_audio((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), "wav"))
    return path


def synth(demo_dir: Path, output: Path, *extra: str, seed: int = 7) -> int:
    argv = ["synth", TEXT, "--checkpoint", str(demo_dir), "-o", str(output), "--quiet"]
    return main([*argv, "--max-frames", str(MAX_FRAMES), "--seed", str(seed), *extra])


def decode_file(path: Path) -> tuple[int, int]:
    """(samples, sample rate) as FFmpeg decodes the file."""
    samples, rate = 0, 0
    with av.open(io.BytesIO(path.read_bytes())) as container:
        for frame in container.decode(audio=0):
            samples += frame.samples
            rate = frame.sample_rate
    return samples, rate


def test_demo_checkpoint_has_the_s2_layout(demo_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from shoal.models import load_model
    from shoal.models.codec import load_codec

    names = {p.name for p in demo_dir.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json", "codec.pth"} <= names
    assert sum(name.endswith(".safetensors") for name in names) == 2
    model = load_model(demo_dir)
    assert model.family == "s2"
    tokenizer = model.tokenizer
    ids = tokenizer.encode(TEXT + "<|im_end|>")
    assert ids[-1] == tokenizer.im_end_id == model.config.im_end_id
    assert tokenizer.decode(ids[:-1]) == TEXT
    assert tokenizer.token_id("<|voice|>") != tokenizer.token_id("<|im_start|>")
    assert tokenizer.semantic_id(0) == model.config.semantic_begin_id
    assert model.config.semantic_end_id - model.config.semantic_begin_id + 1 == model.config.codebook_size
    codec = load_codec(demo_dir / "codec.pth")
    assert (codec.sample_rate, codec.frame_length, codec.num_codebooks) == (44100, FRAME_LENGTH, 10)
    # Refuses to overwrite, and says the audio is noise when it writes.
    assert main(["demo-checkpoint", str(demo_dir)]) == 1
    assert main(["demo-checkpoint", str(demo_dir / "again")]) == 0
    assert "noise" in capsys.readouterr().out


def test_every_format_decodes_at_the_right_rate_and_length(demo_dir: Path, tmp_path: Path) -> None:
    assert synth(demo_dir, tmp_path / "out.pcm") == 0
    samples = len((tmp_path / "out.pcm").read_bytes()) // 2  # s16le at 44.1 kHz
    assert 0 < samples <= (MAX_FRAMES - 1) * FRAME_LENGTH and samples % FRAME_LENGTH == 0

    assert synth(demo_dir, tmp_path / "out.wav") == 0
    assert decode_file(tmp_path / "out.wav") == (samples, 44100)

    assert synth(demo_dir, tmp_path / "out.mp3", "--mp3-bitrate", "64") == 0
    mp3_samples, mp3_rate = decode_file(tmp_path / "out.mp3")
    assert mp3_rate == 44100 and samples <= mp3_samples <= samples + 2 * 1152

    assert synth(demo_dir, tmp_path / "out.ogg", "--opus-bitrate", "32") == 0
    opus_samples, opus_rate = decode_file(tmp_path / "out.ogg")
    assert opus_rate == 48000 and abs(opus_samples - samples * 48000 / 44100) <= 48


def test_sample_rate_and_speed_options(demo_dir: Path, tmp_path: Path) -> None:
    assert synth(demo_dir, tmp_path / "base.wav") == 0
    base, _ = decode_file(tmp_path / "base.wav")
    assert synth(demo_dir, tmp_path / "low.wav", "--sample-rate", "16000") == 0
    low, rate = decode_file(tmp_path / "low.wav")
    assert rate == 16000 and abs(low - base * 16000 / 44100) <= 1
    assert synth(demo_dir, tmp_path / "fast.wav", "--speed", "2.0") == 0
    fast, _ = decode_file(tmp_path / "fast.wav")
    assert abs(fast - base / 2) < 0.05 * base


def test_with_a_reference_clip(demo_dir: Path, reference_clip: Path, tmp_path: Path) -> None:
    voice = ["--reference", str(reference_clip), "--reference-text", "A low hum."]
    assert synth(demo_dir, tmp_path / "voiced.mp3", *voice) == 0
    samples, rate = decode_file(tmp_path / "voiced.mp3")
    assert rate == 44100 and samples > 0
    # The reference changes the prompt, so (same seed) the audio differs from the unvoiced one.
    assert synth(demo_dir, tmp_path / "voiced.pcm", *voice) == 0
    assert synth(demo_dir, tmp_path / "plain.pcm") == 0
    assert (tmp_path / "voiced.pcm").read_bytes() != (tmp_path / "plain.pcm").read_bytes()


def test_same_seed_same_audio(demo_dir: Path, tmp_path: Path) -> None:
    assert synth(demo_dir, tmp_path / "a.pcm", seed=3) == 0
    assert synth(demo_dir, tmp_path / "b.pcm", seed=3) == 0
    assert (tmp_path / "a.pcm").read_bytes() == (tmp_path / "b.pcm").read_bytes()


def test_bad_inputs_fail_with_a_message(
    demo_dir: Path, reference_clip: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    silent = tmp_path / "silent.wav"
    silent.write_bytes(encode_audio(np.zeros(4410, np.float32), "wav"))
    assert synth(demo_dir, tmp_path / "x.wav", "--reference", str(silent), "--reference-text", "hi") == 1
    assert "silent" in capsys.readouterr().err
    assert synth(demo_dir, tmp_path / "x.wav", "--reference", str(reference_clip)) == 1
    assert "--reference-text" in capsys.readouterr().err
    assert synth(demo_dir, tmp_path / "x.opus", "--sample-rate", "44100") == 2
    assert "opus sample_rate" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists() and not (tmp_path / "x.wav.part").exists()


def test_output_format_from_suffix() -> None:
    assert output_format(None, Path("a.mp3")) == "mp3"
    assert output_format(None, Path("a.ogg")) == "opus"
    assert output_format(None, Path("a.raw")) == "pcm"
    assert output_format(None, Path("a.out")) == "wav"
    assert output_format("mp3", Path("a.wav")) == "mp3"
