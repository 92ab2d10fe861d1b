"""Fish Speech 1.5's codec (`models/codec_firefly.py`) against the reference implementation.

`tests/data/firefly_tiny` was written by `scripts/make_firefly_golden.py` with fish-speech's own
code at v1.5.1 (random weights, tiny dims, float32 on the CPU): the generator file is the
reference model's `state_dict()`, `golden.pt` its log-mel, codes and decoded audio.
`tests/data/firefly_full_manifest.json` is every tensor name and shape of the reference built
with the shipped configuration."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from shoal.models.codec import Codec, codec_file, load_codec, official_layout
from shoal.models.codec_firefly import (
    FIREFLY_FILE,
    FireflyCodec,
    FireflyConfig,
    load_firefly_codec,
    save_random_firefly_codec,
)

DATA = Path(__file__).parent / "data"
TINY = DATA / "firefly_tiny"


@pytest.fixture(scope="module")
def golden():
    return torch.load(TINY / "golden.pt", weights_only=True)


@pytest.fixture(scope="module")
def codec():
    return load_firefly_codec(TINY / "codec.pth")


def test_log_mel_codes_and_audio_equal_the_reference(codec, golden):
    mel = codec.spec_transform(golden["audio_in"][None])
    torch.testing.assert_close(mel[0], golden["mel"], rtol=0, atol=1e-5)
    codes = codec.encode(golden["audio_in"])
    assert codes.shape == golden["codes"].shape == (1, 4, 16)
    assert torch.equal(codes, golden["codes"].long())
    assert golden["codes"].unique().numel() > 8, "premise: the clip uses many codes"
    audio = codec.decode(golden["decode_codes"])
    assert audio.shape == golden["decode_audio"].shape == (1, 1, 24 * codec.frame_length)
    assert golden["decode_audio"].std() > 0.3, "premise: the decoder is far from silent"
    torch.testing.assert_close(audio, golden["decode_audio"], rtol=0, atol=1e-5)
    prefix = codec.decode(golden["decode_codes"][..., :10])
    torch.testing.assert_close(prefix, golden["decode_prefix10_audio"], rtol=0, atol=1e-5)
    torch.testing.assert_close(prefix, audio[..., : 10 * codec.frame_length], rtol=0, atol=1e-5)  # causal


def test_the_shipped_configuration_builds_the_reference_module_tree() -> None:
    manifest = json.loads((DATA / "firefly_full_manifest.json").read_text())
    with torch.device("meta"):
        full = FireflyCodec()
    assert official_layout(full) == {name: tuple(shape) for name, shape in manifest.items()}
    assert sum(p.numel() for p in full.parameters()) == pytest.approx(47.1e6, rel=1e-3)
    assert (full.sample_rate, full.frame_length, full.num_codebooks) == (44100, 2048, 8)


def _forms(state: dict[str, torch.Tensor]) -> dict[str, dict]:
    """The golden state dict as every form a generator file may take."""
    legacy, folded = {}, {}
    for key, value in state.items():
        if ".parametrizations.weight.original" in key:
            owner = key.split(".parametrizations")[0]
            legacy[f"{owner}.weight_{'g' if key.endswith('0') else 'v'}"] = value
            if key.endswith("0"):
                folded[f"{owner}.weight"] = torch._weight_norm(
                    state[f"{owner}.parametrizations.weight.original1"], value, 0
                )
        else:
            legacy[key] = folded[key] = value
    generator = {f"generator.{k}": v for k, v in state.items()}
    wrapped = {"state_dict": generator | {"discriminator.x": torch.ones(1)}}  # a training checkpoint
    return {"legacy": legacy, "folded": folded, "wrapped": wrapped}


def test_every_stored_form_loads_the_same_codec(tmp_path, codec, golden) -> None:
    state = torch.load(TINY / "codec.pth", weights_only=True)
    assert any(".parametrizations.weight.original0" in key for key in state), "premise: the reference's form"
    want = codec.decode(golden["decode_codes"])
    for name, form in _forms(state).items():
        path = tmp_path / name / FIREFLY_FILE
        path.parent.mkdir()
        torch.save(form, path)
        shutil.copy(TINY / "codec_config.json", path.parent)
        loaded = load_codec(path.parent)  # a directory: `codec_file` finds the generator
        assert isinstance(loaded, FireflyCodec), name
        torch.testing.assert_close(loaded.decode(golden["decode_codes"]), want, rtol=0, atol=1e-6)


def test_a_generator_that_does_not_match_is_refused(tmp_path) -> None:
    state = torch.load(TINY / "codec.pth", weights_only=True)
    broken = dict(state)
    broken.pop("head.conv_post.conv.bias")
    broken["head.extra.weight"] = torch.zeros(1)
    broken["backbone.norm.weight"] = torch.zeros(7)
    config = json.loads((TINY / "codec_config.json").read_text())
    with pytest.raises(ValueError) as error:
        load_firefly_codec(tmp_path / "x.pth", config=config, state=broken)
    message = str(error.value)
    assert "missing: head.conv_post.conv.bias" in message
    assert "unexpected: head.extra.weight" in message
    assert "mis-shaped: backbone.norm.weight (7,)" in message


def test_codec_file_and_load_codec_tell_the_two_codecs_apart(tmp_path, golden_dir) -> None:
    assert isinstance(load_codec(golden_dir / "codec_tiny"), Codec)
    assert codec_file(tmp_path) == tmp_path / "codec.pth"  # neither: the error names codec.pth
    shutil.copy(TINY / "codec.pth", tmp_path / FIREFLY_FILE)
    assert codec_file(tmp_path) == tmp_path / FIREFLY_FILE
    with pytest.raises(ValueError, match="missing"):  # no codec_config.json: the shipped sizes
        load_codec(tmp_path)
    shutil.copy(TINY / "codec_config.json", tmp_path)
    assert isinstance(load_codec(tmp_path), FireflyCodec)


def test_encode_refuses_audio_too_short_for_a_frame(codec) -> None:
    with pytest.raises(ValueError, match="too short"):
        codec.encode(torch.zeros(20))


def test_out_of_codebook_indices_wrap_instead_of_failing(codec) -> None:
    """The 1.5 model's codebook heads have 1,024 entries, the quantizer 1,000 codes: an index
    past them (which a trained model does not draw) decodes as its mixed-radix wrap."""
    assert codec.config.codebook_size == 1000
    codes = torch.tensor([[[1000, 1023]] * 4])
    torch.testing.assert_close(codec.decode(codes), codec.decode(codes % 1000), rtol=0, atol=0)


def _stream(pool, codes_per_stream, schedules, forget: bool = False):
    """Each stream's audio, fed in the schedules' chunks; `forget`: every carried state zeroed
    between steps (streaming without the context)."""
    streams = [pool.open() for _ in codes_per_stream]
    out = [[] for _ in streams]
    done = [0] * len(streams)
    for step in range(max(len(s) for s in schedules)):
        takes = [s[step] if step < len(s) else 0 for s in schedules]
        pieces = [c[:, d : d + t] for c, d, t in zip(codes_per_stream, done, takes, strict=True)]
        for i, audio in enumerate(pool.step(streams, pieces)):
            out[i].append(audio)
        done = [d + t for d, t in zip(done, takes, strict=True)]
        if forget:
            for state in pool.states.values():
                state.zero_()
    for stream in streams:
        stream.close()
    return [torch.cat(parts) for parts in out], streams


def test_streaming_equals_the_full_decode(codec) -> None:
    """Streams of different lengths fed in uneven chunks (zero-frame steps included), batched in
    one pool step each time: each stream's audio is its full decode. Without the carried
    context the audio differs, so the state is what makes it exact."""
    g = torch.Generator().manual_seed(5)
    codes = [torch.randint(0, 1000, (4, n), generator=g) for n in (40, 23, 9)]
    schedules = [[1, 3, 0, 8, 8, 20], [5, 0, 2, 16], [4, 5]]
    pool = codec.stream_pool(3)
    assert set(pool.states) == set(codec.stream_state_shapes())
    assert "head.conv_post" in pool.states and "quantizer.upsample.0.1.dwconv" in pool.states
    audio, streams = _stream(pool, codes, schedules)
    for got, c, stream in zip(audio, codes, streams, strict=True):
        want = codec.decode(c)[0, 0]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert stream.frames == c.shape[1] and stream.slot is None
    forgot, _ = _stream(codec.stream_pool(3), codes, schedules, forget=True)
    assert (forgot[0] - codec.decode(codes[0])[0, 0]).abs().max() > 1e-3


def test_stream_pool_has_a_slot_per_stream(codec) -> None:
    pool = codec.stream_pool(2)
    first, second = pool.open(), pool.open()
    with pytest.raises(RuntimeError, match="in use"):
        pool.open()
    slot = first.slot
    first.close()
    assert first.slot is None and pool.open().slot == slot
    with pytest.raises(ValueError, match="once per step"):
        pool.step([second, second], [torch.zeros(4, 1, dtype=torch.long)] * 2)


@pytest.mark.gpu
def test_streaming_graphs_equal_eager_steps_on_the_gpu() -> None:
    """The pool's CUDA graphs (a batch bucket, a chunk) replay the Firefly step: the same audio
    as eager steps of the same shapes (4 rows x 4 frames: the bucket's, so the same kernels), and
    the full decode within bf16 noise."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    codec = load_firefly_codec(TINY / "codec.pth", device="cuda", dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(6)
    codes = [torch.randint(0, 1000, (4, 24), generator=g) for _ in range(4)]
    schedules = [[4] * 6] * 4
    graphed = codec.stream_pool(4)
    graphed.capture_cuda_graphs([4], [4])
    with_graphs, _ = _stream(graphed, codes, schedules)
    eager, _ = _stream(codec.stream_pool(4), codes, schedules)
    for a, b, c in zip(with_graphs, eager, codes, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        want = codec.decode(c.cuda())[0, 0].float()
        assert ((a.float() - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()) < 0.05


def test_random_firefly_codec_round_trips_through_its_files(tmp_path) -> None:
    config = FireflyConfig(
        n_mels=32, encoder_depths=[1, 1], encoder_dims=[16, 32], fsq_groups=4, decoder_channels=32,
        resblock_kernel_sizes=[3], resblock_dilation_sizes=[[1, 3, 5]],
    )  # fmt: skip
    path = save_random_firefly_codec(tmp_path, config, seed=3)
    assert path.name == FIREFLY_FILE and (tmp_path / "codec_config.json").is_file()
    codec = load_codec(tmp_path)
    assert isinstance(codec, FireflyCodec) and codec.config == config
    audio = codec.decode(torch.randint(0, 1000, (2, 4, 5)))
    assert audio.shape == (2, 1, 5 * 2048) and bool(torch.isfinite(audio).all())
    assert codec.encode(audio[:, 0]).shape == (2, 4, 5)


# ---- Fish Speech 1.5 end to end: the engine and `shoal synth` with its codec -------------------

# A 44.1 kHz Firefly small enough for the CPU (the frame is the shipped 2,048 samples).
SMALL_44K = FireflyConfig(
    n_mels=32, encoder_depths=[1, 1], encoder_dims=[16, 32], fsq_groups=4, decoder_channels=32,
    resblock_kernel_sizes=[3, 5], resblock_dilation_sizes=[[1, 3, 5], [1, 2, 3]],
)  # fmt: skip


@pytest.fixture(scope="module")
def v15_checkpoint(tmp_path_factory) -> Path:
    """A tiny 1.5 model (tiktoken tokenizer, 4 codebooks of 1,024 entries, as the shipped model's:
    room for the quantizer's 1,000 codes) with a random Firefly generator beside it."""
    from shoal.models.writer import tiny_config, write_checkpoint

    directory = tmp_path_factory.mktemp("v15")
    write_checkpoint(directory, tiny_config("1.5").replace(codebook_size=1024), dtype=torch.float32)
    save_random_firefly_codec(directory, SMALL_44K, seed=1)
    return directory


def test_load_engine_streams_1_5_audio_equal_to_one_decode(v15_checkpoint) -> None:
    """`load_engine` finds the generator in the checkpoint directory; the vocoder streams its
    audio through streaming steps in chunks of 3 frames, equal to one decode of all the frames."""
    from test_engine_api import synthesize_on_thread

    from shoal.config import EngineConfig
    from shoal.engine.api import FinishReason, SamplingOptions, SynthesisRequest
    from shoal.engine.load import load_engine

    config = EngineConfig(num_pages=256, page_size=4, vocoder_chunk_frames=3, ignore_eos=True)
    engine = load_engine(v15_checkpoint, device="cpu", dtype="float32", config=config, warmup=False)
    assert isinstance(engine.codec, FireflyCodec) and engine.core.model.config.family == "1.5"
    options = SamplingOptions(seed=4)
    request = SynthesisRequest("One two three, four five.", max_new_frames=14, sampling=options)
    handle, chunks = synthesize_on_thread(engine, request)
    assert handle.finish_reason == FinishReason.LENGTH
    frames = np.concatenate([c.frames for c in chunks])
    audio = np.concatenate([c.samples for c in chunks])
    # A batch's last frame is not spoken. How many chunks depends on how far the vocoder falls
    # behind on a busy machine (it decodes what has accumulated); more than one is streaming.
    assert frames.shape == (13, 5) and len(chunks) >= 2
    want = engine.codec.decode(torch.from_numpy(frames[:, 1:].T.copy()))[0, 0].numpy()
    assert audio.shape == want.shape == (13 * 2048,) and np.abs(want).max() > 0
    np.testing.assert_allclose(audio, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_shoal_synth_speaks_a_1_5_checkpoint_with_a_reference_clip(v15_checkpoint, tmp_path) -> None:
    import av

    from shoal.cli import main
    from shoal.server.audio import encode_audio

    t = np.arange(22050) / 22050  # one second at another rate: resampled to 44.1 kHz, then encoded
    clip = tmp_path / "voice.wav"
    clip.write_bytes(encode_audio((0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), "wav"))
    output = tmp_path / "out.wav"
    argv = ["synth", "Hello there.", "--checkpoint", str(v15_checkpoint), "-o", str(output), "--quiet"]
    argv += ["--reference", str(clip), "--reference-text", "A voice.", "--max-frames", "6", "--seed", "3"]
    assert main(argv) == 0
    with av.open(str(output)) as container:
        decoded = [frame for frame in container.decode(audio=0)]
    assert decoded[0].sample_rate == 44100
    samples = sum(frame.samples for frame in decoded)
    assert samples > 0 and samples % 2048 == 0


def test_codec_bench_times_the_firefly_codec(codec, capsys) -> None:
    """`shoal bench codec --codec firefly`'s rows on the tiny codec (on the CPU: no graph rows):
    eager streaming, the naive re-decode and the encoder; no accuracy row (the modded DAC's)."""
    from shoal.bench.codec import run_codec_bench

    rows = run_codec_bench(
        streams=[2], chunks=[3], steps=2, dtype=torch.float32, device="cpu", encode_seconds=0.2, codec=codec
    )
    assert [row["mode"] for row in rows] == ["eager", "redecode", "encode"]
    assert all(row["frames_per_s"] > 0 for row in rows[:2]) and rows[2]["audio_s_per_s_b16"] > 0
    assert "eager" in capsys.readouterr().out


def test_bfloat16_codec_encodes_and_decodes_within_bf16_noise(golden) -> None:
    """The GPU's dtype: the log-mel stays in fp32, the quantizer's arithmetic in fp32 (the codes
    equal the reference's here), the decoder within bf16 rounding of the fp32 reference."""
    codec = load_firefly_codec(TINY / "codec.pth", dtype=torch.bfloat16)
    assert codec.dtype == torch.bfloat16 and codec.spec_transform.filters.dtype == torch.float32
    assert torch.equal(codec.encode(golden["audio_in"]), golden["codes"].long())
    audio = codec.decode(golden["decode_codes"]).float()
    want = golden["decode_audio"]
    assert ((audio - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()) < 0.05
    pool = codec.stream_pool(1)
    stream = pool.open()
    assert pool.step([stream], [golden["decode_codes"][0, :, :5]])[0].dtype == torch.bfloat16


def test_a_reference_clip_too_short_to_encode_is_a_bad_request(v15_checkpoint) -> None:
    """The server turns the engine's `InvalidRequest` into a 400 in the API's error format; a
    plain ValueError from the codec would have been a 500."""
    import asyncio

    from shoal.config import EngineConfig
    from shoal.engine.api import InvalidRequest
    from shoal.engine.load import load_engine

    engine = load_engine(v15_checkpoint, device="cpu", config=EngineConfig(num_pages=64), warmup=False)
    with pytest.raises(InvalidRequest, match="reference audio: audio of 441 samples is too short"):
        asyncio.run(engine.encode_reference(np.zeros(441, np.float32), 44100))
    assert asyncio.run(engine.encode_reference(np.zeros(44100, np.float32), 44100)).shape == (4, 22)
