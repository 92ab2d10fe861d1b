"""Helpers for tests/test_engine_process.py: the engine spec the tests serve, a bare wire client
(a client process that vanishes is a socket closed without a goodbye), and the synthetic audio
source of the wire measurement."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from shoal.engine import wire
from shoal.engine.api import (
    AudioChunk,
    Engine,
    EngineStats,
    FinishReason,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)
from shoal.engine.process import ping, serve_engine

TESTS = Path(__file__).resolve().parent

# The engine the tests run, in the child process and in process for comparison: small enough
# for a shared 2-core CPU; ignore_eos so every request decodes exactly max_new_frames frames;
# batch-priority work refused outright (the engine's real overload path, on demand).
ENGINE_CONFIG: dict[str, Any] = {
    "device": "cpu",
    "dtype": "float32",
    "max_running_requests": 16,
    "num_pages": 512,
    "ignore_eos": True,
    "queue_limits": {"realtime": 64, "standard": 1024, "batch": 0},
}


class WireClient:
    """A DEALER speaking the wire protocol by hand: what a client process leaves behind when it
    dies (no goodbye, no aborts) or stalls (no pings)."""

    def __init__(self, address: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def send(self, message: dict[str, Any]) -> None:
        self.socket.send(wire.pack(message))

    def receive(self, kind: str, timeout: float = 30.0) -> dict[str, Any]:
        """The next message of `kind`, skipping others."""
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            if self.socket.poll(int(remaining * 1000)):
                message = wire.unpack(self.socket.recv())
                if message["type"] == kind:
                    return message
        raise TimeoutError(f"no {kind!r} message within {timeout} s")

    def epoch(self) -> str:
        self.send({"type": "ping", "seq": 1})
        return self.receive("pong")["epoch"]

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)
            self.context.term()


# The wire measurement ------------------------------------------------------------------------

SAMPLE_RATE = 44100
FRAME_SAMPLES = 2048
CHUNK_FRAMES = 8  # the vocoder's steady chunk
FRAME_ROWS = 11  # semantic + 10 codebooks


STAMP_MODULUS = 2**31  # microsecond stamps fit an int32 frame value


def stamp_us() -> int:
    """CLOCK_MONOTONIC in microseconds, modulo 2**31: comparable across processes on Linux."""
    return (time.monotonic_ns() // 1000) % STAMP_MODULUS


def chunk_age_seconds(chunk: AudioChunk) -> float:
    """Seconds since the synthetic engine handed `chunk` to the wire (its stamp in frames[0, 0])."""
    assert chunk.frames is not None
    return ((stamp_us() - int(chunk.frames[0, 0])) % STAMP_MODULUS) / 1e6


class SyntheticHandle(RequestHandle):
    """`chunks` chunks, each stamped when handed over; `paced`: one per chunk of real time, as a
    real-time stream comes out of the vocoder, else as fast as the consumer takes them."""

    def __init__(self, request_id: str, chunks: int, chunk: AudioChunk, paced: bool) -> None:
        self.request_id = request_id
        self._chunks = chunks
        self._chunk = chunk
        self._paced = paced
        self._finish: FinishReason | None = None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        interval = self._chunk.samples.size / SAMPLE_RATE if self._paced else 0.0
        for _ in range(self._chunks):
            frames = self._chunk.frames.copy()
            frames[0, 0] = stamp_us()
            yield AudioChunk(self._chunk.samples, SAMPLE_RATE, frames)
            await asyncio.sleep(interval)  # 0: the other streams' turn, as the vocoder interleaves
        self._finish = FinishReason.LENGTH

    async def aclose(self) -> None:
        self._finish = self._finish or FinishReason.ABORTED


class SyntheticAudioEngine(Engine):
    """Audio without a model: every request yields `max_new_frames / 8` chunks of 8 frames of
    float32 noise (64 KiB) with their int32 frames, paced in real time when its text is "paced".
    It measures the transport and the encoding only, not synthesis."""

    sample_rate = SAMPLE_RATE
    frame_rate = SAMPLE_RATE / FRAME_SAMPLES
    model_name = "synthetic"

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        samples = rng.uniform(-1, 1, CHUNK_FRAMES * FRAME_SAMPLES).astype(np.float32)
        frames = rng.integers(0, 256, (CHUNK_FRAMES, FRAME_ROWS), dtype=np.int32)
        self.chunk = AudioChunk(samples, SAMPLE_RATE, frames)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        assert request.request_id is not None
        chunks = request.max_new_frames // CHUNK_FRAMES
        return SyntheticHandle(request.request_id, chunks, self.chunk, paced=request.text == "paced")

    def abort(self, request_id: str) -> None:
        pass

    async def prefill_voice(self, references: tuple[VoiceReference, ...], *args: Any) -> None:
        pass

    def check_voice(self, references: tuple[VoiceReference, ...]) -> None:
        pass

    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        return np.zeros((10, 1), dtype=np.int64)

    def stats(self) -> EngineStats:
        return EngineStats(0, {}, 0, 0, 0.0, 0.0)


def serve_synthetic_engine(address: str) -> None:
    """A child process's body: serve SyntheticAudioEngine until SIGTERM, then shut down as the
    engine process does (its streams fail on their clients as unavailable)."""

    async def serve() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await serve_engine(SyntheticAudioEngine(), address, stop=stop)

    asyncio.run(serve())


@contextmanager
def synthetic_engine_process(directory: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """(address, process) of a SyntheticAudioEngine served by another process, once it answers."""
    address = f"ipc://{directory / 'synthetic.sock'}"
    code = (
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); "
        f"from engine_process_testing import serve_synthetic_engine; serve_synthetic_engine({address!r})"
    )
    process = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while ping(address, 0.5) is None:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the synthetic engine process did not answer")
        yield address, process
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(10)


def codec_seconds_per_chunk(repeats: int = 2000) -> tuple[float, float]:
    """(encode + pack, unpack + decode) seconds for one 8-frame chunk, in this process."""
    chunk = SyntheticAudioEngine().chunk
    start = time.perf_counter()
    for _ in range(repeats):
        payload = wire.pack({"type": "audio", "id": "r", "chunk": wire.encode_chunk(chunk)})
    encoded = time.perf_counter()
    for _ in range(repeats):
        wire.decode_chunk(wire.unpack(payload)["chunk"])
    decoded = time.perf_counter()
    return (encoded - start) / repeats, (decoded - encoded) / repeats
