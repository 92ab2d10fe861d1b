"""The engine in its own process (`shoal.engine.process`) and its client (`shoal.engine.remote`):
the wire format, then a real engine process on the demo checkpoint (CPU), started once for the
module by an EngineSupervisor, driven by RemoteEngine clients."""

from __future__ import annotations

import asyncio
import inspect
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
from engine_process_testing import (
    CHUNK_FRAMES,
    ENGINE_CONFIG,
    SAMPLE_RATE,
    WireClient,
    chunk_age_seconds,
    codec_seconds_per_chunk,
    synthetic_engine_process,
)

from shoal.engine import wire
from shoal.engine.api import (
    AudioChunk,
    Engine,
    EngineError,
    EngineOverloaded,
    EngineStats,
    EngineUnavailable,
    FinishReason,
    InvalidRequest,
    Priority,
    SamplingOptions,
    SynthesisRequest,
    VoiceReference,
)
from shoal.engine.process import EngineSpec, EngineSupervisor
from shoal.engine.remote import ERROR_KINDS as REMOTE_ERROR_KINDS
from shoal.engine.remote import RemoteEngine

MAX_NEW_FRAMES = 24
LONG_FRAMES = 4000  # a request that runs until it is aborted
CLIENT_TIMEOUT = 1.5  # the engine's: a client silent this long is gone


# The wire format ---------------------------------------------------------------------------


def through_the_wire(value):
    """`value` as the other side reads it: packed into a message frame and unpacked."""
    return wire.unpack(wire.pack({"type": "test", "value": value}))["value"]


def test_request_round_trip_keeps_every_field():
    codes = np.arange(30, dtype=np.int64).reshape(10, 3)
    request = SynthesisRequest(
        "Hello <|speaker:0|> there",
        references=(VoiceReference("a clip", codes), VoiceReference("", codes[:, :1].astype(np.int32))),
        sampling=SamplingOptions(temperature=0.5, top_p=0.9, top_k=12, repetition_penalty=1.3, seed=2**62),
        priority=Priority.REALTIME,
        max_new_frames=77,
        chunk_length=150,
        request_id="req-1",
    )
    decoded = wire.decode_request(through_the_wire(wire.encode_request(request)))
    for name in ("text", "sampling", "priority", "max_new_frames", "chunk_length", "request_id"):
        assert getattr(decoded, name) == getattr(request, name), name
    assert isinstance(decoded.priority, Priority) and isinstance(decoded.sampling, SamplingOptions)
    assert getattr(decoded, "voice_key", None) == getattr(request, "voice_key", None)
    for sent, received in zip(request.references, decoded.references, strict=True):
        assert received.text == sent.text and received.codes.dtype == sent.codes.dtype
        assert np.array_equal(received.codes, sent.codes)
    assert wire.decode_request(wire.encode_request(SynthesisRequest("x"))) == SynthesisRequest("x")


def test_a_field_the_receiver_does_not_know_is_dropped():
    request = SynthesisRequest("hi", latency="low")
    data = {**wire.encode_request(request), "voice_key": "v1", "field_from_the_future": 3}
    assert wire.decode_request(data).text == "hi" and wire.decode_request(data).latency == "low"


def test_audio_chunk_round_trip_is_exact_and_writable():
    samples = np.random.default_rng(0).uniform(-1, 1, 4096).astype(np.float32)
    frames = np.arange(44, dtype=np.int32).reshape(4, 11)
    chunk = AudioChunk(samples, 44100, frames, segment=2, segment_text="the third batch", ready_at=1234.5)
    decoded = wire.decode_chunk(through_the_wire(wire.encode_chunk(chunk)))
    assert decoded.sample_rate == 44100 and decoded.ready_at == 1234.5
    assert decoded.segment == 2 and decoded.segment_text == "the third batch"
    assert decoded.samples.dtype == np.float32 and np.array_equal(decoded.samples, samples)
    assert decoded.frames.dtype == np.int32 and np.array_equal(decoded.frames, frames)
    np.multiply(decoded.samples, 0.5, out=decoded.samples)  # encoders may scale in place
    without_frames = wire.decode_chunk(wire.encode_chunk(AudioChunk(samples[:0], 24000)))
    assert without_frames.frames is None and without_frames.samples.size == 0


def test_stats_reasons_and_errors_round_trip():
    stats = EngineStats(3, {"realtime": 1, "standard": 2, "batch": 0}, 40, 472, 31.5, 30.0, 2)
    assert wire.decode_stats(through_the_wire(wire.encode_stats(stats))) == stats
    for reason in FinishReason:
        assert wire.decode_reason(wire.encode_reason(reason)) is reason
    assert wire.decode_reason(wire.encode_reason(None)) is None
    for error in (EngineOverloaded("standard queue is full"), InvalidRequest("bad codes"), EngineError("x")):
        back = wire.decode_error(through_the_wire(wire.encode_error(error)))
        assert type(back) is type(error) and str(back) == str(error)
    other = wire.decode_error(wire.encode_error(RuntimeError("CUDA error")))
    assert type(other) is EngineError and str(other) == "RuntimeError: CUDA error"
    unavailable = wire.decode_error({"kind": "EngineUnavailable", "message": "x"}, REMOTE_ERROR_KINDS)
    assert isinstance(unavailable, EngineUnavailable)
    with pytest.raises(wire.ProtocolError):
        wire.unpack(b"\xc1")
    with pytest.raises(wire.ProtocolError):
        wire.unpack(wire.pack({"no": "type"}))


# A real engine process -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory) -> Path:
    from shoal.demo import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def supervisor(demo_checkpoint):
    spec = EngineSpec(
        str(demo_checkpoint),
        device="cpu",
        dtype="float32",
        config=ENGINE_CONFIG,
        client_timeout=CLIENT_TIMEOUT,
        torch_threads=1,
    )
    with EngineSupervisor(spec, ready_timeout=120, backoff=0.2) as running:
        yield running


def run(scenario, timeout: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(scenario(), timeout)

    return asyncio.run(bounded())


async def collect(handle) -> list[AudioChunk]:
    return [chunk async for chunk in handle]


async def connected(address: str, **options) -> RemoteEngine:
    engine = RemoteEngine(address, **options)
    await engine.start()
    return engine


async def wait_for_idle(engine: RemoteEngine, timeout: float = 15.0) -> EngineStats:
    """The engine's stats once nothing runs and only the prefix cache holds pages."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.refresh_stats()
        if stats.running == 0 and stats.pages_used == stats.prefix_cache_pages:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"the engine is not idle after {timeout} s: {stats}")
        await asyncio.sleep(0.1)


def test_remote_request_gives_the_frames_of_the_same_request_in_process(supervisor, demo_checkpoint):
    from shoal.config import EngineConfig
    from shoal.engine import load_engine

    request = SynthesisRequest(
        "Hello from the engine process.", sampling=SamplingOptions(seed=7), max_new_frames=MAX_NEW_FRAMES
    )

    async def remote():
        client = await connected(supervisor.address)
        try:
            assert (client.model_name, client.sample_rate) == (demo_checkpoint.name, SAMPLE_RATE)
            handle = client.submit(request)
            chunks = await collect(handle)
            return chunks, handle.finish_reason, client.frame_rate
        finally:
            await client.stop()

    chunks, reason, frame_rate = run(remote)
    local_engine = load_engine(
        demo_checkpoint, device="cpu", dtype="float32", config=EngineConfig(**ENGINE_CONFIG)
    )

    async def local():
        await local_engine.start()
        try:
            handle = local_engine.submit(request)
            return await collect(handle), handle.finish_reason
        finally:
            await local_engine.stop()

    local_chunks, local_reason = run(local)
    assert reason == local_reason == FinishReason.LENGTH and frame_rate == local_engine.frame_rate
    frames = np.concatenate([chunk.frames for chunk in chunks])
    assert frames.shape == (MAX_NEW_FRAMES - 1, 11)  # the last frame is not decoded
    assert np.array_equal(frames, np.concatenate([chunk.frames for chunk in local_chunks]))
    audio = np.concatenate([chunk.samples for chunk in chunks])
    assert audio.dtype == np.float32 and audio.size == sum(chunk.samples.size for chunk in local_chunks)
    assert audio.size == frames.shape[0] * 2048


def test_concurrent_requests_from_two_clients_all_complete(supervisor):
    async def scenario():
        clients = [await connected(supervisor.address) for _ in range(2)]
        try:
            handles = [
                client.submit(SynthesisRequest(f"Request {n} of client {c}.", max_new_frames=16))
                for c, client in enumerate(clients)
                for n in range(3)
            ]
            results = await asyncio.gather(*(collect(handle) for handle in handles))
            assert len({handle.request_id for handle in handles}) == len(handles)
            await wait_for_idle(clients[0])
            return handles, results
        finally:
            for client in clients:
                await client.stop()

    handles, results = run(scenario)
    for handle, chunks in zip(handles, results, strict=True):
        assert handle.finish_reason == FinishReason.LENGTH
        assert sum(len(chunk.frames) for chunk in chunks) == 15


def test_aclose_mid_stream_aborts_and_frees_the_pages(supervisor):
    async def scenario():
        client = await connected(supervisor.address)
        try:
            handle = client.submit(SynthesisRequest("A long one.", max_new_frames=LONG_FRAMES))
            iterator = handle.__aiter__()
            first = await iterator.__anext__()
            assert (await client.refresh_stats()).running == 1
            await iterator.aclose()  # what the server does when its client goes away
            assert handle.finish_reason == FinishReason.ABORTED
            return first, await wait_for_idle(client)
        finally:
            await client.stop()

    first, stats = run(scenario)
    assert first.frames is not None and len(first.frames) > 0
    assert stats.running == 0 and sum(stats.waiting.values()) == 0


def test_engine_errors_arrive_as_the_api_exceptions(supervisor):
    bad_codes = (VoiceReference("wrong codebooks", np.zeros((3, 5), dtype=np.int64)),)
    noise = np.random.default_rng(1).uniform(-0.5, 0.5, 16000).astype(np.float32)

    async def scenario():
        client = await connected(supervisor.address)
        try:
            with pytest.raises(InvalidRequest, match="reference audio"):
                await asyncio.to_thread(client.check_voice, bad_codes)  # as the server calls it
            handle = client.submit(SynthesisRequest("Hello.", references=bad_codes, max_new_frames=8))
            with pytest.raises(InvalidRequest):
                await handle.__aiter__().__anext__()
            assert handle.finish_reason == FinishReason.ERROR
            with pytest.raises(InvalidRequest, match="empty"):
                client.submit(SynthesisRequest("  "))
            refused = client.submit(SynthesisRequest("Later.", priority=Priority.BATCH, max_new_frames=8))
            with pytest.raises(EngineOverloaded, match="batch queue is full"):
                await refused.__aiter__().__anext__()
            codes = await client.encode_reference(noise, 16000)
            voice = (VoiceReference("a voice", codes),)
            await asyncio.to_thread(client.check_voice, voice)
            # The arguments after the references travel as given, whatever the API's signature.
            extra = ("voice-1",) if len(inspect.signature(Engine.prefill_voice).parameters) > 2 else ()
            assert await client.prefill_voice(voice, *extra) is None
            return codes
        finally:
            await client.stop()

    codes = run(scenario)
    assert codes.ndim == 2 and codes.shape[0] == 10 and np.issubdtype(codes.dtype, np.integer)
    assert codes.shape[1] == -(-SAMPLE_RATE // 2048)  # one second: a column per 2048 samples at 44.1 kHz


def test_a_client_that_vanishes_has_its_requests_aborted(supervisor):
    async def scenario():
        observer = await connected(supervisor.address)
        try:
            for stays_connected in (False, True):
                gone = WireClient(supervisor.address)
                request = wire.encode_request(SynthesisRequest("Nobody listens.", max_new_frames=LONG_FRAMES))
                gone.send({"type": "submit", "id": "orphan", "epoch": gone.epoch(), "request": request})
                await asyncio.to_thread(gone.receive, "audio")
                assert (await observer.refresh_stats()).running == 1
                gone.send({"type": "ping", "seq": 2})  # its last word: silence counts from here
                started = time.monotonic()
                if not stays_connected:
                    gone.close()  # a crashed process: the engine's next send finds no route
                # else connected but silent, as a stalled process: CLIENT_TIMEOUT without a ping
                await wait_for_idle(observer)
                waited = time.monotonic() - started
                gone.close()
                if stays_connected:
                    assert waited >= CLIENT_TIMEOUT - 0.1
                else:
                    assert waited < CLIENT_TIMEOUT  # before the silence could count
        finally:
            await observer.stop()

    run(scenario)


def test_killed_engine_fails_in_flight_requests_and_is_restarted(supervisor):
    async def scenario():
        client = await connected(supervisor.address, unavailable_after=2.0)
        try:
            epoch = client.epoch
            handle = client.submit(SynthesisRequest("Interrupted.", max_new_frames=LONG_FRAMES))
            iterator = handle.__aiter__()
            await iterator.__anext__()
            os.kill(supervisor.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(EngineUnavailable):
                async for _ in iterator:
                    pass
            detected = time.monotonic() - killed
            assert handle.finish_reason == FinishReason.ERROR
            with pytest.raises(EngineUnavailable):
                client.submit(SynthesisRequest("Too early."))
            with pytest.raises(EngineUnavailable):
                client.stats()
            assert await client.wait_available(60)
            restarted = time.monotonic() - killed
            assert await asyncio.to_thread(supervisor.wait_ready, 30)  # its own ping may come later
            assert client.epoch != epoch and client.epoch == supervisor.epoch
            chunks = await collect(client.submit(SynthesisRequest("Back again.", max_new_frames=8)))
            return detected, restarted, chunks
        finally:
            await client.stop()

    detected, restarted, chunks = run(scenario, timeout=90)
    print(f"\nkill -9: in-flight request failed after {detected:.2f} s, engine back after {restarted:.2f} s")
    assert detected < 5.0
    assert supervisor.restarts == 1 and supervisor.alive
    assert sum(len(chunk.frames) for chunk in chunks) == 7


def test_engine_shutdown_fails_streams_at_once_as_unavailable(tmp_path):
    """SIGTERM: the engine process tells its clients before it goes, no heartbeat timeout needed."""
    with synthetic_engine_process(tmp_path) as (address, process):

        async def scenario():
            client = await connected(address, unavailable_after=30.0)
            try:
                handle = client.submit(SynthesisRequest("paced", max_new_frames=CHUNK_FRAMES * 1000))
                iterator = handle.__aiter__()
                await iterator.__anext__()
                process.send_signal(signal.SIGTERM)
                stopped = time.monotonic()
                with pytest.raises(EngineUnavailable, match="shutting down"):
                    async for _ in iterator:
                        pass
                return time.monotonic() - stopped
            finally:
                await client.stop()

        assert run(scenario) < 5.0
        assert process.wait(10) == 0


# The wire's cost, measured (printed, not asserted) -----------------------------------------


def test_measure_wire_throughput_and_latency(tmp_path):
    """64 concurrent streams of 8-frame float32 chunks (64 KiB each) from a synthetic engine in
    another process: flat out (how far is copying bytes through the socket from what 64
    real-time streams need: is shared memory worth it?), then paced in real time (how old is a
    chunk when its consumer gets it?)."""
    streams, flat_out_chunks, paced_chunks = 64, 40, 10

    async def consume(handle) -> tuple[list[AudioChunk], list[float]]:
        chunks, ages = [], []
        async for chunk in handle:
            ages.append(chunk_age_seconds(chunk))
            chunks.append(chunk)
        return chunks, ages

    async def scenario(address: str):
        client = await connected(address)
        try:
            calls = time.perf_counter()
            for _ in range(50):
                await client.refresh_stats()
            round_trip = (time.perf_counter() - calls) / 50
            results = {}
            for text, count in (("flat out", flat_out_chunks), ("paced", paced_chunks)):
                start = time.perf_counter()
                handles = [
                    client.submit(SynthesisRequest(text, max_new_frames=CHUNK_FRAMES * count))
                    for _ in range(streams)
                ]
                outcome = await asyncio.gather(*(consume(handle) for handle in handles))
                results[text] = (time.perf_counter() - start, outcome)
            return round_trip, results
        finally:
            await client.stop()

    with synthetic_engine_process(tmp_path) as (address, _):
        round_trip, results = run(lambda: scenario(address))
    seconds, outcome = results["flat out"]
    chunks = [chunk for received, _ in outcome for chunk in received]
    assert len(chunks) == streams * flat_out_chunks
    audio_bytes = sum(chunk.samples.nbytes for chunk in chunks)
    realtime = streams * SAMPLE_RATE * 4  # bytes/s that 64 real-time streams need
    _, paced = results["paced"]
    ages = np.array([age for _, stream_ages in paced for age in stream_ages]) * 1e3
    assert ages.size == streams * paced_chunks
    encode, decode = codec_seconds_per_chunk()
    rate, per_chunk = audio_bytes / seconds / 1e6, seconds / len(chunks) * 1e6
    print(
        f"\nwire, {streams} streams of {CHUNK_FRAMES}-frame chunks: flat out {rate:.0f} MB/s of float32 "
        f"audio ({len(chunks) / seconds:.0f} chunks/s, {per_chunk:.0f} us a chunk), "
        f"{audio_bytes / seconds / realtime:.0f}x what {streams} real-time 44.1 kHz streams need "
        f"({realtime / 1e6:.1f} MB/s); paced in real time, a chunk's age at its consumer p50 "
        f"{np.percentile(ages, 50):.2f} ms, p99 {np.percentile(ages, 99):.2f} ms, max {ages.max():.2f} ms; "
        f"in process: encode+pack {encode * 1e6:.0f} us, unpack+decode {decode * 1e6:.0f} us a chunk; "
        f"call round trip {round_trip * 1e6:.0f} us"
    )


def test_an_engine_process_orphaned_while_loading_exits(tmp_path):
    """Loading may take minutes before the serving loop watches its parent: a process whose
    supervisor is gone (its parent pid changed) exits within a reap interval; one that finished
    loading is left to the serving loop."""
    import subprocess
    import sys

    script = (
        "import sys, threading, time\n"
        "from shoal.engine.process import exit_if_orphaned_while_loading\n"
        "loaded = threading.Event()\n"
        "if sys.argv[1] == 'loaded': loaded.set()\n"
        "parent = -1 if sys.argv[1] == 'orphan' else __import__('os').getppid()\n"
        "watch = threading.Thread(target=exit_if_orphaned_while_loading, args=(parent, loaded))\n"
        "watch.daemon = True\n"
        "watch.start()\n"
        "time.sleep(3)\n"
        "print('still here')\n"
    )

    def launch(case: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-c", script, case]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    orphan = launch("orphan")
    assert orphan.returncode == 1 and "still here" not in orphan.stdout  # gone before its 3 s sleep
    assert "gone while loading" in orphan.stderr
    for case in ("loaded", "parent alive"):
        kept = launch(case)
        assert kept.returncode == 0 and "still here" in kept.stdout, kept.stderr
