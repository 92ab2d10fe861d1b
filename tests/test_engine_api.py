"""The server-facing Engine API: text in, streamed audio out, long text in batches."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import numpy as np
import pytest
import torch
from model_testing import tiny_s2

from shoal.config import EngineConfig
from shoal.engine.api import FinishReason, InvalidRequest, SamplingOptions, SynthesisRequest, VoiceReference
from shoal.engine.engine import LocalEngine
from shoal.engine.playback import PlaybackClock
from shoal.engine.request import SamplingParams
from shoal.engine.vocoder import ChunkPolicy, StreamState, Vocoder, graph_batch_sizes
from shoal.models import load_model
from shoal.models.codec import load_codec
from shoal.models.prompt import (
    V15_MAX_LENGTH,
    Reference,
    Turn,
    VoicePrompt,
    build_prompt,
    voice_prefix_length,
)
from shoal.models.reference import generate, generate_long
from shoal.models.writer import tiny_config, write_checkpoint


@pytest.fixture(scope="module")
def model(golden_dir):
    return tiny_s2(golden_dir, torch.float64, max_seq_len=512)


@pytest.fixture(scope="module")
def codec(golden_dir):
    return load_codec(golden_dir / "codec_tiny")


async def synthesize(engine: LocalEngine, request: SynthesisRequest):
    handle = engine.submit(request)
    chunks = [chunk async for chunk in handle]
    return handle, chunks


def synthesize_on_thread(engine: LocalEngine, request: SynthesisRequest):
    """(handle, chunks) of one request on the engine's own thread, started and stopped here."""

    async def scenario():
        engine.start_thread()
        try:
            return await asyncio.wait_for(synthesize(engine, request), 120)
        finally:
            engine.stop_thread()

    return asyncio.run(scenario())


def test_long_text_streams_audio_of_the_reference_frames(model, codec):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 32, (4, 6), generator=g)
    voice = VoiceReference("a voice", codes.numpy())
    text = "<|speaker:0|>first turn here<|speaker:1|>and a second one"
    options = SamplingOptions(temperature=0.7, top_p=0.9, seed=21)
    request = SynthesisRequest(text, (voice,), sampling=options, max_new_frames=12, chunk_length=10)
    config = EngineConfig(device="cpu", dtype="float64", num_pages=256, page_size=4, vocoder_chunk_frames=3)
    engine = LocalEngine(model, config, codec=codec)
    handle, chunks = synthesize_on_thread(engine, request)
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
    # Each chunk names the text batch it speaks, in order, so a consumer can time each one.
    assert [c.segment for c in chunks] == sorted(c.segment for c in chunks)
    assert {(c.segment, c.segment_text) for c in chunks} == set(enumerate(handle.texts))
    assert len(handle.texts) == 2
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


@pytest.mark.parametrize("prefilled", [False, True])
def test_requests_in_one_voice_share_its_prefix_pages(model, prefilled):
    """The engine keys a voice by its prefix's columns, once per request: two requests whose
    references are equal (not the same objects) borrow the same cached prefix pages, and the
    pages `prefill_voice` pins are the ones the following requests reuse."""
    config = EngineConfig(device="cpu", dtype="float64", num_pages=256, page_size=4, ignore_eos=True)
    engine = LocalEngine(model, config)
    codes = torch.randint(0, 32, (4, 10), generator=torch.Generator().manual_seed(4))
    voice = VoicePrompt(model.config, model.tokenizer, [Reference("a voice", codes)])
    whole = voice.prefix.shape[1] // config.page_size

    def pages_in_use() -> set[int]:
        return {page for page in range(config.num_pages) if engine.core.kv.pool.ref_count(page)}

    async def running(text: str):
        references = (VoiceReference("a voice", codes.numpy().copy()),)
        handle = engine.submit(SynthesisRequest(text, references, max_new_frames=200))
        iterator = handle.__aiter__()
        await asyncio.wait_for(iterator.__anext__(), 60)  # admitted and prefilled
        return handle, iterator

    async def scenario():
        engine.start_thread()
        try:
            pinned = set()
            if prefilled:
                await engine.prefill_voice((VoiceReference("a voice", codes.numpy()),))
                pinned = pages_in_use()
            (first, first_frames), (second, second_frames) = [await running(t) for t in ("one", "two")]
            requests = first.current, second.current
            shared = [request.block_table[:whole] for request in requests]
            keys = [request.prefix_key for request in requests]
            counts = [request.num_shared_pages for request in requests]
            await first_frames.aclose()
            await second_frames.aclose()
            return pinned, shared, keys, counts
        finally:
            engine.stop_thread()

    pinned, shared, keys, counts = asyncio.run(scenario())
    assert whole >= 2 and counts == [whole, whole]
    assert shared[0] == shared[1] and keys == [voice.key, voice.key]
    assert len(pinned) == (whole if prefilled else 0)
    if prefilled:
        assert set(shared[0]) == pinned
    assert engine.core.kv.prefix_cache_pages == whole == engine.core.kv.pool.num_used


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    from shoal.demo import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"))


def test_load_engine_on_a_demo_checkpoint(demo_checkpoint, tmp_path):
    from shoal.engine import load_engine

    directory = demo_checkpoint
    engine = load_engine(directory, device="cpu", dtype="float32", warmup=False)
    assert engine.warmup_report is None
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


def test_load_engine_warms_up_and_leaves_no_trace(demo_checkpoint):
    from shoal.engine import load_engine

    engine = load_engine(demo_checkpoint, device="cpu", dtype="float32")  # warm-up by default
    cold = load_engine(demo_checkpoint, device="cpu", dtype="float32", warmup=False)
    report = engine.warmup_report
    assert report is not None and cold.warmup_report is None
    # Two requests completed in one prefill step, a prompt longer than the step's budget
    # (chunked), a few decode steps, then the vocoder's first chunk and a full chunk.
    short_a, short_b, long = report.prompt_lengths
    assert long > report.prefill_tokens >= short_a + short_b and report.steps >= 5
    assert report.vocoder_chunks == (
        engine.config.vocoder_first_chunk_frames,
        engine.config.vocoder_chunk_frames,
    )
    core = engine.core
    assert not core.has_work and not core.requests and core.kv.pool.num_used == 0
    assert core.kv.prefix_cache_pages == 0 and core.steps == core.frames_out == 0
    gate = core.scheduler.gate  # the warm-up's steps compiled kernels: their times are dropped
    assert gate.step_seconds is None and gate.prefill_seconds_per_token is None
    stats = engine.stats()
    assert stats.running == 0 and set(stats.waiting.values()) == {0} and stats.pages_used == 0
    assert stats.steps_per_second == stats.frames_per_second == 0.0
    assert not engine.vocoder._streams and len(engine.vocoder.pool._free) == engine.vocoder.max_streams

    model = core.model
    prompt = build_prompt(model.config, model.tokenizer, "Hello there, friend.", ())
    request = SynthesisRequest(
        "Hello there, friend.", sampling=SamplingOptions(temperature=0.7, top_p=0.9, seed=5), max_new_frames=9
    )

    async def first_requests(target: LocalEngine):
        await target.start()
        try:
            stream = target.submit_frames(prompt, SamplingParams(0.7, 0.9, seed=5), max_new_frames=9)
            frames = await asyncio.wait_for(stream.collect(), 120)
            _, chunks = await asyncio.wait_for(synthesize(target, request), 120)
            return frames, chunks
        finally:
            await target.stop()

    frames, chunks = asyncio.run(first_requests(engine))
    oracle = generate(model, prompt, max_frames=9, temperature=0.7, top_p=0.9, seed=5)
    assert frames.shape[1] > 0 and torch.equal(frames, oracle)
    cold_frames, cold_chunks = asyncio.run(first_requests(cold))
    assert torch.equal(cold_frames, frames)
    audio = np.concatenate([c.samples for c in chunks])
    assert audio.size > 0 and np.array_equal(audio, np.concatenate([c.samples for c in cold_chunks]))
    assert np.array_equal(
        np.concatenate([c.frames for c in chunks]), np.concatenate([c.frames for c in cold_chunks])
    )
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages and core.steps > 0  # counted now

    engine.start_thread()
    try:
        with pytest.raises(RuntimeError, match="before the engine is started"):
            engine.warmup()
    finally:
        engine.stop_thread()


def test_warmup_fits_a_small_pool(model):
    # 24 pages of 4 tokens: the long prompt is cut so that all three fit at once.
    engine = LocalEngine(model, EngineConfig(device="cpu", dtype="float64", num_pages=24, page_size=4))
    report = engine.warmup()
    assert report.prompt_lengths == (5, 9, 60) and report.prefill_tokens == 64
    assert report.vocoder_chunks == () and engine.core.kv.pool.num_used == 0 and not engine.core.has_work


def test_chunk_policy_feeds_captured_chunks():
    eager = ChunkPolicy(chunk_frames=8, first_chunk_frames=4)  # CPU: the whole backlog once due
    assert [eager.take(n, False, False) for n in (3, 4, 6)] == [0, 4, 6]
    assert [eager.take(n, True, False) for n in (7, 8, 13)] == [0, 8, 13]
    assert eager.take(3, True, True) == 3 and eager.take(0, True, True) == 0
    chunks = ChunkPolicy.graph_chunk_sizes(8, 4)
    assert chunks == (4, 8) and graph_batch_sizes(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_batch_sizes(48)[-2:] == (32, 48)
    graphs = ChunkPolicy(8, 4, chunks, max_batch=2)
    assert [graphs.take(n, False, False) for n in (3, 4, 7, 9)] == [0, 4, 4, 8]  # first audio: prompt
    assert [graphs.take(n, True, False) for n in (7, 8, 15, 20)] == [0, 8, 8, 8]  # steady: full chunks
    assert [graphs.take(n, True, True) for n in (1, 5, 8, 13)] == [1, 5, 8, 8]  # tail: pads to a graph
    # At most max_batch streams per call, first audio before steady chunks, then in order.
    assert graphs.plan(
        [StreamState(8, True, False), StreamState(9, True, False), StreamState(4, False, False),
         StreamState(2, True, False)]
    ) == {2: 4, 0: 8}  # fmt: skip
    # Then the listener with the least audio buffered: stream 1 (0.1 s) before stream 0 (2 s).
    buffered = {seconds: PlaybackClock() for seconds in (2.0, 0.1)}
    for seconds, clock in buffered.items():
        clock.deliver(seconds, now=0.0)
    streams = [
        StreamState(8, True, False, buffered[2.0]), StreamState(9, True, False, buffered[0.1]),
        StreamState(8, True, False),
    ]  # fmt: skip
    assert graphs.plan(streams, now=0.0) == {1: 8, 0: 8}


def record_codec_chunks(vocoder: Vocoder) -> list[list[int]]:
    """The frames of each stream in each codec call the vocoder makes from now on."""
    calls: list[list[int]] = []
    step = vocoder.pool.step

    def recording_step(streams, codes):
        calls.append([c.shape[-1] for c in codes])
        return step(streams, codes)

    vocoder.pool.step = recording_step
    return calls


def test_chunk_policy_grows_chunks_up_to_the_largest():
    grow = ChunkPolicy(8, 4, max_chunk_frames=32)
    assert [grow.chunk_size(k) for k in range(6)] == [4, 8, 16, 32, 32, 32]
    assert ChunkPolicy(8, 4).chunk_size(5) == 8  # no growth unless asked
    assert ChunkPolicy.graph_chunk_sizes(8, 4, 32) == (4, 8, 16, 32)
    assert ChunkPolicy.graph_chunk_sizes(8, 4, 24) == (4, 8, 16, 24)
    assert ChunkPolicy.graph_chunk_sizes(8, 4, 8) == ChunkPolicy.graph_chunk_sizes(8, 4) == (4, 8)
    graphs = ChunkPolicy(8, 4, (4, 8, 16, 32), max_chunk_frames=32)
    # After two chunks the third is due at 16; a backlog gives the largest captured chunk it fills.
    assert [graphs.take(n, 2, False) for n in (15, 16, 31, 40)] == [0, 16, 16, 32]
    assert graphs.take(40, 2, True) == 32 and graphs.take(5, 2, True) == 5
    # Graphs captured beyond the policy's largest chunk are used for tails only.
    capped = ChunkPolicy(8, 4, (4, 8, 16, 32))
    assert capped.take(40, 3, False) == 8 and capped.take(40, 3, True) == 32
    with pytest.raises(ValueError, match="max_chunk_frames"):
        ChunkPolicy(8, 4, max_chunk_frames=6)
    with pytest.raises(ValueError, match="vocoder_max_chunk_frames"):
        EngineConfig(vocoder_max_chunk_frames=4)


def test_vocoder_growing_chunks_equal_full_decode(model, codec):
    config = EngineConfig(
        device="cpu", dtype="float64", num_pages=24, page_size=4, vocoder_max_chunk_frames=32
    )
    assert LocalEngine(model, config, codec=codec).vocoder.policy.largest_chunk == 32  # the config's
    vocoder = Vocoder(codec, 2, chunk_frames=4, first_chunk_frames=2, max_batch=2, max_chunk_frames=16)
    vocoder.policy = dataclasses.replace(vocoder.policy, graph_chunks=(2, 4, 8, 16))  # as captured on CUDA
    calls = record_codec_chunks(vocoder)
    sent = torch.randint(0, 32, (41, 5), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    audio: list[np.ndarray] = []
    stream = vocoder.open(lambda samples, _: audio.append(samples))
    for start in range(0, 41, 3):  # three frames per engine step
        vocoder.push(stream, sent[start : start + 3], last=start + 3 >= 41)
        while work := vocoder.collect():
            vocoder.decode(work)
    vocoder.end(stream, lambda: None)
    while work := vocoder.collect():
        vocoder.decode(work)
    assert calls == [[2], [4], [8], [16], [10]]  # 2, 4, 8, 16, then the 10-frame tail of 40
    expected = codec.decode(sent[:-1, 1:].t().long())[0, 0]
    np.testing.assert_allclose(np.concatenate(audio), expected.numpy(), atol=1e-4)


def test_first_chunks_get_their_own_call_beside_long_chunks(codec):
    policy = ChunkPolicy(8, 4, max_chunk_frames=32)
    assert policy.first_chunks_apart([(4, 0), (32, 3)]) and policy.first_chunks_apart([(4, 0), (16, 2)])
    assert not policy.first_chunks_apart([(4, 0), (8, 1)])  # the default sizes: one call
    assert not policy.first_chunks_apart([(4, 0), (4, 0)]) and not policy.first_chunks_apart([(32, 3)])
    vocoder = Vocoder(codec, 4, chunk_frames=4, first_chunk_frames=2, max_batch=4, max_chunk_frames=8)
    vocoder.policy = dataclasses.replace(vocoder.policy, graph_chunks=(2, 4, 8))  # as captured on CUDA
    calls = record_codec_chunks(vocoder)
    gen = torch.Generator().manual_seed(13)
    sent = {
        k: torch.randint(0, 32, (n, 5), generator=gen, dtype=torch.int32)
        for k, n in {"old": 15, "new": 3}.items()
    }
    audio = {k: [] for k in sent}
    streams = {k: vocoder.open(lambda samples, _, k=k: audio[k].append(samples)) for k in sent}

    def run() -> None:
        while work := vocoder.collect():
            for call in vocoder.calls(work):
                vocoder.decode(call)

    for piece in (slice(0, 2), slice(2, 6)):  # its chunks of 2, then 4
        vocoder.push(streams["old"], sent["old"][piece])
        run()
    vocoder.push(streams["old"], sent["old"][6:14])  # 8 more: its third chunk (8) is due
    vocoder.push(streams["new"], sent["new"], last=True)  # 2: a first chunk, beside an 8-frame one
    run()
    assert calls == [[2], [4], [2], [8]]  # the first chunk apart, and before the long one
    vocoder.push(streams["old"], sent["old"][14:], last=True)  # its last frame: dropped
    for key in sent:
        vocoder.end(streams[key], lambda: None)
    run()
    for key, frames in sent.items():
        expected = codec.decode(frames[:-1, 1:].t().long())[0, 0]
        np.testing.assert_allclose(np.concatenate(audio[key]), expected.numpy(), atol=1e-4)


def test_a_listener_running_low_gets_what_its_stream_holds(codec):
    """Below `refill_seconds` of buffered audio a stream is due before its chunk schedule says
    so, with the largest captured chunk it holds (none under the first chunk's length); a
    listener with audio to spare waits for the full chunk. The audio equals one whole decode."""
    low, full = PlaybackClock(), PlaybackClock()
    low.deliver(0.2, now=10.0)  # 0.1 s left at 10.1
    full.deliver(2.0, now=10.0)  # 1.9 s left
    policy = ChunkPolicy(8, 4, (4, 8), refill_seconds=0.5)
    streams = [StreamState(6, 1, False, low), StreamState(6, 1, False, full), StreamState(3, 1, False, low),
               StreamState(6, 0, False)]  # fmt: skip
    assert policy.plan(streams, now=10.1) == {0: 4, 3: 4}
    assert ChunkPolicy(8, 4, refill_seconds=0.5).plan(streams[:2], now=10.1) == {0: 6}  # no graphs
    assert ChunkPolicy(8, 4, (4, 8)).plan(streams[:3], now=10.1) == {}  # refill off: the schedule
    with pytest.raises(ValueError):
        ChunkPolicy(8, 4, refill_seconds=-1.0)

    vocoder = Vocoder(codec, 2, chunk_frames=8, first_chunk_frames=4, refill_seconds=60.0)
    vocoder.policy = dataclasses.replace(vocoder.policy, graph_chunks=(4, 8))  # as captured on CUDA
    calls = record_codec_chunks(vocoder)
    sent = torch.randint(0, 32, (12, 5), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    audio: list[np.ndarray] = []
    stream = vocoder.open(lambda samples, _: audio.append(samples), clock=PlaybackClock())
    for piece in (slice(0, 4), slice(4, 9)):  # the first chunk, then 5 frames of a due 8
        vocoder.push(stream, sent[piece])
        while work := vocoder.collect():
            vocoder.decode(work)
    assert calls == [[4], [4]]  # the listener holds far less than 60 s: 4 of the 5 go at once
    vocoder.push(stream, sent[9:], last=True)
    vocoder.end(stream, lambda: None)
    while work := vocoder.collect():
        vocoder.decode(work)
    assert calls == [[4], [4], [3]]  # the tail: 1 held back + 2 (the last frame is dropped)
    expected = codec.decode(sent[:-1, 1:].t().long())[0, 0]
    np.testing.assert_allclose(np.concatenate(audio), expected.numpy(), atol=1e-4)


def test_latency_modes_set_the_first_chunk(codec):
    """`low` decodes the smallest first chunk, `balanced` the policy's, `normal` a full chunk;
    the chunks after it follow the schedule, and the audio equals one whole decode each time."""
    vocoder = Vocoder(codec, 3, chunk_frames=8, first_chunk_frames=4, low_latency_first_chunk_frames=2)
    assert [vocoder.first_chunk_for(mode) for mode in ("low", "balanced", "normal")] == [2, 4, 8]
    assert ChunkPolicy.graph_chunk_sizes(8, 4, None, (2,)) == (2, 4, 8)  # captured on CUDA
    vocoder.policy = dataclasses.replace(vocoder.policy, graph_chunks=(2, 4, 8))
    assert vocoder.policy.take(3, 0, False, first=2) == 2 and vocoder.policy.take(7, 0, False, first=8) == 0
    calls = record_codec_chunks(vocoder)
    sent = torch.randint(0, 32, (14, 5), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    schedules = {"low": [[2], [8], [3]], "balanced": [[4], [8], [1]], "normal": [[8], [5]]}
    for mode, expected_calls in schedules.items():
        calls.clear()
        audio: list[np.ndarray] = []
        first = vocoder.first_chunk_for(mode)
        stream = vocoder.open(lambda samples, _, audio=audio: audio.append(samples), first_chunk=first)
        for frame in range(13):  # one frame per engine step, the vocoder collecting after each
            vocoder.push(stream, sent[frame : frame + 1])
            while work := vocoder.collect():
                vocoder.decode(work)
        vocoder.push(stream, sent[13:], last=True)
        vocoder.end(stream, lambda: None)
        while work := vocoder.collect():
            vocoder.decode(work)
        assert calls == expected_calls, mode
        expected = codec.decode(sent[:-1, 1:].t().long())[0, 0]
        np.testing.assert_allclose(np.concatenate(audio), expected.numpy(), atol=1e-4)


def test_an_unknown_latency_mode_is_refused(model):
    engine = LocalEngine(model, EngineConfig(device="cpu", dtype="float64", num_pages=64, page_size=4))
    with pytest.raises(InvalidRequest, match="latency must be one of low, balanced, normal"):
        engine.submit(SynthesisRequest("hello", latency="fastest"))


def test_vocoder_decodes_due_chunks_and_equals_full_decode(codec):
    vocoder = Vocoder(codec, 4, chunk_frames=8, first_chunk_frames=4, max_batch=2)
    assert not vocoder.capture_graphs() and not vocoder.policy.graph_chunks  # CPU: nothing changes
    vocoder.policy = ChunkPolicy(8, 4, (4, 8), max_batch=2)  # as after a capture on CUDA
    calls = record_codec_chunks(vocoder)
    g = torch.Generator().manual_seed(5)
    frames = {
        k: torch.randint(0, 32, (n, 5), generator=g, dtype=torch.int32)
        for k, n in {"a": 15, "b": 10, "c": 3}.items()
    }
    audio = {k: [] for k in frames}
    done: list[str] = []
    streams = {k: vocoder.open(lambda samples, _, k=k: audio[k].append(samples)) for k in frames}

    def run() -> None:
        while work := vocoder.collect():
            vocoder.decode(work)

    # Frames are released as pushed, but a batch's last frame (`last=True`) is never decoded.
    vocoder.push(streams["a"], frames["a"][:5])  # 5 released: its first chunk (4) is due
    vocoder.push(streams["b"], frames["b"][:9])  # 9 released: a first chunk of 8
    vocoder.push(streams["c"], frames["c"], last=True)  # 2 released: wait
    run()
    vocoder.push(streams["a"], frames["a"][5:], last=True)  # 1 + 9 released: one full chunk
    vocoder.end(streams["c"], lambda: done.append("c"))  # its tail of 2, then done
    run()
    vocoder.push(streams["b"], frames["b"][9:], last=True)  # its last frame: nothing released
    vocoder.end(streams["a"], lambda: done.append("a"))
    vocoder.end(streams["b"], lambda: done.append("b"))
    run()
    assert calls == [[4, 8], [8, 2], [2, 1]]
    assert sorted(done) == ["a", "b", "c"] and not vocoder._streams
    for key, sent in frames.items():
        codes = sent[:-1, 1:].t().long()  # every frame but the last one
        expected = codec.decode(codes)[0, 0]
        np.testing.assert_allclose(np.concatenate(audio[key]), expected.numpy(), atol=1e-4)


def test_v15_long_text_slides_the_history_as_the_reference(tmp_path):
    assert inspect.signature(generate_long).parameters["max_length"].default == V15_MAX_LENGTH
    write_checkpoint(tmp_path, tiny_config("1.5"), dtype=torch.float32)
    model = load_model(tmp_path, dtype=torch.float64)
    assert model.config.family == "1.5"
    text = "One two. Three four. Five six. Seven eight. Nine ten."
    # Room for about two turns of history besides batch 0 (as in test_reference).
    max_length = 1024 + voice_prefix_length(model.config, model.tokenizer) + 150
    options = SamplingOptions(temperature=0.7, top_p=0.8, repetition_penalty=1.2, seed=3)
    request = SynthesisRequest(text, sampling=options, max_new_frames=6, chunk_length=12)
    engine = LocalEngine(model, EngineConfig(device="cpu", dtype="float64", num_pages=256, page_size=4))
    engine.v15_max_length = max_length
    handle, chunks = synthesize_on_thread(engine, request)
    assert handle.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    oracle = generate_long(
        model, text, chunk_length=12, max_frames=6, temperature=0.7, top_p=0.8, seed=3,
        repetition_penalty=1.2, max_length=max_length,
    )  # fmt: skip
    assert len(oracle) == 5
    every = [Turn(b.text, b.frames) for b in oracle[:-1]]
    unslid = build_prompt(model.config, model.tokenizer, oracle[-1].text, (), every)
    assert oracle[-1].prompt.shape[1] < unslid.shape[1]  # the window did drop middle batches
    frames = np.concatenate([c.frames for c in chunks])  # no codec: every frame of every batch
    assert np.array_equal(frames, torch.cat([b.frames for b in oracle], dim=1).t().numpy())


@pytest.mark.parametrize("with_codec", [False, True])
def test_stop_ends_every_request_in_flight(model, codec, with_codec):
    """stop() with requests running, waiting, just aborted and just submitted: the thread joins,
    every handle and stream ends (ABORTED) and every page is freed."""
    config = EngineConfig(
        device="cpu", dtype="float64", num_pages=256, page_size=4, ignore_eos=True, max_running_requests=1
    )
    engine = LocalEngine(model, config, codec=codec if with_codec else None)
    prompt = build_prompt(model.config, model.tokenizer, "hello", [])

    async def drain(handle):
        return [chunk async for chunk in handle]

    async def scenario():
        engine.start_thread()
        running = engine.submit(SynthesisRequest("hello there", max_new_frames=400))
        waiting = engine.submit(SynthesisRequest("waits its turn", max_new_frames=400))
        stream = engine.submit_frames(prompt, SamplingParams(seed=1), max_new_frames=400)
        consumers = [asyncio.ensure_future(drain(h)) for h in (running, waiting)]
        consumers.append(asyncio.ensure_future(stream.collect()))
        for _ in range(500):
            if engine.core.steps >= 3:
                break
            await asyncio.sleep(0.01)
        aborted = engine.submit(SynthesisRequest("aborted", max_new_frames=400))
        engine.abort(aborted.request_id)
        consumers.append(asyncio.ensure_future(drain(aborted)))
        await asyncio.to_thread(engine.stop_thread)
        late = engine.submit(SynthesisRequest("after the stop", max_new_frames=400))
        consumers.append(asyncio.ensure_future(drain(late)))
        engine.stop_thread()
        await asyncio.wait_for(asyncio.gather(*consumers), 10)
        return running, waiting, stream, aborted, late

    handles = asyncio.run(scenario())
    assert engine._thread is None
    assert [h.finish_reason for h in handles] == [FinishReason.ABORTED] * 5
    assert engine.core.kv.pool.num_used == engine.core.kv.prefix_cache_pages and not engine.core.requests
    assert engine.stats().running == 0 and sum(engine.stats().waiting.values()) == 0


def test_a_failed_codec_call_fails_its_requests_and_the_vocoder_keeps_serving(model, codec):
    """A codec error ends only the requests whose audio was in that call (ERROR, pages freed);
    the vocoder thread survives and the next request gets its audio."""
    config = EngineConfig(device="cpu", dtype="float64", num_pages=256, page_size=4, ignore_eos=True)
    engine = LocalEngine(model, config, codec=codec)
    real_step, calls = engine.vocoder.pool.step, []

    def failing_once(streams, codes):
        calls.append(len(streams))
        if len(calls) == 1:
            raise RuntimeError("codec exploded")
        return real_step(streams, codes)

    engine.vocoder.pool.step = failing_once

    async def scenario():
        engine.start_thread()
        try:
            first = await asyncio.wait_for(synthesize(engine, SynthesisRequest("one", max_new_frames=20)), 60)
            second = await asyncio.wait_for(
                synthesize(engine, SynthesisRequest("two", max_new_frames=20)), 60
            )
            for _ in range(100):
                if not engine.core.requests:
                    break
                await asyncio.sleep(0.02)
            return first, second
        finally:
            engine.stop_thread()

    (first_handle, _), (second_handle, second_chunks) = asyncio.run(scenario())
    assert first_handle.finish_reason == FinishReason.ERROR
    assert second_handle.finish_reason == FinishReason.LENGTH
    assert sum(len(chunk.samples) for chunk in second_chunks) == 19 * codec.frame_length
    assert not engine.core.requests and engine.core.kv.pool.num_used == engine.core.kv.prefix_cache_pages


def test_vocoder_wakes_once_per_engine_step(model, codec):
    """Frames pushed inside `deferred_wakeups` wake the vocoder thread once, on leaving; outside,
    every push wakes it. The engine thread delivers each step's frames inside one."""
    vocoder = Vocoder(codec, 4, chunk_frames=8, first_chunk_frames=4)
    notified = []
    condition = vocoder._wake
    real_notify = condition.notify_all
    condition.notify_all = lambda: (notified.append(1), real_notify())
    streams = [vocoder.open(lambda samples, frames: None) for _ in range(3)]
    frame = torch.zeros(1, 5, dtype=torch.int32)
    with vocoder.deferred_wakeups():
        for stream in streams:
            vocoder.push(stream, frame)
        vocoder.end(streams[0], lambda: None)
        assert notified == []
    assert len(notified) == 1
    with vocoder.deferred_wakeups():
        pass  # nothing pushed: no wake-up
    assert len(notified) == 1
    vocoder.push(streams[1], frame)
    vocoder.push(streams[2], frame)
    assert len(notified) == 3

    config = EngineConfig(device="cpu", dtype="float64", num_pages=256, page_size=4, ignore_eos=True)
    engine = LocalEngine(model, config, codec=codec)
    entered = []
    deferred = engine.vocoder.deferred_wakeups

    def counting():
        entered.append(engine.core.steps)
        return deferred()

    engine.vocoder.deferred_wakeups = counting
    request = SynthesisRequest("a few words", sampling=SamplingOptions(seed=3), max_new_frames=10)
    handle, chunks = synthesize_on_thread(engine, request)
    assert handle.finish_reason is FinishReason.LENGTH and sum(len(c.samples) for c in chunks) > 0
    assert len(entered) == engine.core.steps > 0  # every step's delivery, once


def test_check_voice_refuses_a_voice_that_leaves_no_room_to_speak(model, codec):
    from shoal.engine.engine import VOICE_MIN_SPEECH_FRAMES

    engine = LocalEngine(model, EngineConfig(device="cpu", dtype="float64", num_pages=64), codec=codec)
    n = model.config.num_codebooks
    context = engine.core.max_seq_len  # 512

    def voice(frames: int) -> tuple[VoiceReference, ...]:
        return (VoiceReference("a clip", np.zeros((n, frames), dtype=np.int64)),)

    refs = tuple(Reference(r.text, torch.as_tensor(r.codes)) for r in voice(1))
    overhead = voice_prefix_length(model.config, model.tokenizer, refs) - 1  # text and markers
    fits = context - VOICE_MIN_SPEECH_FRAMES - overhead  # the longest clip that leaves enough room
    engine.check_voice(voice(fits))
    with pytest.raises(InvalidRequest, match="shorter or fewer clips"):
        engine.check_voice(voice(fits + 1))
    with pytest.raises(InvalidRequest, match="out of the tokenizer.s semantic range"):
        engine.check_voice((VoiceReference("x", np.full((n, 4), 10**6, dtype=np.int64)),))
    with pytest.raises(InvalidRequest, match="reference audio"):
        engine.check_voice((VoiceReference("x", np.zeros((n + 1, 4), dtype=np.int64)),))
