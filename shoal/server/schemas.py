"""Request and response bodies of the Fish Audio API, as the official clients send and validate them.

Requests are lenient where the clients differ (nulls for optional fields, unknown keys, both
opus bitrate scales); responses carry every field the new client validates strictly.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shoal.server.audio import canonical_format

# "ulaw" is accepted as another name for "mulaw" (validated bodies carry the canonical name).
AudioFormat = Literal["wav", "pcm", "mp3", "opus", "mulaw", "ulaw", "alaw"]
OpenAIResponseFormat = Literal["mp3", "opus", "wav", "pcm", "mulaw", "ulaw", "alaw"]
# OpenAI's `pcm` is 24 kHz s16le; a raw stream carries no rate, so OpenAI clients assume it.
OPENAI_PCM_SAMPLE_RATE = 24000
# Listing pages past this are refused (422): offsets stay far inside every database's integers.
MAX_PAGE_NUMBER = 1_000_000
Visibility = Literal["public", "unlist", "private"]


class LenientModel(BaseModel):
    """Ignore unknown keys, and treat an explicit null like an omitted field (the legacy client
    sends `model_dump()` with nulls for every optional field)."""

    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class ReferenceAudio(LenientModel):
    """Inline voice sample: audio bytes (msgpack bin, or base64 in JSON) and its transcript."""

    audio: bytes
    text: str = ""

    @field_validator("audio", mode="before")
    @classmethod
    def _decode_base64(cls, value: Any) -> Any:
        if isinstance(value, str):
            try:
                return base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise ValueError("audio must be bytes (msgpack bin) or a base64 string") from exc
        return value


class Prosody(LenientModel):
    speed: float = Field(1.0, ge=0.5, le=2.0)
    volume: float = Field(0.0, ge=-20.0, le=20.0)  # dB
    normalize_loudness: bool = True


class TTSRequestBody(LenientModel):
    """`POST /v1/tts` and the WebSocket `start` event's `request` (cloud `TTSRequest` schema)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"text": "Hello from Shoal.", "format": "mp3"},
                {"text": "Hi.", "format": "pcm", "seed": 1},
            ]
        }
    )

    text: str = ""
    temperature: float = Field(0.7, ge=0.0, le=1.0)
    top_p: float = Field(0.7, ge=0.0, le=1.0)
    references: list[ReferenceAudio] | list[list[ReferenceAudio]] = []
    reference_id: str | list[str] | None = None
    prosody: Prosody | None = None
    chunk_length: int = Field(200, ge=100, le=1000)
    normalize: bool = True
    format: AudioFormat = "mp3"
    sample_rate: int | None = Field(None, ge=8000, le=48000)
    mp3_bitrate: Literal[64, 128, 192] = 128
    # kbps (SDK) or bps (cloud schema); audio.create_encoder checks the value, the bounds keep it
    # within what msgpack (the SDK's body) can carry.
    opus_bitrate: int = Field(-1000, ge=-(2**31), lt=2**31)
    latency: Literal["low", "normal", "balanced"] = "normal"
    max_new_tokens: int = Field(1024, ge=1, le=8192)
    repetition_penalty: float = Field(1.2, ge=0.5, le=2.0)
    min_chunk_length: int = Field(50, ge=0, le=1000)
    condition_on_previous_chunks: bool = True
    early_stop_threshold: float = Field(1.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # the engine's seeds are int64

    @field_validator("format")
    @classmethod
    def _canonical_format(cls, value: str) -> str:
        return canonical_format(value)

    def flat_references(self) -> list[ReferenceAudio]:
        """Inline references in speaker order (a 2-D list is one list per speaker)."""
        flat: list[ReferenceAudio] = []
        for item in self.references:
            flat.extend(item if isinstance(item, list) else [item])
        return flat

    def reference_ids(self) -> list[str]:
        if self.reference_id is None or self.reference_id == "":
            return []
        return [self.reference_id] if isinstance(self.reference_id, str) else list(self.reference_id)


class OpenAISpeechBody(LenientModel):
    """`POST /v1/audio/speech` (OpenAI-compatible): `voice` is a stored voice id.

    `stream_format: "sse"` answers with OpenAI's `speech.audio.delta` / `speech.audio.done`
    events instead of the bare file. `instructions` is accepted and ignored: the DualAR models
    take no style prompt. `sample_rate` is Shoal's own (OpenAI has none); without it `pcm` is
    24 kHz as OpenAI's, mulaw/alaw 8 kHz, the other formats the Fish defaults."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"input": "Hello.", "response_format": "wav"},
                {"input": "Hello.", "response_format": "pcm", "stream_format": "sse"},
            ]
        }
    )

    input: str
    model: str = "s2-pro"
    voice: str | None = None
    response_format: OpenAIResponseFormat = "mp3"
    speed: float = Field(1.0, ge=0.5, le=2.0)
    instructions: str | None = None
    stream_format: Literal["audio", "sse"] = "audio"
    sample_rate: int | None = Field(None, ge=8000, le=48000)

    @field_validator("response_format")
    @classmethod
    def _canonical_format(cls, value: str) -> str:
        return canonical_format(value)

    def output_sample_rate(self) -> int | None:
        """The rate to encode at; None leaves it to the format's default."""
        if self.sample_rate is None and self.response_format == "pcm":
            return OPENAI_PCM_SAMPLE_RATE
        return self.sample_rate


# ---- voices ---------------------------------------------------------------------------------


class Author(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    id: str = Field(alias="_id")
    nickname: str
    avatar: str = ""


class Sample(BaseModel):
    title: str
    text: str
    task_id: str
    audio: str


class VoiceEntity(BaseModel):
    """The cloud `ModelEntity`; serialize with `by_alias=True` so `id` goes out as `_id`."""

    model_config = ConfigDict(populate_by_name=True)
    id: str = Field(alias="_id")
    type: Literal["svc", "tts"] = "tts"
    title: str
    description: str = ""
    cover_image: str = ""
    train_mode: Literal["fast"] = "fast"
    state: Literal["created", "training", "trained", "failed"] = "trained"
    tags: list[str] = []
    samples: list[Sample] = []
    created_at: dt.datetime
    updated_at: dt.datetime
    languages: list[str] = []
    visibility: Visibility = "private"
    lock_visibility: bool = False
    like_count: int = 0
    mark_count: int = 0
    shared_count: int = 0
    task_count: int = 0
    liked: bool = False
    marked: bool = False
    author: Author


class VoicePage(BaseModel):
    total: int
    items: list[VoiceEntity]
    has_more: bool = False


class DeletedVoice(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    id: str = Field(alias="_id")
    deleted: bool = True


# ---- fish-speech's reference routes ----------------------------------------------------------

REFERENCE_ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ReferenceDeleteBody(BaseModel):
    reference_id: str = Field(pattern=REFERENCE_ID_PATTERN)


class ReferenceRenameBody(BaseModel):
    old_reference_id: str = Field(pattern=REFERENCE_ID_PATTERN)
    new_reference_id: str = Field(pattern=REFERENCE_ID_PATTERN)


class ReferenceReply(BaseModel):
    """What the reference routes answer (msgpack, or JSON when asked); each route sets the
    fields that concern it."""

    success: bool
    message: str
    reference_id: str | None = None
    reference_ids: list[str] | None = None
    old_reference_id: str | None = None
    new_reference_id: str | None = None


# ---- account --------------------------------------------------------------------------------


class Credits(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    id: str = Field(alias="_id")
    user_id: str
    credit: str
    created_at: str
    updated_at: str
    has_phone_sha256: bool = False
    has_free_credit: bool = True


class Package(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    id: str = Field(alias="_id")
    user_id: str
    type: str
    total: int
    balance: int
    created_at: str
    updated_at: str
    finished_at: str


class EngineHealth(BaseModel):
    """One engine process of several (`shoal serve --gpus`)."""

    index: int  # its place in --gpus
    up: bool  # answers now; while False its requests fail with 503 and it is restarting
    pid: int | None = None
    restarts: int = 0  # restarts the answering API process has seen
    running: int = 0
    waiting: dict[str, int] = {}
    pages_used: int = 0
    prefix_cache_pages: int = 0
    frames_per_second: float = 0.0
    admitting: bool = False
    admitted: int = 0  # requests it has admitted since it started


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    model: str
    sample_rate: int
    running: int
    waiting: dict[str, int]
    pages_used: int
    pages_free: int
    prefix_cache_pages: int  # pinned voice prefixes; the rest of pages_used belongs to requests
    frames_per_second: float
    active_streams: int  # in every API process of the server
    api_process: int  # the process id of the API process that answered (--api-workers N: one of N)
    engines: list[EngineHealth] | None = None  # per engine, with several (the fields above: all)


# ---- bulk jobs ------------------------------------------------------------------------------

JobStatus = Literal["queued", "running", "done", "failed", "cancelled"]


class JobItemBody(LenientModel):
    """One piece of a bulk job (a chapter, a line of dialogue): its audio is one file."""

    id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")  # None: its position
    text: str


class JobCreateBody(TTSRequestBody):
    """`POST /v1/jobs`: every `TTSRequest` field (voice, format, sampling), and either `text`
    (one item, id "0") or `items`."""

    items: list[JobItemBody] | None = None

    model_config = ConfigDict(
        json_schema_extra={"examples": [{"items": [{"id": "ch-1", "text": "It was late."}], "format": "wav"}]}
    )


class JobItemEntity(BaseModel):
    id: str
    status: Literal["pending", "running", "done", "failed"]
    audio_seconds: float = 0.0
    error: str | None = None


class JobEntity(BaseModel):
    id: str
    status: JobStatus
    items_total: int
    items_done: int
    audio_seconds: float
    format: AudioFormat
    error: str | None = None
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None = None
    items: list[JobItemEntity] | None = None  # only on GET /v1/jobs/{id}


class JobPage(BaseModel):
    total: int
    items: list[JobEntity]
    has_more: bool = False
