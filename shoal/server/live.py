"""`/v1/tts/live`: the Fish live-TTS WebSocket.

Client -> server (binary msgpack maps): `start` {request}, then `text` {text}, `flush`, `stop`;
and Shoal's own `cancel` (barge-in). Server -> client: `audio` {audio: bin} events, then one
`finish` {reason: stop | error} per session; `cancelled` answers each `cancel`.

A connection carries sessions one after another. A session runs from `start` to its `finish`;
after `finish`/`stop` the socket stays open for the next `start` (LiveKit's Fish plugin reuses one
socket turn after turn; the official SDKs close it after `finish`). Within a session each `flush`
ends an utterance and the session waits for more text, its voice still prefilled: the voice is
resolved and prefilled at `start` (realtime priority), and a later `start` with the same voice
skips the prefill. Text is buffered and cut at sentence ends once `chunk_length` bytes are
waiting, and each cut is synthesized in order by the session's worker task while the reader
keeps receiving, so the event loop never waits on inference and the client's keepalive pings
are answered throughout. One encoder spans each session, so its `audio` payloads form one file.

`cancel` stops what the session has not spoken yet: the engine request being synthesized is
aborted (its KV pages are freed at the engine's next step), its queued audio is never encoded,
queued and buffered text is dropped, then `cancelled` is sent and the session goes on.

A connection holds a stream slot, so one that goes quiet is ended: no `start` within
`live_start_timeout` seconds of the handshake, or no message for `live_idle_timeout` seconds
while nothing is being synthesized, ends the session with a `finish`/`error` event and close code
1008. Between sessions (after a `finish`) the same silence closes the socket with code 1000 and
no event, since no session is there to finish.

A browser authenticates with subprotocols instead of the header (`shoal.server.auth`); since it
cannot read a refused handshake's body, it is refused in-band: accepted, then told why.
"""

from __future__ import annotations

import enum
import logging
import math
import re
import time
from dataclasses import dataclass

import anyio
import anyio.to_thread
import numpy as np
import ormsgpack
from anyio.abc import TaskGroup
from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from shoal.engine.api import Engine, FinishReason, Priority, RequestHandle, VoiceReference
from shoal.server.audio import AudioEncoder
from shoal.server.auth import BROWSER_SUBPROTOCOL, Principal, authenticate, offered_subprotocols
from shoal.server.errors import ApiError, error_response, exception_to_error
from shoal.server.limits import Limiter
from shoal.server.payload import MalformedPayload, decode_payload
from shoal.server.schemas import TTSRequestBody
from shoal.server.settings import ServerSettings
from shoal.server.synthesis import (
    DeliveryWatch,
    SynthesisFailed,
    build_synthesis_request,
    encode_chunk,
    make_encoder,
)
from shoal.server.timestamps import SegmentTimer

log = logging.getLogger("shoal.server.live")
ROUTE = "/v1/tts/live"
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
    """The client sent nothing for too long; the connection ends."""


TIMEOUT_CLOSE_CODE = 1008  # policy violation: the slot is not held by a silent client
TIMEOUT_STATUS = 408  # how /metrics counts a session ended for silence
FINISHED_STATUS = 101  # how /metrics counts a session that ended with `stop`
CLIENT_GONE_STATUS = 499  # a session (or a connection before its first) the client left


@dataclass(frozen=True)
class Segment:
    """Text cut from a session's buffer, spoken in order."""

    text: str
    epoch: int  # the session's cancel count when it was cut: a later `cancel` drops it


class Marker(enum.Enum):
    WAKE = "wake"  # a `cancel` arrived: the worker acknowledges it even while idle
    END = "end"  # `stop`: nothing more to speak, finish the session


def same_voice(a: tuple[VoiceReference, ...], b: tuple[VoiceReference, ...]) -> bool:
    return len(a) == len(b) and all(
        x.text == y.text and np.array_equal(x.codes, y.codes) for x, y in zip(a, b, strict=True)
    )


class LiveConnection:
    """One WebSocket connection: reads every client event and runs its sessions one after another,
    each session's worker in this connection's task group."""

    def __init__(self, websocket: WebSocket, principal: Principal) -> None:
        state = websocket.app.state
        self.websocket = websocket
        self.principal = principal
        self.engine: Engine = state.engine
        self.settings: ServerSettings = state.settings
        self.voices = state.voices
        self.metrics = state.metrics
        self.session: LiveSession | None = None  # from its `start` until its `finish` went out
        self.sessions_finished = 0
        self.counted = False  # /metrics has this connection's current state (False: none yet)
        self.pending = 0  # segments and `stop`s queued and not yet done: the client is not idle
        self.last_activity = time.monotonic()  # the last message, or the last segment spoken
        self.prefilled_voice: tuple[VoiceReference, ...] = ()  # the last voice prefilled here
        self.cancels_received = 0
        self.cancels_acknowledged = 0
        self.send_lock = anyio.Lock()  # the reader and a session's worker both send

    async def send_event(self, event: dict) -> None:
        async with self.send_lock:
            await self.websocket.send_bytes(pack(event))

    async def acknowledge_cancels(self) -> None:
        """One `cancelled` event per `cancel` received and not yet answered."""
        async with self.send_lock:
            while self.cancels_acknowledged < self.cancels_received:
                self.cancels_acknowledged += 1
                await self.websocket.send_bytes(pack({"event": "cancelled"}))

    def count(self, status: int) -> None:
        self.metrics.count(ROUTE, status)
        self.counted = True

    async def receive_event(self, timeout: float, waiting_for: str) -> dict:
        """The next message; SessionTimeout after `timeout` seconds of silence while nothing is
        pending (a client waiting for audio is not idle)."""
        while True:
            left = self.last_activity + timeout - time.monotonic()
            if left <= 0:
                if self.pending == 0:
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

    async def next_event(self) -> dict:
        settings = self.settings
        if self.session is not None:
            return await self.receive_event(settings.live_idle_timeout, "message")
        if self.sessions_finished:
            return await self.receive_event(settings.live_idle_timeout, "'start' event")
        return await self.receive_event(settings.live_start_timeout, "'start' event")

    async def read_events(self, group: TaskGroup) -> None:
        """Receive until the client leaves (WebSocketDisconnect), breaks the protocol, or is silent
        too long (SessionTimeout). Unknown events are ignored, as the protocol asks of both sides."""
        while True:
            event = await self.next_event()
            kind = event["event"]
            session = self.session  # (the worker clears it once the session's `finish` went out)
            if kind == "start":
                if session is not None:
                    raise ProtocolError("'start' may be sent again only after the session's 'finish' event")
                self.session = await self.open_session(event)
                self.counted = False
                group.start_soon(self.session.run)
                if self.session.timer is not None:  # `start` asked for `alignment` events
                    group.start_soon(self.session.timer.forward, self.session.send_alignment)
            elif kind == "cancel":
                self.cancels_received += 1
                if session is not None:
                    await session.cancel()
                if session is None or session.ending:  # no worker left to answer it
                    await self.acknowledge_cancels()
            elif kind in ("text", "flush", "stop"):
                if session is None:
                    if not self.sessions_finished:
                        raise ProtocolError(f"the first event must be 'start', got {kind!r}")
                    raise ProtocolError(
                        f"{kind!r} outside a session: the last session has finished; send 'start' first"
                    )
                if session.stopped:
                    raise ProtocolError(
                        f"{kind!r} after 'stop': wait for the session's 'finish', then send 'start'"
                    )
                if kind == "text":
                    text = event.get("text")
                    if not isinstance(text, str):
                        raise ProtocolError("'text' event needs a string 'text'")
                    session.add_text(text)
                elif kind == "flush":
                    session.flush()
                else:
                    session.stop()

    async def open_session(self, event: dict) -> LiveSession:
        try:
            body = TTSRequestBody.model_validate(event.get("request") or {})
        except ValidationError as error:
            raise exception_to_error(error) from error
        encoder = make_encoder(body, self.engine.sample_rate)  # a bad format or rate: 400 now
        references = await self.voices.resolve(self.principal, body)  # a missing voice: 404, named
        if references and not same_voice(references, self.prefilled_voice):
            await self.engine.prefill_voice(references)
            self.prefilled_voice = references
        wants_alignment = event.get("alignment") is True
        timer = SegmentTimer.for_request(self.websocket.app.state, body) if wants_alignment else None
        return LiveSession(self, body, references, encoder, timer)

    def session_finished(self, session: LiveSession) -> None:
        self.session = None
        self.sessions_finished += 1
        self.metrics.observe_audio(session.audio_seconds)
        self.count(FINISHED_STATUS)

    async def run(self) -> None:
        """Serve sessions until the client leaves (WebSocketDisconnect propagates), or end the
        connection after an error or a timeout, with the event and close code that say why."""
        try:
            async with anyio.create_task_group() as group:
                await self.read_events(group)
        except Exception as raised:
            if _is_disconnect(raised):
                raise
            await self.end_with(_unwrap(raised), raised)

    async def end_with(self, error: BaseException, raised: BaseException) -> None:
        if isinstance(error, SessionTimeout):
            if self.session is None and self.sessions_finished:  # idle between sessions
                await self.websocket.close(1000, "idle")
                return
            await self.finish_with_error(str(error))
            self.count(TIMEOUT_STATUS)
            await self.websocket.close(TIMEOUT_CLOSE_CODE, "idle timeout")
            return
        if isinstance(error, ProtocolError):
            error = ApiError(400, str(error))
        api_error = exception_to_error(error)
        if api_error.status == 500:
            log.error("live session failed", exc_info=raised)
        elif api_error.status >= 500:  # a refusal (503: at capacity, or the engine away), not a fault
            log.warning("live session ended with %d: %s", api_error.status, api_error.message)
        await self.finish_with_error(api_error.message)
        self.count(api_error.status)
        await self.websocket.close(1000)

    async def finish_with_error(self, message: str) -> None:
        await self.send_event({"event": "finish", "reason": "error", "message": message})

    def close(self) -> None:
        """The connection is over: book what /metrics has not seen (a session cut short by the
        client, or a connection that never finished a session, counts as 499)."""
        if self.session is not None:
            self.metrics.observe_audio(self.session.audio_seconds)
        if not self.counted:
            self.count(CLIENT_GONE_STATUS)


class LiveSession:
    """One session, from `start` to its `finish`: the connection's reader feeds it text and
    control events; `run` (its worker task) speaks the segments in order into the one encoder."""

    def __init__(
        self,
        connection: LiveConnection,
        body: TTSRequestBody,
        references: tuple[VoiceReference, ...],
        encoder: AudioEncoder,
        timer: SegmentTimer | None = None,
    ) -> None:
        self.connection = connection
        self.timer = timer  # `alignment` events (opt-in at `start`): each text batch's timing
        self.engine = connection.engine
        self.settings = connection.settings
        self.delivery_lag = connection.metrics.delivery_lag_observer("live")
        self.body = body
        self.references = references
        self.encoder = encoder
        self.buffer = body.text or ""
        self.utterance_chars = 0  # text since the last `flush` (or `cancel`): the length limit's
        self.count_text(self.buffer)
        self.epoch = 0  # `cancel`s so far: segments cut before the last one are dropped
        self.stopped = False  # `stop` received: no more text
        self.ending = False  # the worker is past the last segment (it answers no more `cancel`)
        self.current: RequestHandle | None = None  # the engine request being spoken
        self.first_text_at: float | None = None
        self.audio_sent = False
        self.audio_seconds = 0.0
        self._queue_in, self._queue_out = anyio.create_memory_object_stream[Segment | Marker](math.inf)

    def count_text(self, text: str) -> None:
        self.utterance_chars += len(text)
        limit = self.settings.max_text_length
        if self.utterance_chars > limit:
            raise ApiError(413, f"utterance text exceeds {limit} characters (the text since the last flush)")

    def queue(self, item: Segment | Marker) -> None:
        if item is not Marker.WAKE:
            self.connection.pending += 1
        self._queue_in.send_nowait(item)

    def add_text(self, text: str) -> None:
        self.count_text(text)
        if self.first_text_at is None and text.strip():
            self.first_text_at = time.perf_counter()
        self.buffer += text
        ready, self.buffer = split_ready_text(self.buffer, self.body.chunk_length)
        if ready.strip():
            self.queue(Segment(ready, self.epoch))

    def flush(self) -> None:
        """End the utterance: synthesize the buffer now."""
        if self.buffer.strip():
            self.queue(Segment(self.buffer, self.epoch))
        self.buffer = ""
        self.utterance_chars = 0

    def stop(self) -> None:
        self.flush()
        self.stopped = True
        self.queue(Marker.END)

    async def cancel(self) -> None:
        """Barge-in: drop the buffered and queued text and abort the engine request being spoken
        (the engine frees its pages at its next step); the worker then answers `cancelled`."""
        self.epoch += 1
        self.buffer = ""
        self.utterance_chars = 0
        current = self.current
        if current is not None:
            with anyio.CancelScope(shield=True):
                await current.aclose()
        if not self.ending:
            self.queue(Marker.WAKE)

    async def send_audio(self, data: bytes) -> None:
        if not data:
            return
        if not self.audio_sent and self.first_text_at is not None:
            self.connection.metrics.observe_first_audio("live", time.perf_counter() - self.first_text_at)
        self.audio_sent = True
        await self.connection.send_event({"event": "audio", "audio": data})

    async def send_alignment(self, fields: dict) -> None:
        await self.connection.send_event({"event": "alignment", **fields})

    async def speak(self, segment: Segment) -> None:
        """Synthesize one segment into the session encoder. After a `cancel`, no further audio of
        it is encoded: what was being encoded when it came (at most one chunk) is the last."""
        request = build_synthesis_request(
            self.body, self.references, Priority.REALTIME, self.settings, text=segment.text
        )
        handle = DeliveryWatch(self.engine.submit(request), self.delivery_lag)
        self.current = handle
        try:
            async for chunk in handle:
                if segment.epoch != self.epoch:
                    break
                if self.timer is not None:
                    self.timer.record(chunk)
                self.audio_seconds += len(chunk.samples) / chunk.sample_rate
                await self.send_audio(await encode_chunk(self.encoder, chunk.samples))
            else:
                failed = handle.finish_reason in (FinishReason.ERROR, FinishReason.ABORTED)
                if failed and segment.epoch == self.epoch:
                    raise SynthesisFailed(handle.finish_reason)
        finally:
            if self.timer is not None:  # a cancelled utterance keeps its timing, gets no words
                self.timer.end_request(spoken=segment.epoch == self.epoch)
            self.current = None
            self.connection.last_activity = time.monotonic()
            with anyio.CancelScope(shield=True):
                await handle.aclose()  # aborts the request if it still runs (cancel, client gone)

    async def run(self) -> None:
        """The worker: segments in order until `stop`, then the encoder's tail and `finish`."""
        connection = self.connection
        try:
            async for item in self._queue_out:
                await connection.acknowledge_cancels()
                if item is Marker.END:
                    break
                if isinstance(item, Segment):
                    try:
                        if item.epoch == self.epoch:
                            await self.speak(item)
                    finally:
                        connection.pending -= 1
        finally:
            self.ending = True  # (with the queue closed: a `cancel` queues no WAKE from now on)
            self._queue_in.close()
            self._queue_out.close()
        await connection.acknowledge_cancels()
        # Flush whenever audio went in, even if no bytes came out yet: an mp3 encoder at a low rate
        # holds a short session's audio until finish. A session without audio sends nothing.
        if self.audio_sent or self.audio_seconds > 0:
            await self.send_audio(await anyio.to_thread.run_sync(self.encoder.finish))
        if self.timer is not None:
            await self.timer.finish()  # every `alignment` event before `finish`
        await connection.send_event({"event": "finish", "reason": "stop"})
        connection.pending -= 1  # the `stop`
        connection.last_activity = time.monotonic()
        connection.session_finished(self)


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


async def refuse_in_band(websocket: WebSocket, error: ApiError) -> None:
    """A browser cannot read a refused handshake's body, so a browser client (it offered
    `shoal.live`) is accepted and told why in a `finish`/`error` event, then the socket closes."""
    event = {"event": "finish", "reason": "error", "message": error.message, "status": error.status}
    try:
        await websocket.accept(subprotocol=BROWSER_SUBPROTOCOL)
        await websocket.send_bytes(pack(event))
        await websocket.close(1013 if error.status in (429, 503) else 1008)  # 1013: try again later
    except (WebSocketDisconnect, OSError):
        pass  # the browser left first


@router.websocket(ROUTE)
async def live_tts(websocket: WebSocket) -> None:
    state = websocket.app.state
    limiter: Limiter = state.limiter
    from_browser = BROWSER_SUBPROTOCOL in offered_subprotocols(websocket)
    try:
        principal = await authenticate(websocket)
        limiter.acquire(principal)
    except ApiError as error:
        state.metrics.count(ROUTE, error.status)
        if from_browser:
            await refuse_in_band(websocket, error)
        else:
            await websocket.send_denial_response(error_response(error.status, error.message, error.headers))
        return
    connection = LiveConnection(websocket, principal)
    try:  # from here on the stream slot is held: every path, accept included, releases it
        await websocket.accept(subprotocol=BROWSER_SUBPROTOCOL if from_browser else None)
        await connection.run()
    except BaseException as error:
        if not (_is_disconnect(error) or isinstance(error, OSError)):  # OSError: client gone
            raise
    finally:
        limiter.release(principal)
        connection.close()
