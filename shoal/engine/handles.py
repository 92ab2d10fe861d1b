"""Per-request handles on the asyncio side: `FrameStream` (frames of one engine request) and
`SynthesisHandle` (a whole SynthesisRequest: text batches in turn, audio through the vocoder).

Sinks run on the engine thread and hand results to the event loop with
`loop.call_soon_threadsafe`; audio callbacks run on the vocoder thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from shoal.engine.api import AudioChunk, FinishReason, InvalidRequest, RequestHandle, SynthesisRequest
from shoal.engine.request import Request, SamplingParams
from shoal.engine.vocoder import VocoderStream
from shoal.models.prompt import (
    Reference,
    Turn,
    build_prompt,
    split_text,
    v15_history_window,
    v15_user_turn_length,
    voice_prefix_length,
)
from shoal.models.reference import batch_seed

if TYPE_CHECKING:
    from shoal.engine.engine import LocalEngine

# Fish Speech 1.5's `max_length` for long text (`reference.generate_long`'s default): the
# sliding history keeps what fits in max_length - 1024 - voice prefix columns.
V15_MAX_LENGTH = 2048


class FrameStream:
    """Frames of one request as an async iterator (the internal, codec-free API)."""

    def __init__(self, engine: LocalEngine, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finish_reason: FinishReason | None = None
        self._engine = engine
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
                self._engine.abort(self.request_id)

    async def collect(self) -> torch.Tensor:
        """All frames as int32 [N+1, F], the layout `reference.generate` returns."""
        chunks = [f async for f in self]
        return torch.cat(chunks).t().contiguous() if chunks else torch.zeros(0, 0, dtype=torch.int32)


class SynthesisHandle(RequestHandle):
    """One SynthesisRequest: its text batches run one after another (long text), each as an
    engine Request whose prompt carries earlier batches' text and frames as
    `reference.generate_long` does (S2: all of them; 1.5: the sliding window of
    `prompt.v15_history_window`); audio comes out through the vocoder (or frames only, with an
    empty waveform, when the engine has no codec)."""

    def __init__(self, engine: LocalEngine, spec: SynthesisRequest, request_id: str, seed: int) -> None:
        self.request_id = request_id
        self.spec = spec
        self.seed = seed
        self.references = tuple(Reference(r.text, torch.as_tensor(r.codes).long()) for r in spec.references)
        self.texts = split_text(spec.text, spec.chunk_length, engine.core.model.config.family) or [spec.text]
        self.batch = 0
        self.history: list[Turn] = []
        self.current: Request | None = None
        self.aborted = False  # set by LocalEngine.abort (any thread): start no further batch
        self._segments: list[int] = []  # 1.5: columns of each history turn's user turn and frames
        self._engine = engine
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._finish: FinishReason | None = None
        self._stream: VocoderStream | None = None

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish

    def next_request(self) -> Request:
        """The engine Request of the current text batch."""
        engine = self._engine
        config, tokenizer = engine.core.model.config, engine.core.model.tokenizer
        text = self.texts[self.batch]
        prompt = build_prompt(config, tokenizer, text, self.references, self.context(text))
        sampling = self.spec.sampling
        params = SamplingParams(
            sampling.temperature, sampling.top_p, sampling.top_k, sampling.repetition_penalty,
            batch_seed(self.seed, self.batch),
        )  # fmt: skip
        self.current = engine.core.new_request(
            prompt,
            params,
            max_new_frames=self.spec.max_new_frames,
            priority=self.spec.priority,
            prefix_len=voice_prefix_length(config, tokenizer, self.references),
            request_id=f"{self.request_id}/{self.batch}",
            sink=self._on_frames,
        )
        if engine.vocoder is not None:
            self._stream = engine.vocoder.open(self._on_audio, self._on_vocoder_error)
        return self.current

    def context(self, text: str) -> list[Turn]:
        """The earlier batches that go into the prompt of the batch saying `text` (the rule of
        `reference.generate_long`: 1.5 slides, the other families keep all)."""
        config, tokenizer = self._engine.core.model.config, self._engine.core.model.tokenizer
        if config.family != "1.5" or not self.history:
            return list(self.history)
        n = config.num_codebooks
        for turn in self.history[len(self._segments) // 2 :]:
            self._segments += [v15_user_turn_length(tokenizer, turn.text, n), turn.frames.shape[1]]
        budget = self._engine.v15_max_length - 1024 - voice_prefix_length(config, tokenizer, self.references)
        kept = v15_history_window([*self._segments, v15_user_turn_length(tokenizer, text, n)], budget)
        # Kept segments come in (user turn, its frames) pairs plus the current turn last.
        return [self.history[k // 2] for k in kept[:-1:2]]

    # Engine thread
    def _on_frames(self, request: Request, frames: torch.Tensor | None, reason: FinishReason | None) -> None:
        vocoder = self._engine.vocoder
        if frames is not None:
            if vocoder is not None:
                # A frame delivered with STOP or LENGTH is the batch's last: not decoded.
                last = reason in (FinishReason.STOP, FinishReason.LENGTH)
                vocoder.push(self._stream, frames, last=last)
            else:
                self._on_audio(np.zeros(0, dtype=np.float32), frames.numpy().copy())
        if reason is None:
            return
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
        done = (lambda: None) if more else (lambda: self._finished(reason))
        if vocoder is not None:
            vocoder.end(previous_stream, done, drop=reason in (FinishReason.ABORTED, FinishReason.ERROR))
        else:
            done()
        if following is not None and more:
            self._engine.core.add(following, bypass_limit=True)

    # Vocoder thread (or engine thread without a codec)
    def _on_audio(self, samples: np.ndarray, frames: np.ndarray) -> None:
        chunk = AudioChunk(samples, self._engine.sample_rate, frames)
        if not self._to_loop(chunk):
            self._engine.abort(self.request_id)  # nobody can read it any more

    def _on_vocoder_error(self, error: BaseException) -> None:
        """The codec failed on this request's audio: stop generating it and end it as an error
        (the vocoder has dropped the stream, so its own end callback will never run)."""
        self._engine.abort(self.request_id)
        self._finished(FinishReason.ERROR)

    def _finished(self, reason: FinishReason) -> None:
        self._engine._handles.pop(self.request_id, None)
        self._to_loop(reason)

    def _to_loop(self, item) -> bool:
        """Hand `item` to the consumer's event loop; False when that loop is closed (this runs
        on the vocoder thread, which must keep serving the other streams)."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:
            return False
        return True

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        try:
            while self._finish is None:
                item = await self._queue.get()
                if isinstance(item, FinishReason):
                    self._finish = item
                else:
                    yield item
        finally:
            if self._finish is None:
                await self.aclose()

    async def aclose(self) -> None:
        if self._finish is None:
            self._engine.abort(self.request_id)


__all__ = ["FrameStream", "SynthesisHandle"]
