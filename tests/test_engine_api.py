"""The server-facing Engine API: text in, streamed audio out, long text in batches."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from shoal.config import EngineConfig
from shoal.engine.api import FinishReason, SamplingOptions, SynthesisRequest, VoiceReference
from shoal.engine.engine import LocalEngine
from shoal.models import load_model
from shoal.models.codec import load_codec
from shoal.models.prompt import Reference
from shoal.models.reference import generate_long


@pytest.fixture(scope="module")
def model(golden_dir):
    model = load_model(golden_dir / "s2_tiny", dtype=torch.float64)
    model.config = model.config.replace(max_seq_len=512)
    model.build_rope_tables("cpu")
    return model


@pytest.fixture(scope="module")
def codec(golden_dir):
    return load_codec(golden_dir / "codec_tiny")


async def synthesize(engine: LocalEngine, request: SynthesisRequest):
    handle = engine.submit(request)
    chunks = [chunk async for chunk in handle]
    return handle, chunks


def test_long_text_streams_audio_of_the_reference_frames(model, codec):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 32, (4, 6), generator=g)
    voice = VoiceReference("a voice", codes.numpy())
    text = "<|speaker:0|>first turn here<|speaker:1|>and a second one"
    options = SamplingOptions(temperature=0.7, top_p=0.9, seed=21)
    request = SynthesisRequest(text, (voice,), sampling=options, max_new_frames=12, chunk_length=10)
    config = EngineConfig(device="cpu", dtype="float64", num_pages=256, page_size=4, vocoder_chunk_frames=3)
    engine = LocalEngine(model, config, codec=codec)

    async def scenario():
        engine.start_thread()
        try:
            return await asyncio.wait_for(synthesize(engine, request), 120)
        finally:
            engine.stop_thread()

    handle, chunks = asyncio.run(scenario())
    assert handle.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    oracle = generate_long(
        model,
        text,
        [Reference("a voice", codes)],
        chunk_length=10,
        max_frames=12,
        temperature=0.7,
        top_p=0.9,
        seed=21,
    )
    assert len(oracle) == 2  # two speaker turns: two batches, the second prompted with the first
    frames = np.concatenate([c.frames for c in chunks])
    expected = torch.cat([b.codes for b in oracle], dim=1)  # each batch without its last frame
    assert np.array_equal(frames[:, 1:].T, expected.numpy())
    audio = np.concatenate([c.samples for c in chunks])
    reference_audio = torch.cat([codec.decode(b.codes)[0, 0] for b in oracle]).numpy()
    assert audio.shape == reference_audio.shape
    np.testing.assert_allclose(audio, reference_audio, atol=1e-4)
    assert engine.core.kv.pool.num_used == engine.core.kv.prefix_cache_pages


def test_consumer_going_away_aborts(model):
    config = EngineConfig(device="cpu", dtype="float64", num_pages=256, page_size=4, ignore_eos=True)
    engine = LocalEngine(model, config)  # no codec: frames only

    async def scenario():
        engine.start_thread()
        try:
            handle = engine.submit(SynthesisRequest("hello there", max_new_frames=200))
            iterator = handle.__aiter__()
            first = await asyncio.wait_for(iterator.__anext__(), 60)
            await iterator.aclose()
            for _ in range(100):
                if not engine.core.requests:
                    break
                await asyncio.sleep(0.02)
            return first, handle
        finally:
            engine.stop_thread()

    first, handle = asyncio.run(scenario())
    assert first.frames.shape == (1, 5)
    assert not engine.core.requests and engine.core.kv.pool.num_used == engine.core.kv.prefix_cache_pages


def test_load_engine_on_a_demo_checkpoint(tmp_path):
    from shoal.demo import write_demo_checkpoint
    from shoal.engine import load_engine

    directory = write_demo_checkpoint(tmp_path / "demo")
    engine = load_engine(directory, device="cpu", dtype="float32")
    assert isinstance(engine, LocalEngine) and engine.codec is not None
    assert engine.core.model.embeddings.weight.dtype == torch.float32
    request = SynthesisRequest("Hello there.", sampling=SamplingOptions(seed=3), max_new_frames=6)

    async def scenario():
        await engine.start()
        try:
            return await asyncio.wait_for(synthesize(engine, request), 120)
        finally:
            await engine.stop()

    handle, chunks = asyncio.run(scenario())
    assert handle.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    frames = np.concatenate([c.frames for c in chunks])
    audio = np.concatenate([c.samples for c in chunks])
    assert frames.shape[1] == 11 and audio.size == frames.shape[0] * engine.codec.frame_length
    assert np.isfinite(audio).all()
    with pytest.raises(FileNotFoundError):
        load_engine(directory, codec=tmp_path / "missing.pth", device="cpu")
