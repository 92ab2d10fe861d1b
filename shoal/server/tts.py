"""`POST /v1/tts` (JSON or msgpack) and the OpenAI-compatible `POST /v1/audio/speech`.

Audio streams out with chunked encoding while the engine produces it; `/v1/audio/speech` with
`stream_format: "sse"` wraps the same bytes in OpenAI's Server-Sent Events (base64
`speech.audio.delta` events, then one `speech.audio.done` with the usage). The response starts only
once the first audio bytes exist, so every failure before that (bad voice, overload, engine
error) still gets a proper status and Fish error body; a failure after it ends the body early.
A client that goes away aborts its engine request and frees its pages.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, NamedTuple, Protocol, TypeVar

import anyio
from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from shoal.engine.api import Engine, Priority, RequestHandle, SynthesisRequest
from shoal.server import audio
from shoal.server.auth import Principal, request_priority, require_principal
from shoal.server.errors import ApiError, exception_to_error
from shoal.server.limits import Limiter
from shoal.server.openapi import audio_response, body, errors
from shoal.server.schemas import OpenAISpeechBody, TTSRequestBody
from shoal.server.settings import ServerSettings
from shoal.server.synthesis import (
    DeliveryWatch,
    EncodedAudio,
    build_synthesis_request,
    make_encoder,
    parse_model,
)

log = logging.getLogger("shoal.server.tts")
OPENAI_BUILTIN_VOICES = frozenset(
    {
        "alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
        "shimmer", "verse",
    }
)  # fmt: skip
SSE_MEDIA_TYPE = "text/event-stream"
T = TypeVar("T")


class ResponseStream(Protocol):
    """What a synthesis response streams: its bytes, the audio they hold, and an abort."""

    audio_seconds: float

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def aclose(self) -> None: ...


# Builds a response's stream from the engine's handle and the request's format encoder.
StreamFactory = Callable[[RequestHandle, audio.AudioEncoder], ResponseStream]


async def start_stream(
    engine: Engine, synthesis: SynthesisRequest, stream_of: Callable[[RequestHandle], ResponseStream]
) -> tuple[ResponseStream, bytes, AsyncIterator[bytes]]:
    """Submit and wait for the first bytes, so errors before any audio become HTTP statuses."""
    stream = stream_of(engine.submit(synthesis))
    iterator = stream.__aiter__()
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        first = b""
    except BaseException:
        await stream.aclose()
        raise
    return stream, first, iterator


class AudioStreamResponse(StreamingResponse):
    """A chunked audio response that always runs `on_close` (abort + bookkeeping), including
    when the client disconnects and Starlette cancels the body task.

    A failure after the first bytes (the engine process died, the engine ended the request
    with an error) leaves the chunked body unterminated: the server closes the connection and
    the client sees a truncated response, never a short file that looks whole. It is logged
    here in one line, not raised: past the status line no error handler can answer it."""

    def __init__(self, first: bytes, rest: AsyncIterator[bytes], media_type: str, on_close: Callable) -> None:
        self.interrupted: BaseException | None = None

        async def body() -> AsyncIterator[bytes]:
            if first:
                yield first
            try:
                async for data in rest:
                    yield data
            except Exception as error:
                self.interrupted = error
                log.warning("audio stream ended early: %s", exception_to_error(error).message)

        super().__init__(body(), media_type=media_type)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_unless_interrupted(message: Message) -> None:
            ending = message["type"] == "http.response.body" and not message.get("more_body", False)
            if not (ending and self.interrupted is not None):
                await send(message)

        try:
            await super().__call__(scope, receive, send_unless_interrupted)
        finally:
            with anyio.CancelScope(shield=True):
                await self.on_close()


async def while_connected(request: Request, first: Callable[[], Awaitable[T]]) -> T:
    """`first()` (the first audio of a response), abandoned with a 499 if the client disconnects
    before it is done, e.g. while its request waits in a long queue, so that every failure before
    the response starts is an HTTP status. Once it starts, Starlette watches for the disconnect."""
    outcome: T | Exception | None = None
    async with anyio.create_task_group() as group:

        async def run_first() -> None:
            nonlocal outcome
            try:
                outcome = await first()
            except Exception as error:  # re-raised below, outside the task group's exception group
                outcome = error
            group.cancel_scope.cancel()

        group.start_soon(run_first)
        while (await request.receive())["type"] != "http.disconnect":
            pass  # the body was read already: the only message left to come is the disconnect
        group.cancel_scope.cancel()
    if isinstance(outcome, Exception):
        raise outcome
    if outcome is None:
        raise ApiError(499, "client closed the request before the first audio")
    return outcome


class OpenedSynthesis(NamedTuple):
    stream: ResponseStream
    first: bytes  # its first bytes (b"" when it ended without any)
    rest: AsyncIterator[bytes]
    encoder: audio.AudioEncoder
    on_close: Callable[[], Awaitable[None]]  # aborts the request, frees the slot, books the audio


async def open_synthesis(
    request: Request,
    principal: Principal,
    body: TTSRequestBody,
    priority: Priority,
    route: str,
    stream_of: StreamFactory = EncodedAudio,
) -> OpenedSynthesis:
    """What every synthesis route does before its response starts: check the text, resolve the
    voice, take a stream slot, submit, and wait for the first bytes while the client stays
    connected."""
    state = request.app.state
    settings: ServerSettings = state.settings
    engine: Engine = state.engine
    limiter: Limiter = state.limiter
    started = time.perf_counter()
    if not body.text.strip():
        raise ApiError(400, "text is empty")
    if len(body.text) > settings.max_text_length:  # before any voice work (inline clips are encoded)
        raise ApiError(413, f"text is longer than {settings.max_text_length} characters")
    encoder = make_encoder(body, engine.sample_rate)
    references = await state.voices.resolve(principal, body)
    synthesis = build_synthesis_request(body, references, priority, settings)
    observe_lag = state.metrics.delivery_lag_observer(route)

    def response_stream(handle: RequestHandle) -> ResponseStream:
        return stream_of(DeliveryWatch(handle, observe_lag), encoder)

    limiter.acquire(principal)
    try:
        stream, first, rest = await while_connected(
            request, lambda: start_stream(engine, synthesis, response_stream)
        )
    except BaseException:
        limiter.release(principal)
        raise
    state.metrics.observe_first_audio(route, time.perf_counter() - started)

    async def on_close() -> None:
        await stream.aclose()
        limiter.release(principal)
        state.metrics.observe_audio(stream.audio_seconds)

    return OpenedSynthesis(stream, first, rest, encoder, on_close)


def sse_event(payload: dict) -> bytes:
    """One Server-Sent Event: a `data:` line of JSON (the event's name is its `type` field, as in
    OpenAI's streams), then the blank line that ends it."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def speech_audio_delta(data: bytes) -> bytes:
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})


def speech_audio_done(generated_frames: int) -> bytes:
    """OpenAI's closing event. Usage counts the audio frames the model generated as output
    tokens (one DualAR step each); the text is tokenized in the engine, not here, so input
    tokens are reported as 0."""
    usage = {"input_tokens": 0, "output_tokens": generated_frames, "total_tokens": generated_frames}
    return sse_event({"type": "speech.audio.done", "usage": usage})


async def speech_events(
    rest: AsyncIterator[bytes], stream: EncodedAudio, frame_rate: float
) -> AsyncIterator[bytes]:
    """The encoded audio after the first bytes as `speech.audio.delta` events, then the done
    event. A failure mid-stream propagates, so the response is cut short without `done`."""
    async for data in rest:
        yield speech_audio_delta(data)
    yield speech_audio_done(round(stream.audio_seconds * frame_rate))


async def synthesize_response(
    request: Request,
    principal: Principal,
    body: TTSRequestBody,
    priority: Priority,
    route: str,
    server_sent_events: bool = False,
) -> AudioStreamResponse:
    """Shared by `/v1/tts` and `/v1/audio/speech`: resolve voice, check limits, stream audio
    (as OpenAI's speech events when `server_sent_events`)."""
    opened = await open_synthesis(request, principal, body, priority, route)
    if server_sent_events:
        first_event = speech_audio_delta(opened.first) if opened.first else b""
        events = speech_events(opened.rest, opened.stream, request.app.state.engine.frame_rate)
        return event_stream_response(first_event, events, opened.on_close)
    return AudioStreamResponse(opened.first, opened.rest, opened.encoder.content_type, opened.on_close)


def event_stream_response(
    first: bytes, rest: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]
) -> AudioStreamResponse:
    """Server-Sent Events, streamed as `AudioStreamResponse` streams audio (proxies told not to cache)."""
    response = AudioStreamResponse(first, rest, SSE_MEDIA_TYPE, on_close)
    response.headers["Cache-Control"] = "no-cache"
    return response


router = APIRouter(tags=["tts"])


SYNTHESIS_ERRORS = errors(400, 401, 404, 413, 422, 429, 500, 503)


@router.post(
    "/v1/tts",
    response_class=StreamingResponse,
    responses={**audio_response("the audio file, streamed as it is generated"), **SYNTHESIS_ERRORS},
    openapi_extra=body(TTSRequestBody),
)
async def text_to_speech(
    request: Request,
    principal: Annotated[Principal, Depends(require_principal)],
    x_shoal_priority: Annotated[str | None, Header()] = None,
) -> AudioStreamResponse:
    """Fish `TTSRequest` in (msgpack or JSON), audio file bytes out. The `model` header is
    accepted with any value: this server serves the one model it loaded."""
    body = await parse_model(request, TTSRequestBody)
    priority = request_priority(principal, x_shoal_priority)
    return await synthesize_response(request, principal, body, priority, "tts")


# One Server-Sent Event as OpenAPI 3.1 describes a stream's items: its `data` line, JSON.
SPEECH_EVENT_SCHEMA = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {
                "type": "object",
                "required": ["type"],
                "properties": {
                    "type": {"enum": ["speech.audio.delta", "speech.audio.done"]},
                    "audio": {"type": "string", "contentEncoding": "base64"},
                    "usage": {"type": "object"},
                },
            },
        }
    },
}


def speech_responses() -> dict[int | str, dict]:
    """The audio file, or with `stream_format: "sse"` OpenAI's speech events."""
    responses = audio_response("the audio file, or OpenAI's speech events, streamed as generated")
    responses[200]["content"][SSE_MEDIA_TYPE] = {"schema": SPEECH_EVENT_SCHEMA}
    return {**responses, **SYNTHESIS_ERRORS}


@router.post(
    "/v1/audio/speech",
    response_class=StreamingResponse,
    responses=speech_responses(),
    openapi_extra=body(OpenAISpeechBody, "application/json"),
)
async def openai_speech(
    request: Request, principal: Annotated[Principal, Depends(require_principal)]
) -> AudioStreamResponse:
    """OpenAI's speech endpoint: `voice` is a stored voice id (OpenAI's built-in names mean the
    model's default voice); `instructions` is accepted and ignored (no style prompt in DualAR)."""
    speech = await parse_model(request, OpenAISpeechBody)
    voice = speech.voice if speech.voice and speech.voice not in OPENAI_BUILTIN_VOICES else None
    body = TTSRequestBody(
        text=speech.input,
        reference_id=voice,
        format=speech.response_format,
        sample_rate=speech.output_sample_rate(),
        prosody={"speed": speech.speed} if speech.speed != 1.0 else None,  # type: ignore[arg-type]
    )
    priority = request_priority(principal, None)
    sse = speech.stream_format == "sse"
    return await synthesize_response(request, principal, body, priority, "openai", server_sent_events=sse)


@router.post("/v1/asr", include_in_schema=False)  # answers only to say it is not here
async def speech_to_text(principal: Annotated[Principal, Depends(require_principal)]) -> None:
    raise ApiError(501, "speech recognition (/v1/asr) is not part of Shoal; use a dedicated ASR server")
