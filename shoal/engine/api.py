"""The engine's public surface: the only module the server imports from `shoal.engine`.

The server speaks in text, voices and audio; the engine owns tokenization, prompts, the
batched model, sampling and the codec. Everything here is plain data plus one abstract
class, so the server can be read (and type-checked) without torch installed.
"""

from __future__ import annotations

import abc
import asyncio
import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np

# Every supported family's codec makes one frame per 2048 samples at 44.1 kHz (about 21.5 Hz).
DEFAULT_FRAME_RATE = 44100 / 2048


class Priority(enum.IntEnum):
    """Scheduling class; a lower value is served first and may preempt a higher one."""

    REALTIME = 0
    STANDARD = 1
    BATCH = 2


class FinishReason(enum.StrEnum):
    STOP = "stop"  # the model emitted <|im_end|>
    LENGTH = "length"  # max_new_frames reached
    ABORTED = "aborted"  # abort() or the consumer went away
    ERROR = "error"


class EngineError(Exception):
    """Base class of errors the server maps to HTTP statuses."""


class EngineOverloaded(EngineError):
    """The waiting queue is full; the server answers 503."""


class EngineUnavailable(EngineError):
    """The engine process does not answer (dead, restarting, or stalled), or restarted and lost
    the request: the server answers 503, the client may retry."""


class InvalidRequest(EngineError):
    """The request cannot be served as asked (prompt too long, bad reference codes): 400."""


@dataclass(frozen=True)
class VoiceReference:
    """One reference clip already encoded by the codec: its transcript and codes int [N, T]."""

    text: str
    codes: np.ndarray


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    repetition_penalty: float = 1.1  # S1 / 1.5 only; S2 ignores it as the reference does
    seed: int | None = None  # None: the engine draws one


LATENCY_MODES = ("low", "balanced", "normal")


@dataclass(frozen=True)
class SynthesisRequest:
    text: str
    # Requests whose references are equal share the voice prefix's KV pages (the engine keys
    # them by the prefix it builds from these).
    references: tuple[VoiceReference, ...] = ()
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    priority: Priority = Priority.STANDARD
    max_new_frames: int = 1024  # per text chunk, as the reference's max_new_tokens
    chunk_length: int = 200  # S2: bytes per text batch (speaker turns are kept whole)
    request_id: str | None = None  # None: the engine assigns one
    # How soon the first audio comes and how the chunks after it grow (`LATENCY_MODES`): "low"
    # decodes the smallest first chunk, "balanced" (the official SDK's default) a short one,
    # "normal" a full chunk (one codec call fewer per stream; a few steps later).
    latency: str = "normal"


@dataclass(frozen=True)
class AudioChunk:
    """New audio for one request: mono float32 PCM in [-1, 1] at `sample_rate`."""

    samples: np.ndarray
    sample_rate: int
    frames: np.ndarray | None = None  # int32 [n, N+1]: the frames this audio came from
    # The text batch this audio speaks (the engine splits long text; `SynthesisHandle.texts`):
    # its index and its text, so a consumer can time each segment.
    segment: int = 0
    segment_text: str = ""
    # time.monotonic() when the engine handed this audio over (the clock every process of one
    # host shares): a consumer's delay after it is the API's part of the chunk's latency.
    ready_at: float | None = None


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: dict[str, int]  # per priority name
    pages_used: int
    pages_free: int
    steps_per_second: float
    frames_per_second: float
    prefix_cache_pages: int = 0
    # Realtime admission (`engine/admission.py`): whether new streams are taken now, the decoding
    # streams' generation speed (times real time; 0 before any step), the least audio buffered
    # by a playing stream's listener, and batch decodes paused for them.
    admitting: bool = True
    generation_speed: float = 0.0
    min_headroom_seconds: float | None = None
    paused_batch: int = 0
    # Since start: streams whose listener heard a gap (and the gaps' total length), requests
    # ended with a 503 after waiting `RealtimePolicy.max_queue_wait_seconds`, and the time
    # admitted requests waited (sum, count, and cumulative counts per `QUEUE_WAIT_BUCKETS`).
    streams_underrun: int = 0
    underrun_seconds: float = 0.0
    queue_timeouts: int = 0
    queue_wait_sum: float = 0.0
    queue_wait_count: int = 0
    queue_wait_buckets: tuple[int, ...] = ()
    # Since start: ended streams' time from submission to their first audio, inside the engine
    # (the server's `shoal_time_to_first_audio_seconds` adds the API's own part).
    first_audio_sum: float = 0.0
    first_audio_count: int = 0
    # Since start: the garbage collector's pauses in the engine's process (`gc_pauses`), which
    # stop the GPU loop and the vocoder with it: their total and the longest.
    gc_pause_seconds: float = 0.0
    gc_longest_pause_seconds: float = 0.0
    # Since start: steps booked, and decode steps launched before the step before them was
    # booked (`overlap_steps`: the GPU computes while the host books; arrivals, prefills and
    # requests ending drain that pipeline, and the GPU then waits for the host).
    steps: int = 0
    steps_ahead: int = 0


# Upper bounds (seconds) of the queue-wait histogram in `EngineStats.queue_wait_buckets`.
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RequestHandle(abc.ABC):
    """A submitted request. Iterate it for audio; the iteration ends when the request does."""

    request_id: str

    @abc.abstractmethod
    def __aiter__(self) -> AsyncIterator[AudioChunk]: ...

    @property
    @abc.abstractmethod
    def finish_reason(self) -> FinishReason | None:
        """None while running; set when the stream has ended."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """The consumer is gone: abort the request (if running) and free its pages."""


class QueuedHandle(RequestHandle):
    """A handle fed through an asyncio queue, on its consumer's loop: audio chunks, then the
    FinishReason, or the exception that ended the request (raised to the consumer). Subclasses
    say how to abort (`aclose`)."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[AudioChunk | FinishReason | BaseException] = asyncio.Queue()
        self._finish: FinishReason | None = None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        try:
            while self._finish is None:
                item = await self._queue.get()
                if isinstance(item, FinishReason):
                    self._finish = item
                elif isinstance(item, BaseException):
                    self._finish = FinishReason.ERROR
                    raise item
                else:
                    yield item
        finally:
            if self._finish is None:
                await self.aclose()


class Engine(abc.ABC):
    """What the server drives. Implemented by `shoal.engine.engine.LocalEngine`."""

    sample_rate: int
    frame_rate: float
    model_name: str

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    def submit(self, request: SynthesisRequest) -> RequestHandle:
        """Queue a request; it joins the running batch at the next step. Raises
        EngineOverloaded when the bounded queue is full, InvalidRequest for bad input."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abc.abstractmethod
    async def prefill_voice(self, references: tuple[VoiceReference, ...]) -> None:
        """Compute and pin the voice prefix's KV pages ahead of the first request (realtime)."""

    @abc.abstractmethod
    def check_voice(self, references: tuple[VoiceReference, ...]) -> None:
        """Raise InvalidRequest if a voice made of these references could never be used: its
        prompt prefix leaves no room in the model's context to speak (checked at upload)."""

    @abc.abstractmethod
    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        """Codec-encode mono float audio at any rate -> codes int [N, T]."""

    @abc.abstractmethod
    def stats(self) -> EngineStats: ...
