"""`shoal demo-checkpoint` then `shoal synth` on it, end to end on the CPU: every output format
decodes back (PyAV) at the right rate and length, with and without a reference clip."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import av
import numpy as np
import pytest

from shoal.cli import main
from shoal.server.audio import AudioFormatError, encode_audio
from shoal.synth import Synthesizer, output_format

MAX_FRAMES = 8
FRAME_LENGTH = 2048  # samples per frame at 44.1 kHz, as in the official codec
SEED = 7
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


@pytest.fixture(scope="module")
def pcm_samples(demo_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The CLI's raw s16le output for TEXT and SEED: the length every format must decode to."""
    output = tmp_path_factory.mktemp("pcm") / "out.pcm"
    assert synth(demo_dir, output) == 0
    return np.frombuffer(output.read_bytes(), "<i2")


def synth(demo_dir: Path, output: Path, *extra: str) -> int:
    argv = ["synth", TEXT, "--checkpoint", str(demo_dir), "-o", str(output), "--quiet", "--seed", str(SEED)]
    return main([*argv, "--max-frames", str(MAX_FRAMES), *extra])


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
    # Refuses to overwrite an existing checkpoint.
    assert main(["demo-checkpoint", str(demo_dir)]) == 1
    assert "--overwrite" in capsys.readouterr().err


def test_demo_checkpoint_says_the_audio_is_noise(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["demo-checkpoint", str(tmp_path / "demo"), "--seed", "1"]) == 0
    assert "noise" in capsys.readouterr().out


def test_pcm_is_whole_codec_frames(pcm_samples: np.ndarray) -> None:
    assert 0 < len(pcm_samples) <= (MAX_FRAMES - 1) * FRAME_LENGTH
    assert len(pcm_samples) % FRAME_LENGTH == 0
    assert np.abs(pcm_samples).max() > 0


@pytest.mark.parametrize(
    ("name", "options", "rate"),
    [
        ("out.wav", ["--sample-rate", "16000"], 16000),
        ("out.mp3", ["--mp3-bitrate", "64"], 44100),
        ("out.ogg", ["--opus-bitrate", "32"], 48000),
    ],
)
def test_each_format_decodes_at_the_right_rate_and_length(
    demo_dir: Path, pcm_samples: np.ndarray, tmp_path: Path, name: str, options: list[str], rate: int
) -> None:
    assert synth(demo_dir, tmp_path / name, *options) == 0
    samples, decoded_rate = decode_file(tmp_path / name)
    expected = len(pcm_samples) * rate / 44100
    assert decoded_rate == rate
    if name.endswith(".wav"):
        assert abs(samples - expected) <= 1
    elif name.endswith(".mp3"):
        assert expected <= samples <= expected + 2 * 1152
    else:
        assert abs(samples - expected) <= rate / 1000


def test_with_a_reference_clip(demo_dir: Path, reference_clip: Path, tmp_path: Path) -> None:
    voice = ["--reference", str(reference_clip), "--reference-text", "A low hum."]
    assert synth(demo_dir, tmp_path / "voiced.mp3", *voice) == 0
    samples, rate = decode_file(tmp_path / "voiced.mp3")
    assert rate == 44100 and samples > 0


def test_synthesizer_is_deterministic_and_uses_the_reference(
    demo_dir: Path, pcm_samples: np.ndarray, reference_clip: Path
) -> None:
    from shoal.synth import read_reference_clips

    [(clip, text)] = read_reference_clips([reference_clip], ["A low hum."])

    async def both() -> tuple[np.ndarray, np.ndarray, object]:
        async with Synthesizer(demo_dir) as synthesizer:
            plain = [a async for a in synthesizer.stream(TEXT, seed=SEED, max_frames=MAX_FRAMES)]
            reference = await synthesizer.reference(clip, text)
            voiced = [
                a async for a in synthesizer.stream(TEXT, [reference], seed=SEED, max_frames=MAX_FRAMES)
            ]
        return np.concatenate(plain), np.concatenate(voiced), reference

    plain, voiced, reference = asyncio.run(both())
    # The same frames and audio as the CLI's pcm file (which rounds to 16 bits).
    assert np.array_equal(np.round(plain * 32767).astype(np.int16), pcm_samples)
    assert reference.codes.shape == (10, -(-len(clip) // FRAME_LENGTH))
    common = min(len(voiced), len(plain))
    assert common > 0 and not np.array_equal(voiced[:common], plain[:common])


def test_long_text_runs_batch_by_batch_with_progress(
    demo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Six text batches (one per speaker turn) of at most 4 frames each: the progress line
    counts frames and audio seconds against that bound, and the last line says where the file
    went."""
    from shoal.models.prompt import split_text

    text = "".join(f"<|speaker:{i % 2}|>Turn number {i} of a longer dialogue, said aloud. " for i in range(6))
    batches = split_text(text, 100, "s2")
    assert len(batches) == 6
    output = tmp_path / "long.pcm"
    argv = ["synth", text, "--checkpoint", str(demo_dir), "-o", str(output), "--seed", str(SEED)]
    assert main([*argv, "--max-frames", "4", "--chunk-length", "100"]) == 0
    samples = len(output.read_bytes()) // 2
    # Each batch's last frame is not decoded (it carries <|im_end|> or ends at the cap).
    assert samples % FRAME_LENGTH == 0 and len(batches) < samples // FRAME_LENGTH <= len(batches) * 3
    err = capsys.readouterr().err
    frames = samples // FRAME_LENGTH
    assert f"{frames} frames, {frames * FRAME_LENGTH / 44100:.1f} s of audio" in err
    assert "ETA" in err and "frames/s" in err
    assert f"wrote {output.resolve()} (pcm, 44100 Hz" in err.splitlines()[-1]


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
    assert synth(tmp_path / "missing", tmp_path / "x.wav") == 1
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "x.wav").exists() and not (tmp_path / "x.wav.part").exists()


def test_unusable_arguments_and_outputs_fail_with_a_message(
    demo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Caught up front (status 2) or as an error line (status 1): never a traceback, never a
    stray `.part` file, never an empty `-o` file written with status 0."""
    argv = ["synth", "--checkpoint", str(demo_dir), "--quiet", "--max-frames", "4"]
    assert main([*argv[:1], "  ", *argv[1:], "-o", str(tmp_path / "e.wav")]) == 2
    assert "text is empty" in capsys.readouterr().err
    assert synth(demo_dir, tmp_path / "z.wav", "--max-frames", "0") == 2
    assert "--max-frames" in capsys.readouterr().err
    assert synth(demo_dir, tmp_path) == 2  # -o names a directory
    assert "directory" in capsys.readouterr().err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert synth(demo_dir, blocker / "x.wav") == 1  # the output's parent cannot be created
    assert "error:" in capsys.readouterr().err
    leftovers = [p.name for p in tmp_path.parent.glob(f"{tmp_path.name}*.part")] + list(tmp_path.glob("*"))
    assert leftovers == [blocker]


def test_demo_checkpoint_unwritable_target_is_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["demo-checkpoint", str(blocker)]) == 1
    assert "not a directory" in capsys.readouterr().err
    assert main(["demo-checkpoint", str(blocker / "demo")]) == 1
    assert "could not write" in capsys.readouterr().err


def test_output_format_from_suffix() -> None:
    assert output_format(None, Path("a.mp3")) == "mp3"
    assert output_format(None, Path("a.ogg")) == "opus"
    assert output_format(None, Path("a.OPUS")) == "opus"
    assert output_format(None, Path("a.raw")) == "pcm"
    assert output_format(None, Path("a.pcm")) == "pcm"
    assert output_format(None, Path("a.wav")) == "wav"
    assert output_format("mp3", Path("a.wav")) == "mp3"
    assert output_format("wav", Path("a.flac")) == "wav"
    for name in ("a.flac", "a.out", "noext"):
        with pytest.raises(AudioFormatError, match="--format"):
            output_format(None, Path(name))


def test_an_unsupported_suffix_fails_before_any_work(
    demo_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert synth(demo_dir, tmp_path / "x.flac") == 2
    assert "suffix .flac" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
