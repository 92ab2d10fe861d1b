"""What the synthesis routes share (`/v1/tts` and OpenAI speech, `/v1/tts/live`, `/v1/jobs`):
reading a request body into its schema, mapping it onto the engine's `SynthesisRequest`, and
piping an engine request's audio through the request's format encoder.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import anyio
import anyio.to_thread
from fastapi import Request
from pydantic import ValidationError

from shoal.engine.api import (
    AudioChunk,
    FinishReason,
    Priority,
    RequestHandle,
    SamplingOptions,
    SynthesisRequest,
    VoiceReference,
)
from shoal.server import audio
from shoal.server.errors import ApiError, exception_to_error
from shoal.server.payload import MalformedPayload, decode_payload
from shoal.server.schemas import OpenAISpeechBody, TTSRequestBody
from shoal.server.settings import ServerSettings

THREADED_PARSE_BYTES = 256 * 1024


class SynthesisFailed(ApiError):
    """The engine ended a request with an error (before the first audio: a 500 answer; after
    it: the chunked body ends early, which the client sees as a truncated response)."""

    def __init__(self, reason: FinishReason | None) -> None:
        super().__init__(500, f"synthesis failed (engine finish reason: {reason})")


def build_synthesis_request(
    body: TTSRequestBody,
    references: tuple[VoiceReference, ...],
    priority: Priority,
    settings: ServerSettings,
    text: str | None = None,
) -> SynthesisRequest:
    """Map the Fish request fields onto the engine's request (limits applied here)."""
    text = body.text if text is None else text
    if len(text) > settings.max_text_length:
        raise ApiError(413, f"text is longer than {settings.max_text_length} characters")
    sampling = SamplingOptions(
        # The reference implementation needs temperature and top_p in [0.1, 1]; the cloud allows 0.
        temperature=min(max(body.temperature, 0.1), 1.0),
        top_p=min(max(body.top_p, 0.1), 1.0),
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
    )
    return SynthesisRequest(
        text=text,
        references=references,
        sampling=sampling,
        priority=priority,
        max_new_frames=min(body.max_new_tokens, settings.max_new_frames),
        chunk_length=body.chunk_length,
        latency=body.latency,
    )


def make_encoder(body: TTSRequestBody, input_sample_rate: int, streaming: bool = True) -> audio.AudioEncoder:
    """The request's format encoder (a bad format, rate or bitrate is a 400). `streaming=False`
    for a whole file, e.g. a bulk-job item: a wav then carries its exact sizes."""
    prosody = body.prosody
    try:
        return audio.create_encoder(
            body.format,
            input_sample_rate=input_sample_rate,
            sample_rate=body.sample_rate,
            mp3_bitrate=body.mp3_bitrate,
            opus_bitrate=body.opus_bitrate,
            speed=prosody.speed if prosody else 1.0,
            volume_db=prosody.volume if prosody else 0.0,
            streaming=streaming,
        )
    except audio.AudioFormatError as error:
        raise ApiError(400, str(error)) from error


async def encode_chunk(encoder: audio.AudioEncoder, samples) -> bytes:
    """`encoder.write` in place when it is cheap (PCM and wav at the model's rate), else on a
    worker thread (mp3, opus, resampling), so the event loop never waits for an encoder."""
    if encoder.cheap:  # a hop to a worker thread would cost ten times the work
        return encoder.write(samples)
    return await anyio.to_thread.run_sync(encoder.write, samples)


class DeliveryWatch(RequestHandle):
    """`handle`, timing each audio chunk from the engine's handover (`AudioChunk.ready_at`) to
    the moment its consumer asks for the next one, which it does once this one is encoded and
    written to the client's connection: the delay a listener hears that the engine did not make
    (the wire from the engine process, format encoding, a busy event loop)."""

    def __init__(self, handle: RequestHandle, observe: Callable[[float], None]) -> None:
        self.handle, self.observe = handle, observe
        self.request_id = handle.request_id

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        async for chunk in self.handle:
            yield chunk
            if chunk.ready_at is not None:
                self.observe(time.monotonic() - chunk.ready_at)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.handle.finish_reason

    async def aclose(self) -> None:
        await self.handle.aclose()


class EncodedAudio:
    """One engine request piped through a format encoder, as an async iterator of file bytes."""

    def __init__(
        self, handle: RequestHandle, encoder: audio.AudioEncoder, finish_encoder: bool = True
    ) -> None:
        self.handle = handle
        self.encoder = encoder
        self.finish_encoder = finish_encoder  # False: the encoder continues past this request (live)
        self.audio_seconds = 0.0
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.handle:
            self.audio_seconds += len(chunk.samples) / chunk.sample_rate
            data = await encode_chunk(self.encoder, chunk.samples)
            if data:
                yield data
        if self.handle.finish_reason in (FinishReason.ERROR, FinishReason.ABORTED):
            raise SynthesisFailed(self.handle.finish_reason)
        if self.finish_encoder:
            tail = await anyio.to_thread.run_sync(self.encoder.finish)
            if tail:
                yield tail

    async def aclose(self) -> None:
        """Abort the engine request if it still runs; safe to call twice, even while cancelled."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self.handle.aclose()


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, refusing more than `limit` bytes (413) even without a Content-Length."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body larger than {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body larger than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def decode_body(raw: bytes, content_type: str) -> object:
    """msgpack when the Content-Type says so (what the SDKs send), JSON otherwise."""
    if not raw:
        raise ApiError(400, "request body is empty")
    try:
        return decode_payload(raw, msgpack="msgpack" in content_type)
    except MalformedPayload as error:
        raise ApiError(400, str(error)) from error


async def parse_model(request: Request, model: type[TTSRequestBody] | type[OpenAISpeechBody]):
    raw = await read_body(request, request.app.state.settings.max_body_bytes)
    content_type = request.headers.get("content-type", "")

    def parse() -> TTSRequestBody | OpenAISpeechBody:
        data = decode_body(raw, content_type)
        if not isinstance(data, dict):
            raise ApiError(422, "request body must be an object")
        try:
            return model.model_validate(data)
        except ValidationError as error:
            raise exception_to_error(error) from error

    # Bodies with inline reference audio (megabytes of JSON base64) parse in a worker thread.
    return await anyio.to_thread.run_sync(parse) if len(raw) > THREADED_PARSE_BYTES else parse()
