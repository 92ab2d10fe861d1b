"""`POST /v1/tts/stream/with-timestamp`, Fish Audio's timestamped stream, and `SegmentTimer`, the
timing of generated audio by text chunk that this route and `/v1/tts/live` share.

The stream is Server-Sent Events, each one `data:` line of JSON: `audio_base64` (the encoded
file's next bytes; concatenated in order they are the file `/v1/tts` sends for the same request),
`content` (a text chunk), `chunk_seq` (its number), `chunk_audio_offset_sec` (where it starts in
the whole audio) and `alignment`: null, or the chunk's latest cumulative snapshot
`{"audio_duration", "segments": [{"text", "start", "end"}], "unit"}`, times in seconds from the
chunk's start. A newer snapshot of a chunk replaces the older one (Fish's latest-wins rule).

A chunk is one of the engine's text batches (`AudioChunk.segment`), so its timing is exact: it
starts where the audio before it ends and lasts as long as its own audio. While it is spoken,
the audio events carry its growing snapshot (one entry, the whole chunk; `unit: "chunk"`). Once
it is complete (the next chunk starts or the request ends) its final snapshot comes in an event
of its own (`audio_base64` empty): its words (`unit: "word"`, `unit` is Shoal's own key) when the
server has an aligner (`--aligner`, `alignment.py`), computed on the chunk's audio on the
aligner's thread while the audio stream goes on, else the whole chunk again. Between completion
and that event, audio events of the chunk carry `alignment: null`. Times are on the output's
timeline: `prosody.speed` divides them.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Header, Request
from fastapi.responses import StreamingResponse

from shoal.engine.api import AudioChunk, FinishReason, RequestHandle
from shoal.server import audio
from shoal.server.alignment import CtcAligner, WordTiming, load_aligner
from shoal.server.auth import Principal, request_priority, require_principal
from shoal.server.openapi import body as request_body
from shoal.server.schemas import TTSRequestBody
from shoal.server.settings import ServerSettings
from shoal.server.synthesis import EncodedAudio, parse_model
from shoal.server.tts import (
    SSE_MEDIA_TYPE,
    SYNTHESIS_ERRORS,
    AudioStreamResponse,
    event_stream_response,
    open_synthesis,
    sse_event,
)

log = logging.getLogger("shoal.server.timestamps")
ROUTE = "/v1/tts/stream/with-timestamp"
DECIMALS = 6  # microseconds: finer than any sample period
EVENT_KEYS = ("audio_base64", "content", "chunk_seq", "chunk_audio_offset_sec", "alignment")


def seconds(value: float) -> float:
    """A time for an event: a plain float (msgpack takes no numpy scalar), to the microsecond."""
    return round(float(value), DECIMALS)


@dataclass
class ChunkTiming:
    """One text chunk (an engine text batch) on the output audio's timeline."""

    seq: int
    text: str
    offset: float  # seconds of output audio before the chunk
    sample_rate: int
    speed: float
    samples: int = 0  # of the engine's audio, at `sample_rate`
    pieces: list[np.ndarray] = field(default_factory=list)  # the audio, kept only for the aligner
    words: list[WordTiming] | None = None  # engine-audio seconds from the chunk's start
    complete: bool = False
    final_sent: bool = False

    @property
    def duration(self) -> float:
        return self.samples / self.sample_rate / self.speed

    def snapshot(self) -> dict[str, Any]:
        """Fish's `alignment` object: the words when aligned, else the whole chunk as one entry."""
        if self.words:
            entries = [
                {
                    "text": word.text,
                    "start": seconds(word.start / self.speed),
                    "end": seconds(word.end / self.speed),
                }
                for word in self.words
            ]
            unit = "word"
        else:
            entries = [{"text": self.text, "start": 0.0, "end": seconds(self.duration)}]
            unit = "chunk"
        return {"audio_duration": seconds(self.duration), "segments": entries, "unit": unit}

    def fields(self, with_alignment: bool = True) -> dict[str, Any]:
        """The event fields that describe this chunk (all but the audio)."""
        return {
            "content": self.text,
            "chunk_seq": self.seq,
            "chunk_audio_offset_sec": seconds(self.offset),
            "alignment": self.snapshot() if with_alignment else None,
        }


class SegmentTimer:
    """Times the text chunks of one or more consecutive engine requests (a live session's
    segments continue the numbering and the timeline) from the audio chunks they deliver, and
    aligns each complete chunk's words when given an aligner.

    Feed it with `record(chunk)` for each audio chunk as it is encoded and `end_request()` when
    a request's audio ends (`watch(handle)` does both for a handle iterated to its end). Take the
    final snapshots either in line with the audio (the HTTP stream: `completed()` after each
    audio piece, `audio_fields()` with it, `await drain()` at the end) or from a task of their
    own (a live session: `forward(send)` sends each as soon as it is ready, `await finish()` at
    the end returns once all are sent). `close()` drops what is still queued when the stream is
    abandoned."""

    def __init__(self, aligner: CtcAligner | None = None, speed: float = 1.0) -> None:
        self.aligner = aligner
        self.speed = speed
        self.latest: ChunkTiming | None = None  # the chunk of the latest audio
        self._latest_key: tuple[int, int] | None = None  # (request number, engine segment index)
        self._request = 0  # requests ended so far
        self._elapsed_seconds = 0.0  # output audio up to the latest chunk's end
        self._finishing: deque[tuple[ChunkTiming, asyncio.Future | None]] = deque()
        self._changed = asyncio.Event()  # a chunk completed or its words arrived (for `forward`)
        self._finished = False
        self._all_forwarded = asyncio.Event()

    @classmethod
    def for_request(cls, state: Any, body: TTSRequestBody) -> SegmentTimer:
        """A timer for a request body on an app's state (its aligner, the body's speed)."""
        speed = body.prosody.speed if body.prosody else 1.0
        return cls(getattr(state, "aligner", None), speed)

    def watch(self, handle: RequestHandle) -> RequestHandle:
        """`handle`, recording its audio chunks as they pass and its end."""
        return TimedHandle(handle, self)

    def record(self, chunk: AudioChunk) -> None:
        """One audio chunk of the current request, in order."""
        key = (self._request, chunk.segment)
        if self.latest is None or self._latest_key != key:
            self._complete_latest(spoken=True)
            self.latest = ChunkTiming(
                seq=self.latest.seq + 1 if self.latest else 0,
                text=chunk.segment_text,
                offset=self._elapsed_seconds,
                sample_rate=chunk.sample_rate,
                speed=self.speed,
            )
            self._latest_key = key
        self.latest.samples += len(chunk.samples)
        self._elapsed_seconds = self.latest.offset + self.latest.duration
        if self.aligner is not None and len(chunk.samples):
            self.latest.pieces.append(np.asarray(chunk.samples, dtype=np.float32))

    def end_request(self, spoken: bool = True) -> None:
        """The current request's audio has ended: its last chunk is complete, and the next chunk
        recorded starts a new one. `spoken=False`: it was cut short (a barge-in), so its audio
        holds only part of its text and it keeps its chunk-level timing (no words)."""
        self._complete_latest(spoken)
        self._request += 1

    def _complete_latest(self, spoken: bool) -> None:
        chunk = self.latest
        if chunk is None or chunk.complete:
            return
        chunk.complete = True
        alignment = None
        if self.aligner is not None and chunk.pieces and spoken:
            audio_samples = np.concatenate(chunk.pieces)
            alignment = asyncio.wrap_future(self.aligner.submit(audio_samples, chunk.sample_rate, chunk.text))
            alignment.add_done_callback(self._notify)
        chunk.pieces = []
        self._finishing.append((chunk, alignment))
        self._notify()

    def _notify(self, *_: object) -> None:
        self._changed.set()

    def completed(self) -> list[dict[str, Any]]:
        """Final snapshots of the complete chunks whose words are ready now, in chunk order."""
        ready = []
        while self._finishing and (self._finishing[0][1] is None or self._finishing[0][1].done()):
            chunk, alignment = self._finishing.popleft()
            if alignment is not None:
                chunk.words = self._words(chunk, alignment)
            chunk.final_sent = True
            ready.append(chunk.fields())
        return ready

    def audio_fields(self) -> dict[str, Any] | None:
        """The fields for audio of the latest chunk: its growing snapshot while it is spoken,
        its final one once sent, and no alignment in between (None before any audio)."""
        chunk = self.latest
        if chunk is None:
            return None
        return chunk.fields(with_alignment=not chunk.complete or chunk.final_sent)

    async def drain(self) -> list[dict[str, Any]]:
        """Wait for every alignment under way and return the final snapshots not yet returned
        (the latest chunk counts as complete: the request has ended)."""
        self._complete_latest(spoken=True)
        for _, alignment in self._finishing:
            if alignment is not None:
                await asyncio.wait([alignment])
        return self.completed()

    async def forward(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        """Send each final snapshot as soon as it is ready, in chunk order, until `finish`."""
        while True:
            self._changed.clear()  # before looking: a change from now on wakes the wait below
            for fields in self.completed():
                await send(fields)
            if self._finished and not self._finishing:
                self._all_forwarded.set()
                return
            await self._changed.wait()

    async def finish(self) -> None:
        """The last request has ended: return once `forward` has sent every final snapshot."""
        self._complete_latest(spoken=True)
        self._finished = True
        self._notify()
        await self._all_forwarded.wait()

    def close(self) -> None:
        """Drop the alignments still queued (the stream is gone)."""
        for _, alignment in self._finishing:
            if alignment is not None:
                alignment.cancel()
        self._finishing.clear()

    @staticmethod
    def _words(chunk: ChunkTiming, alignment: asyncio.Future) -> list[WordTiming] | None:
        """The aligner's words; a failed alignment leaves the chunk-level snapshot."""
        if alignment.cancelled():
            return None
        error = alignment.exception()
        if error is not None:
            log.warning("word alignment of chunk %d failed: %r", chunk.seq, error)
            return None
        return alignment.result()


class TimedHandle(RequestHandle):
    """An engine handle whose audio chunks a SegmentTimer records as they pass; the request
    ends for the timer when the iteration does."""

    def __init__(self, handle: RequestHandle, timer: SegmentTimer) -> None:
        self.handle = handle
        self.timer = timer
        self.request_id = handle.request_id

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        async for chunk in self.handle:
            self.timer.record(chunk)
            yield chunk
        self.timer.end_request()

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.handle.finish_reason

    async def aclose(self) -> None:
        await self.handle.aclose()


def timestamp_event(data: bytes, fields: dict[str, Any] | None) -> bytes:
    """One event of the stream: audio bytes (possibly none) and the chunk they belong to."""
    fields = fields or {"content": "", "chunk_seq": 0, "chunk_audio_offset_sec": 0.0, "alignment": None}
    return sse_event({"audio_base64": base64.b64encode(data).decode("ascii"), **fields})


class TimestampedStream:
    """One engine request as the route's events: its audio through the request's encoder,
    labelled with the chunk it speaks, and each chunk's final snapshot once it is ready."""

    def __init__(self, handle: RequestHandle, encoder: audio.AudioEncoder, timer: SegmentTimer) -> None:
        self.timer = timer
        self.audio = EncodedAudio(timer.watch(handle), encoder)

    @property
    def audio_seconds(self) -> float:
        return self.audio.audio_seconds

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for data in self.audio:
            for fields in self.timer.completed():
                yield timestamp_event(b"", fields)
            yield timestamp_event(data, self.timer.audio_fields())
        for fields in await self.timer.drain():
            yield timestamp_event(b"", fields)

    async def aclose(self) -> None:
        self.timer.close()
        await self.audio.aclose()


router = APIRouter(tags=["tts"])
SECONDS_SCHEMA = {"type": "number", "minimum": 0}
# What each event's `data` line holds (OpenAPI 3.1 describes an event stream event by event:
# `data`, and the default `message` event name).
EVENT_DATA_SCHEMA = {
    "type": "object",
    "required": sorted(EVENT_KEYS),
    "properties": {
        "audio_base64": {"type": "string", "contentEncoding": "base64"},
        "content": {"type": "string"},
        "chunk_seq": {"type": "integer", "minimum": 0},
        "chunk_audio_offset_sec": SECONDS_SCHEMA,
        "alignment": {
            "anyOf": [
                {"type": "null"},
                {
                    "type": "object",
                    "properties": {
                        "audio_duration": SECONDS_SCHEMA,
                        "segments": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "properties": {
                                    "text": {"type": "string"},
                                    "start": SECONDS_SCHEMA,
                                    "end": SECONDS_SCHEMA,
                                },
                            },
                        },
                        "unit": {"enum": ["word", "chunk"]},
                    },
                },
            ]
        },
    },
}
EVENT_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": EVENT_DATA_SCHEMA,
        },
        "event": {"type": "string"},
    },
}


@router.post(
    ROUTE,
    response_class=StreamingResponse,
    responses={
        200: {
            "description": "Server-Sent Events: audio_base64, content, chunk_seq, chunk_audio_offset_sec, "
            "alignment (see docs/api.md)",
            "content": {SSE_MEDIA_TYPE: {"schema": EVENT_SCHEMA}},
        },
        **SYNTHESIS_ERRORS,
    },
    openapi_extra=request_body(TTSRequestBody),
)
async def text_to_speech_with_timestamps(
    request: Request,
    principal: Annotated[Principal, Depends(require_principal)],
    x_shoal_priority: Annotated[str | None, Header()] = None,
) -> AudioStreamResponse:
    """Fish `TTSRequest` in (msgpack or JSON), the audio and its timing out as Server-Sent Events."""
    body = await parse_model(request, TTSRequestBody)
    timer = SegmentTimer.for_request(request.app.state, body)
    opened = await open_synthesis(
        request,
        principal,
        body,
        request_priority(principal, x_shoal_priority),
        "tts_timestamp",
        lambda handle, encoder: TimestampedStream(handle, encoder, timer),
    )
    return event_stream_response(opened.first, opened.rest, opened.on_close)


def install(app: FastAPI, settings: ServerSettings) -> None:
    """Register the route and load the configured aligner, once per API process (AlignerError
    when it cannot be used; `shoal serve` checks the directory before anything starts)."""
    app.state.aligner = load_aligner(settings.aligner) if settings.aligner else None
    app.include_router(router)
