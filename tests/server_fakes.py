"""A small in-test implementation of the `shoal.engine.api.Engine` ABC (a test double, not the
engine): it turns text into a tone whose length follows the text, in chunks, with a page
counter so tests can check that aborted requests give their pages back. `unavailable` makes
it answer as a `RemoteEngine` does while its engine process is down."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import numpy as np

from shoal.engine.api import (
    AudioChunk,
    Engine,
    EngineOverloaded,
    EngineStats,
    EngineUnavailable,
    FinishReason,
    InvalidRequest,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)


class ToneHandle(RequestHandle):
    def __init__(self, engine: ToneEngine, request: SynthesisRequest, request_id: str) -> None:
        self.engine = engine
        self.request = request
        self.request_id = request_id
        self._finish: FinishReason | None = None
        self.pages = 4
        engine.pages_used += self.pages

    def _release(self, reason: FinishReason) -> None:
        if self._finish is None:
            self._finish = reason
            self.engine.pages_used -= self.pages
            self.engine.running.discard(self.request_id)

    async def _generate(self) -> AsyncIterator[AudioChunk]:
        rate = self.engine.sample_rate
        chunks = min(
            self.engine.chunks_per_char * max(1, len(self.request.text)), self.request.max_new_frames
        )
        if "FAIL" in self.request.text:
            self._release(FinishReason.ERROR)
            return
        t = np.arange(rate // 10, dtype=np.float32) / rate
        for index in range(chunks):
            if self._finish is not None:
                return
            await asyncio.sleep(self.engine.chunk_delay)
            if self.engine.unavailable:  # the engine process died mid-stream
                self._release(FinishReason.ERROR)
                raise EngineUnavailable("the engine has not answered for 3.0 s")
            yield AudioChunk(samples=0.3 * np.sin(2 * np.pi * 220 * (t + index * 0.1)), sample_rate=rate)
        self._release(FinishReason.STOP)

    def __aiter__(self) -> AsyncIterator[AudioChunk]:
        return self._generate()

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish

    async def aclose(self) -> None:
        self._release(FinishReason.ABORTED)


class ToneEngine(Engine):
    sample_rate = 44100
    frame_rate = 21.5
    model_name = "tone-test-double"

    def __init__(self, chunk_delay: float = 0.005, chunks_per_char: int = 1, max_waiting: int = 100) -> None:
        self.chunk_delay = chunk_delay
        self.chunks_per_char = chunks_per_char
        self.max_waiting = max_waiting
        self.max_voice_frames = 10_000  # what `check_voice` lets through
        self.pages_used = 0
        self.running: set[str] = set()
        self.submitted: list[SynthesisRequest] = []
        self.prefilled: list[tuple[VoiceReference, ...]] = []
        self.encoded = 0
        self._ids = itertools.count()
        self.started = False
        self.unavailable = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.started = False

    def _check_available(self) -> None:
        if self.unavailable:
            raise EngineUnavailable("the engine is not answering")

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        self._check_available()
        if len(self.running) >= self.max_waiting:
            raise EngineOverloaded("queue full")
        if "INVALID" in request.text:
            raise InvalidRequest("prompt too long")
        self.submitted.append(request)
        handle = ToneHandle(self, request, f"req-{next(self._ids)}")
        self.running.add(handle.request_id)
        return handle

    def abort(self, request_id: str) -> None:
        self.running.discard(request_id)

    async def prefill_voice(self, references: tuple[VoiceReference, ...]) -> None:
        self._check_available()
        self.prefilled.append(references)

    def check_voice(self, references: tuple[VoiceReference, ...]) -> None:
        frames = sum(reference.codes.shape[1] for reference in references)
        if frames > self.max_voice_frames:
            raise InvalidRequest(f"voice of {frames} frames exceeds the context ({self.max_voice_frames})")

    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        self.encoded += 1
        frames = max(1, int(len(audio) / sample_rate * self.frame_rate))
        return np.zeros((10, frames), dtype=np.int64)

    def stats(self) -> EngineStats:
        self._check_available()
        return EngineStats(
            running=len(self.running),
            waiting={"realtime": 0, "standard": 0, "batch": 0},
            pages_used=self.pages_used,
            pages_free=1000 - self.pages_used,
            steps_per_second=0.0,
            frames_per_second=0.0,
        )
