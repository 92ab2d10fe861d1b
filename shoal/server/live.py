"""`/v1/tts/live`: the Fish live-TTS WebSocket.

Client -> server (binary msgpack maps): `start` {request}, then `text` {text}, `flush`, `stop`.
Server -> client: `audio` {audio: bin} events, then one `finish` {reason: stop | error}.

The voice is resolved and prefilled at `start` (realtime priority), text is buffered and cut at
sentence ends once `chunk_length` bytes are waiting, and each cut is synthesized in order by one
worker task while the reader keeps receiving, so the event loop never waits on inference and the
client's keepalive pings are answered throughout. One encoder spans the whole session, so the
concatenated `audio` payloads form one valid file.

A session holds a stream slot, so one that goes quiet is ended: no `start` within
`live_start_timeout` seconds of the handshake, or no message for `live_idle_timeout` seconds
while nothing is being synthesized, ends it with a `finish`/`error` event and close code 1008.
"""

from __future__ import annotations

import logging
import math
import re
import time

import anyio
import anyio.to_thread
import ormsgpack
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from shoal.engine.api import Engine, Priority, SynthesisRequest, VoiceReference
from shoal.server.auth import Principal, authenticate
from shoal.server.errors import ApiError, error_response, exception_to_error
from shoal.server.limits import Limiter
from shoal.server.payload import MalformedPayload, decode_payload
from shoal.server.schemas import TTSRequestBody
from shoal.server.settings import ServerSettings
from shoal.server.synthesis import EncodedAudio, build_synthesis_request, make_encoder

log = logging.getLogger("shoal.server.live")
# Latin punctuation ends a sentence only before whitespace (never inside "3.14" or "e.g.x"); CJK
# punctuation and newlines always do.
SENTENCE_END = re.compile(r"[.!?;]+\s+|[。！？；\n]\s*")
router = APIRouter(tags=["live"])


def split_ready_text(buffer: str, chunk_length: int) -> tuple[str, str]:
    """(segment to synthesize now, rest to keep): cut at the last sentence end once the buffer
    holds `chunk_length` bytes; without a sentence end, wait for twice that before cutting."""
    if len(buffer.encode("utf-8")) < chunk_length:
        return "", buffer
    ends = [match.end() for match in SENTENCE_END.finditer(buffer)]
    if ends:
        return buffer[: ends[-1]], buffer[ends[-1] :]
    if len(buffer.encode("utf-8")) >= 2 * chunk_length:
        cut = buffer.rfind(" ")
        cut = cut if cut > 0 else len(buffer)
        return buffer[:cut], buffer[cut:]
    return "", buffer


class ProtocolError(Exception):
    """The client broke the live protocol; the session ends with `finish/error`."""


def pack(event: dict) -> bytes:
    return ormsgpack.packb(event)


class SessionTimeout(Exception):
    """The client sent nothing for too long; the session ends (close code 1008)."""


TIMEOUT_CLOSE_CODE = 1008  # policy violation: the slot is not held by a silent client
TIMEOUT_STATUS = 408  # how /metrics counts a session ended for silence


class LiveSession:
    """One WebSocket connection from `start` to `finish`."""

    def __init__(self, websocket: WebSocket, principal: Principal) -> None:
        state = websocket.app.state
        self.websocket = websocket
        self.principal = principal
        self.engine: Engine = state.engine
        self.settings: ServerSettings = state.settings
        self.voices = state.voices
        self.metrics = state.metrics
        self.first_text_at: float | None = None
        self.audio_sent = False
        self.audio_seconds = 0.0
        self.segments_pending = 0  # sent to the synthesizer and not yet spoken
        self.last_activity = time.monotonic()  # the last message, or the last segment spoken

    async def receive_event(self, timeout: float, waiting_for: str) -> dict:
        """The next message; SessionTimeout after `timeout` seconds of silence while no segment
        is pending (a client waiting for audio is not idle)."""
        while True:
            left = self.last_activity + timeout - time.monotonic()
            if left <= 0:
                if self.segments_pending == 0:
                    raise SessionTimeout(f"no {waiting_for} for {timeout:g} s: closing the session")
                left = timeout  # audio still to come; the last spoken segment restarts the clock
            with anyio.move_on_after(left):
                message = await self.websocket.receive()
                break
        self.last_activity = time.monotonic()
        if message["type"] == "websocket.disconnect":
            raise WebSocketDisconnect(message.get("code", 1000))
        data = message.get("bytes")
        size = len(data) if data is not None else len((message.get("text") or "").encode("utf-8"))
        limit = self.settings.max_body_bytes
        if size > limit:
            raise ProtocolError(f"a message of {size} bytes exceeds the {limit}-byte limit")
        try:
            if data is not None:
                event = decode_payload(data, msgpack=True)
            else:
                event = decode_payload(message.get("text") or "", msgpack=False)
        except MalformedPayload as error:
            raise ProtocolError(f"malformed message: {error}") from error
        if not isinstance(event, dict) or not isinstance(event.get("event"), str):
            raise ProtocolError("every message must be a map with an 'event' key")
        return event

    async def send_audio(self, data: bytes) -> None:
        if not data:
            return
        if not self.audio_sent and self.first_text_at is not None:
            self.metrics.observe_first_audio("live", time.perf_counter() - self.first_text_at)
        self.audio_sent = True
        await self.websocket.send_bytes(pack({"event": "audio", "audio": data}))

    async def start(self) -> tuple[TTSRequestBody, tuple[VoiceReference, ...]]:
        event = await self.receive_event(self.settings.live_start_timeout, "'start' event")
        if event["event"] != "start":
            raise ProtocolError(f"the first event must be 'start', got {event['event']!r}")
        try:
            body = TTSRequestBody.model_validate(event.get("request") or {})
        except ValidationError as error:
            raise exception_to_error(error) from error
        references = await self.voices.resolve(self.principal, body)
        if references:
            await self.engine.prefill_voice(references)
        return body, references

    async def read_text(self, body: TTSRequestBody, segments: MemoryObjectSendStream[str]) -> None:
        """Buffer `text` events into segments until `stop` (which flushes the rest)."""
        buffer = body.text or ""
        total = len(buffer)
        if total > self.settings.max_text_length:
            raise ApiError(413, f"session text exceeds {self.settings.max_text_length} characters")
        async with segments:
            while True:
                event = await self.receive_event(self.settings.live_idle_timeout, "message")
                kind = event["event"]
                if kind == "text":
                    text = event.get("text")
                    if not isinstance(text, str):
                        raise ProtocolError("'text' event needs a string 'text'")
                    total += len(text)
                    if total > self.settings.max_text_length:
                        raise ApiError(
                            413, f"session text exceeds {self.settings.max_text_length} characters"
                        )
                    if self.first_text_at is None and text.strip():
                        self.first_text_at = time.perf_counter()
                    buffer += text
                    ready, buffer = split_ready_text(buffer, body.chunk_length)
                    if ready.strip():
                        self.segments_pending += 1
                        await segments.send(ready)
                elif kind in ("flush", "stop"):
                    if buffer.strip():
                        self.segments_pending += 1
                        await segments.send(buffer)
                    buffer = ""
                    if kind == "stop":
                        return
                elif kind == "start":
                    raise ProtocolError("'start' may be sent only once per session")
                # Unknown events are ignored, as the protocol asks of both sides.

    async def synthesize(
        self,
        body: TTSRequestBody,
        references: tuple[VoiceReference, ...],
        segments: MemoryObjectReceiveStream[str],
    ) -> None:
        """Synthesize segments in order into the one session encoder."""
        encoder = make_encoder(body, self.engine.sample_rate)
        async with segments:
            async for text in segments:
                request: SynthesisRequest = build_synthesis_request(
                    body, references, Priority.REALTIME, self.settings, text=text
                )
                stream = EncodedAudio(self.engine.submit(request), encoder, finish_encoder=False)
                try:
                    async for data in stream:
                        await self.send_audio(data)
                finally:
                    self.audio_seconds += stream.audio_seconds
                    self.segments_pending -= 1
                    self.last_activity = time.monotonic()
                    await stream.aclose()
        # Flush whenever audio went in, even if no bytes came out yet: an mp3 encoder at a low rate
        # holds a short session's audio until finish. A session without audio sends nothing.
        if self.audio_sent or self.audio_seconds > 0:
            await self.send_audio(await anyio.to_thread.run_sync(encoder.finish))

    async def run(self) -> int:
        """Serve the session until its `finish` event; returns the status /metrics counts it
        under (101 for a session that ended with `stop`)."""
        try:
            body, references = await self.start()
            send_segments, receive_segments = anyio.create_memory_object_stream[str](math.inf)
            async with anyio.create_task_group() as group:
                group.start_soon(self.synthesize, body, references, receive_segments)
                await self.read_text(body, send_segments)
            await self.websocket.send_bytes(pack({"event": "finish", "reason": "stop"}))
            return 101
        except Exception as raised:
            if _is_disconnect(raised):
                raise
            error = _unwrap(raised)
            if isinstance(error, SessionTimeout):
                await self.finish_with_error(str(error))
                await self.websocket.close(TIMEOUT_CLOSE_CODE, "idle timeout")
                return TIMEOUT_STATUS
            if isinstance(error, ProtocolError):
                error = ApiError(400, str(error))
            error = exception_to_error(error)
            if error.status == 500:
                log.error("live session failed", exc_info=raised)
            elif error.status >= 500:  # a refusal (503: at capacity, or the engine away), not a fault
                log.warning("live session ended with %d: %s", error.status, error.message)
            await self.finish_with_error(error.message)
            return error.status

    async def finish_with_error(self, message: str) -> None:
        await self.websocket.send_bytes(pack({"event": "finish", "reason": "error", "message": message}))


def _is_disconnect(error: BaseException) -> bool:
    if isinstance(error, WebSocketDisconnect):
        return True
    if isinstance(error, BaseExceptionGroup):
        return any(_is_disconnect(inner) for inner in error.exceptions)
    return False


def _unwrap(error: BaseException) -> BaseException:
    """The first real error inside (possibly nested) task-group exception groups."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return error


@router.websocket("/v1/tts/live")
async def live_tts(websocket: WebSocket) -> None:
    state = websocket.app.state
    limiter: Limiter = state.limiter
    try:
        principal = await authenticate(websocket)
        limiter.acquire(principal)
    except ApiError as error:
        state.metrics.count("/v1/tts/live", error.status)
        await websocket.send_denial_response(error_response(error.status, error.message, error.headers))
        return
    session = LiveSession(websocket, principal)
    status = 499  # the client went away before the session's finish
    try:  # from here on the stream slot is held: every path, accept included, releases it
        await websocket.accept()
        status = await session.run()
        if status != TIMEOUT_STATUS:  # a timeout has closed the socket with its own code
            await websocket.close(1000)
    except BaseException as error:
        if not (_is_disconnect(error) or isinstance(error, OSError)):  # OSError: client gone
            raise
    finally:
        limiter.release(principal)
        state.metrics.observe_audio(session.audio_seconds)
        state.metrics.count("/v1/tts/live", status)
