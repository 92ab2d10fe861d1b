"""The engine: a synchronous step core, and the threaded asyncio-facing `LocalEngine`.

`EngineCore.step()` is one iteration: schedule, run decodes and prefill chunks, append the
frames, end requests that stopped, and hand the frames to each request's sink. `LocalEngine`
runs that loop on its own thread; the event loop only queues requests and aborts (under a
lock) and receives frames through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import numpy as np
import torch

from shoal.config import EngineConfig
from shoal.engine.api import (
    AudioChunk,
    Engine,
    EngineStats,
    FinishReason,
    InvalidRequest,
    Priority,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)
from shoal.engine.kv_cache import KVCacheManager, kv_bytes_per_page
from shoal.engine.request import Request, SamplingParams
from shoal.engine.runner import ModelRunner
from shoal.engine.scheduler import Scheduler
from shoal.engine.vocoder import Vocoder, VocoderStream
from shoal.models.prompt import Reference, Turn, build_prompt, split_text, voice_prefix_length
from shoal.models.reference import batch_seed

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


def size_page_pool(model, config: EngineConfig, max_seq_len: int) -> int:
    """Pages: the configured count, else a fraction of free GPU memory, else a CPU default."""
    if config.num_pages is not None:
        return config.num_pages
    c = model.config
    weight = model.embeddings.weight
    per_page = kv_bytes_per_page(c.n_layer, config.page_size, c.n_local_heads, c.head_dim, weight.dtype)
    if weight.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(weight.device)
        return max(1, int(free * config.memory_fraction) // per_page)
    return config.cpu_num_pages


class EngineCore:
    """Scheduler + runner + the per-step bookkeeping; single-threaded."""

    def __init__(self, model, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.max_seq_len = min(config.max_seq_len or model.config.max_seq_len, model.config.max_seq_len)
        num_pages = size_page_pool(model, config, self.max_seq_len)
        self.kv = KVCacheManager(num_pages, config.page_size)
        self.scheduler = Scheduler(config, self.kv, self.max_seq_len)
        self.runner = ModelRunner(model, config, num_pages, self.max_seq_len)
        self.im_end_id = model.config.im_end_id
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self.frames_out = 0
        self._rate_window: deque[tuple[float, int, int]] = deque(maxlen=64)  # (time, steps, frames)

    def new_request(
        self,
        prompt: torch.Tensor,
        params: SamplingParams,
        *,
        max_new_frames: int,
        priority: Priority = Priority.STANDARD,
        prefix_len: int = 0,
        request_id: str | None = None,
        sink=None,
    ) -> Request:
        """Validate and build a Request (max_new_frames clipped to the context, as the reference)."""
        if prompt.shape[0] != self.runner.num_rows:
            raise InvalidRequest(f"prompt has {prompt.shape[0]} rows, expected {self.runner.num_rows}")
        room = self.max_seq_len - prompt.shape[1]
        if room <= 0:
            raise InvalidRequest(f"prompt of {prompt.shape[1]} tokens exceeds max_seq_len {self.max_seq_len}")
        pages_needed = self.kv.pages_for(prompt.shape[1] + min(max_new_frames, room))
        if pages_needed > self.kv.pool.num_pages:
            raise InvalidRequest(
                f"request needs {pages_needed} KV pages, the pool has {self.kv.pool.num_pages}"
            )
        return Request(
            request_id or new_request_id(),
            prompt,
            params,
            max_new_frames=min(max_new_frames, room),
            priority=priority,
            prefix_len=prefix_len,
            sink=sink,
        )

    def add(self, request: Request, bypass_limit: bool = False) -> None:
        if request.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request.request_id}")
        self.scheduler.add(request, bypass_limit)
        self.requests[request.request_id] = request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.finish(request, reason)
        if request.sink is not None:
            request.sink(request, None, reason)
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running) or self.scheduler.num_waiting > 0

    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a frame."""
        plan = self.scheduler.schedule()
        if plan.empty:
            return []
        produced: list[tuple[Request, torch.Tensor]] = []
        if plan.decodes:
            frames = self.runner.decode(plan.decodes)
            for request, frame in zip(plan.decodes, frames, strict=True):
                request.num_computed += 1
                produced.append((request, frame))
        if plan.prefills:
            completed = self.runner.prefill(plan.prefills)
            for request, count in plan.prefills:
                request.num_computed += count
                self.kv.register_prefix(request)
                if request in completed:
                    produced.append((request, completed[request]))
        for request, frame in produced:
            self._deliver(request, frame)
        self.steps += 1
        self.frames_out += len(produced)
        self._rate_window.append((time.monotonic(), self.steps, self.frames_out))
        return [r for r, _ in produced]

    def _deliver(self, request: Request, frame: torch.Tensor) -> None:
        request.append_frame(frame)
        reason = None
        if int(frame[0]) == self.im_end_id and not self.config.ignore_eos:
            reason = FinishReason.STOP
        elif request.num_frames >= request.max_new_frames:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.requests.pop(request.request_id, None)
            self.scheduler.finish(request, reason)
        if request.sink is not None:
            request.sink(request, frame[None], reason)

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.has_work:
                return
            self.step()

    def stats(self) -> EngineStats:
        window = self._rate_window
        steps_ps = frames_ps = 0.0
        if len(window) >= 2 and window[-1][0] > window[0][0]:
            dt = window[-1][0] - window[0][0]
            steps_ps = (window[-1][1] - window[0][1]) / dt
            frames_ps = (window[-1][2] - window[0][2]) / dt
        return EngineStats(
            running=len(self.scheduler.running),
            waiting={p.name.lower(): len(q) for p, q in self.scheduler.waiting.items()},
            pages_used=self.kv.pool.num_used,
            pages_free=self.kv.pool.num_free,
            steps_per_second=steps_ps,
            frames_per_second=frames_ps,
            prefix_cache_pages=self.kv.prefix_cache_pages,
        )

    def prefill_voice(self, prefix: torch.Tensor) -> bool:
        """Compute a voice prefix's whole pages now and keep them in the prefix cache."""
        key = self.kv.prefix_key(prefix, prefix.shape[1])
        if key is None or self.kv.has_prefix(key):
            return False
        shared = (prefix.shape[1] // self.config.page_size) * self.config.page_size
        warm = Request("voice-prefill", prefix[:, :shared], SamplingParams(), max_new_frames=1)
        self.kv.grow(warm, shared)
        self.runner.prefill([(warm, shared)])  # the frame it samples is not wanted
        self.kv.prefill_prefix_entry(key, warm.block_table, shared)
        warm.block_table = []
        return True


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
    """One SynthesisRequest: its text batches run one after another (S2 long text), each as an
    engine Request whose prompt carries the earlier batches' frames; audio comes out through
    the vocoder (or frames only, with an empty waveform, when the engine has no codec)."""

    def __init__(self, engine: LocalEngine, spec: SynthesisRequest, request_id: str, seed: int) -> None:
        self.request_id = request_id
        self.spec = spec
        self.seed = seed
        self.references = tuple(Reference(r.text, torch.as_tensor(r.codes).long()) for r in spec.references)
        self.texts = split_text(spec.text, spec.chunk_length, engine.core.model.config.family) or [spec.text]
        self.batch = 0
        self.history: list[Turn] = []
        self.current: Request | None = None
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
        prompt = build_prompt(config, tokenizer, text, self.references, self.history)
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
            self._stream = engine.vocoder.open(self._on_audio)
        return self.current

    # Engine thread
    def _on_frames(self, request: Request, frames: torch.Tensor | None, reason: FinishReason | None) -> None:
        vocoder = self._engine.vocoder
        if frames is not None:
            if vocoder is not None:
                vocoder.push(self._stream, frames)
            else:
                self._on_audio(np.zeros(0, dtype=np.float32), frames.numpy())
        if reason is None:
            return
        more = reason in (FinishReason.STOP, FinishReason.LENGTH) and self.batch + 1 < len(self.texts)
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
        self._loop.call_soon_threadsafe(self._queue.put_nowait, chunk)

    def _finished(self, reason: FinishReason) -> None:
        self._engine._handles.pop(self.request_id, None)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, reason)

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


class LocalEngine(Engine):
    """The Engine the server drives: an EngineCore on its own thread, plus the vocoder."""

    def __init__(self, model, config: EngineConfig, codec=None, model_name: str = "s2-pro") -> None:
        self.core = EngineCore(model, config)
        self.config = config
        self.codec = codec
        self.vocoder = None
        if codec is not None:
            streams = 2 * config.max_running_requests
            self.vocoder = Vocoder(
                codec, streams, config.vocoder_chunk_frames, config.vocoder_first_chunk_frames
            )
        self.sample_rate = codec.sample_rate if codec is not None else 44100
        self.frame_rate = self.sample_rate / (codec.frame_length if codec is not None else 2048)
        self.model_name = model_name
        self._handles: dict[str, SynthesisHandle] = {}
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.last_error: BaseException | None = None

    # Thread --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.start_thread()

    async def stop(self) -> None:
        self.stop_thread()

    def start_thread(self) -> None:
        if self.vocoder is not None:
            self.vocoder.start()
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
            self._thread.start()

    def stop_thread(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.vocoder is not None:
            self.vocoder.stop()

    def _loop(self) -> None:
        while True:
            with self._wake:  # held for the step: submit/abort land between steps
                while not self._stopping and not self.core.has_work:
                    self._wake.wait()
                if self._stopping:
                    return
                try:
                    self.core.step()
                except Exception as error:  # fail what was running, keep serving the rest
                    self.last_error = error
                    for request in list(self.core.scheduler.running):
                        self.core.abort(request.request_id, FinishReason.ERROR)

    def call(self, fn: Callable, *args, **kwargs):
        """Run `fn` on the engine state between steps, then wake the loop."""
        with self._wake:
            result = fn(*args, **kwargs)
            self._wake.notify_all()
            return result

    # Engine API ----------------------------------------------------------------------------

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not request.text.strip():
            raise InvalidRequest("text is empty")
        request_id = request.request_id or new_request_id()
        if request_id in self._handles:
            raise InvalidRequest(f"duplicate request id {request_id}")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        handle = SynthesisHandle(self, request, request_id, seed)
        try:
            first = handle.next_request()
        except ValueError as error:  # bad reference codes and the like
            raise InvalidRequest(str(error)) from error
        try:
            self.call(self.core.add, first)
        except Exception:
            if self.vocoder is not None:
                self.vocoder.end(handle._stream, lambda: None, drop=True)
            raise
        self._handles[request_id] = handle
        return handle

    def abort(self, request_id: str) -> None:
        handle = self._handles.pop(request_id, None)
        if handle is not None and handle.current is not None:
            self.call(self.core.abort, handle.current.request_id)
        else:
            self.call(self.core.abort, request_id)

    async def prefill_voice(self, references: tuple[VoiceReference, ...], voice_key: str) -> None:
        model = self.core.model
        refs = tuple(Reference(r.text, torch.as_tensor(r.codes).long()) for r in references)
        prefix = build_prompt(model.config, model.tokenizer, "", refs)
        prefix = prefix[:, : voice_prefix_length(model.config, model.tokenizer, refs)]
        await asyncio.get_running_loop().run_in_executor(None, self.call, self.core.prefill_voice, prefix)

    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        if self.codec is None:
            raise InvalidRequest("this engine has no codec")

        def encode() -> np.ndarray:
            wave = torch.as_tensor(np.asarray(audio, dtype=np.float32)).flatten()
            if sample_rate != self.codec.sample_rate:
                size = max(1, round(wave.numel() * self.codec.sample_rate / sample_rate))
                wave = torch.nn.functional.interpolate(wave[None, None], size=size, mode="linear")[0, 0]
            return self.codec.encode(wave)[0].cpu().numpy()

        return await asyncio.get_running_loop().run_in_executor(None, encode)

    def stats(self) -> EngineStats:
        return self.call(self.core.stats)

    # Frame-level API (tests, benchmarks) ---------------------------------------------------

    def submit_frames(
        self,
        prompt: torch.Tensor,
        params: SamplingParams,
        *,
        max_new_frames: int,
        priority: Priority = Priority.STANDARD,
        prefix_len: int = 0,
        request_id: str | None = None,
    ) -> FrameStream:
        """Queue one prompt; iterate the returned stream for its frames (raises EngineOverloaded)."""
        stream = FrameStream(self, request_id or new_request_id(), asyncio.get_running_loop())
        request = self.core.new_request(
            prompt,
            params,
            max_new_frames=max_new_frames,
            priority=priority,
            prefix_len=prefix_len,
            request_id=stream.request_id,
            sink=stream.sink,
        )
        self.call(self.core.add, request)
        return stream


__all__ = ["EngineCore", "FrameStream", "LocalEngine", "SynthesisHandle", "new_request_id"]
