"""Per-request handles on the asyncio side: `FrameStream` (frames of one engine request) and
`SynthesisHandle` (a whole SynthesisRequest: text batches in turn, audio through the vocoder).

Sinks run on the engine thread and hand results to the event loop with
`loop.call_soon_threadsafe`; audio callbacks run on the vocoder thread. A handle reaches the
engine only through the `EngineLink` the engine passes in.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import numpy as np
import torch

from shoal.engine.api import AudioChunk, FinishReason, InvalidRequest, QueuedHandle, SynthesisRequest
from shoal.engine.playback import PlaybackClock
from shoal.engine.request import Request, SamplingParams
from shoal.engine.vocoder import Vocoder, VocoderStream
from shoal.models.prompt import LongTextHistory, Turn, split_text
from shoal.models.reference import batch_seed


@dataclass(frozen=True)
class EngineLink:
    """What a handle may do with the engine that runs it (`LocalEngine` builds one): handles
    see neither the engine nor its internals, and this module never imports engine.py."""

    sample_rate: int
    vocoder: Vocoder | None
    # Validate and build an engine Request (`EngineCore.new_request`'s arguments).
    new_request: Callable[..., Request]
    # Engine thread: queue the next text batch of a request already admitted.
    add_next_batch: Callable[[Request], None]
    # Any thread: abort a request by its id.
    abort: Callable[[str], None]
    # A SynthesisHandle has ended: the engine forgets its id.
    handle_ended: Callable[[str], None]
    # A stream has ended: book its listener's playback (underruns, and its first audio against
    # the time it was submitted) in the engine's counters.
    book_playback: Callable[[PlaybackClock, float], None] = lambda clock, submitted_at: None


class FrameStream:
    """Frames of one request as an async iterator (the internal, codec-free API)."""

    def __init__(self, link: EngineLink, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finish_reason: FinishReason | None = None
        self._link = link
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()

    def sink(self, request: Request, frames: torch.Tensor | None, reason: FinishReason | None) -> None:
        """Engine thread -> event loop."""
        item = (frames.clone() if frames is not None else None, reason)
        # A closed loop raises here: the engine then fails only this request (EngineCore._notify).
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    async def __aiter__(self) -> AsyncIterator[torch.Tensor]:
        try:
            while self.finish_reason is None:
                frames, reason = await self._queue.get()
                if frames is not None:
                    yield frames
                if reason is not None:
                    self.finish_reason = reason
        finally:
            if self.finish_reason is None:
                self._link.abort(self.request_id)

    async def collect(self) -> torch.Tensor:
        """All frames as int32 [N+1, F], the layout `reference.generate` returns."""
        chunks = [f async for f in self]
        return torch.cat(chunks).t().contiguous() if chunks else torch.zeros(0, 0, dtype=torch.int32)


class SynthesisHandle(QueuedHandle):
    """One SynthesisRequest: its text batches run one after another (long text), each as an
    engine Request whose prompt carries earlier batches' text and frames as
    `reference.generate_long` does (`prompt.LongTextHistory`: S2 all of them, 1.5 a sliding
    window); audio comes out through the vocoder (or frames only, with an empty waveform, when
    the engine has no codec). Every batch starts with the same voice prefix, tokenized and keyed
    once (`history.voice`), so the batches and other requests in this voice share its pages."""

    def __init__(
        self, link: EngineLink, spec: SynthesisRequest, request_id: str, seed: int, history: LongTextHistory
    ) -> None:
        super().__init__()
        self.request_id = request_id
        self.spec = spec
        self.seed = seed
        self.history = history
        family = history.voice.config.family
        self.texts = split_text(spec.text, spec.chunk_length, family) or [spec.text]
        self.batch = 0
        self.current: Request | None = None
        self.aborted = False  # set by LocalEngine.abort (any thread): start no further batch
        self._link = link
        self._loop = asyncio.get_running_loop()
        self._stream: VocoderStream | None = None
        # The listener's playback across the text batches: booked by the vocoder at each
        # delivery, read by the scheduler (realtime admission, most urgent first).
        self.playback = PlaybackClock()
        self.submitted_at = time.monotonic()

    def next_request(self) -> Request:
        """The engine Request of the current text batch."""
        voice = self.history.voice
        sampling = self.spec.sampling
        params = SamplingParams(
            sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty,
            batch_seed(self.seed, self.batch),
        )  # fmt: skip
        self.current = self._link.new_request(
            self.history.prompt(self.texts[self.batch]),
            params,
            max_new_frames=self.spec.max_new_frames,
            priority=self.spec.priority,
            prefix_len=voice.prefix.shape[1],
            prefix_key=voice.key,
            request_id=f"{self.request_id}/{self.batch}",
            sink=self._on_frames,
        )
        self.current.playback = self.playback
        self.current.continuation = self.batch > 0
        vocoder = self._link.vocoder
        if vocoder is not None:
            segment = functools.partial(self._on_audio, self.batch)
            first = vocoder.first_chunk_for(self.spec.latency)
            self._stream = vocoder.open(segment, self._on_vocoder_error, self.playback, first)
        return self.current

    # Engine thread
    def _on_frames(self, request: Request, frames: torch.Tensor | None, reason: FinishReason | None) -> None:
        vocoder = self._link.vocoder
        if frames is not None:
            if vocoder is not None:
                # A frame delivered with STOP or LENGTH is the batch's last: not decoded.
                last = reason in (FinishReason.STOP, FinishReason.LENGTH)
                vocoder.push(self._stream, frames, last=last)
            else:
                self._on_audio(self.batch, np.zeros(0, dtype=np.float32), frames.numpy().copy())
        if reason is None:
            return
        if request.error is not None:  # e.g. no capacity in time: the consumer gets the error itself
            self._to_loop(request.error)
        more = reason in (FinishReason.STOP, FinishReason.LENGTH) and self.batch + 1 < len(self.texts)
        if more and self.aborted:
            more, reason = False, FinishReason.ABORTED
        previous_stream, following = self._stream, None
        if more:
            self.history.append(
                Turn(self.texts[self.batch], request.frames[: request.num_frames].t().clone())
            )
            self.batch += 1
            try:
                following = self.next_request()
            except (InvalidRequest, ValueError):  # the history outgrew the context: end as an error
                more, reason = False, FinishReason.ERROR
        done = (lambda: None) if more else (lambda: self.finished(reason))
        if vocoder is not None:
            vocoder.end(previous_stream, done, drop=reason in (FinishReason.ABORTED, FinishReason.ERROR))
        else:
            done()
        if following is not None and more:
            self._link.add_next_batch(following)

    # Vocoder thread (or engine thread without a codec)
    def _on_audio(self, segment: int, samples: np.ndarray, frames: np.ndarray) -> None:
        chunk = AudioChunk(
            samples, self._link.sample_rate, frames, segment, self.texts[segment], time.monotonic()
        )
        if not self._to_loop(chunk):
            self._link.abort(self.request_id)  # nobody can read it any more

    def _on_vocoder_error(self, error: BaseException) -> None:
        """The codec failed on this request's audio: stop generating it and end it as an error
        (the vocoder has dropped the stream, so its own end callback will never run)."""
        self._link.abort(self.request_id)
        self.finished(FinishReason.ERROR)

    def finished(self, reason: FinishReason) -> None:
        """End the handle with `reason` (the last item its consumer reads)."""
        self._link.handle_ended(self.request_id)
        self._link.book_playback(self.playback, self.submitted_at)
        self._to_loop(reason)

    def _to_loop(self, item) -> bool:
        """Hand `item` to the consumer's event loop; False when that loop is closed (this runs
        on the vocoder thread, which must keep serving the other streams)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            return False
        return True

    async def aclose(self) -> None:
        if self._finish is None:
            self._link.abort(self.request_id)


__all__ = ["EngineLink", "FrameStream", "SynthesisHandle"]
