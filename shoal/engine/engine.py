"""The engine: a synchronous step core, and the threaded asyncio-facing `LocalEngine`.

`EngineCore.step()` is one iteration: schedule, run decodes and prefill chunks, append the
frames, end requests that stopped, and hand the frames to each request's sink. `LocalEngine`
runs that loop on its own thread; the event loop only queues requests and aborts (under a
lock) and receives frames through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

import torch

from shoal.config import EngineConfig
from shoal.engine.api import EngineStats, FinishReason, InvalidRequest, Priority
from shoal.engine.kv_cache import KVCacheManager, kv_bytes_per_page
from shoal.engine.request import Request, RequestStatus, SamplingParams
from shoal.engine.runner import ModelRunner
from shoal.engine.scheduler import Scheduler

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
            raise InvalidRequest(f"request needs {pages_needed} KV pages, the pool has {self.kv.pool.num_pages}")
        return Request(
            request_id or new_request_id(),
            prompt,
            params,
            max_new_frames=min(max_new_frames, room),
            priority=priority,
            prefix_len=prefix_len,
            sink=sink,
        )

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request.request_id}")
        self.scheduler.add(request)
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


class LocalEngine:
    """Runs an EngineCore on a thread. (The text/audio `Engine` API lives in `vocoder.py`.)"""

    def __init__(self, model, config: EngineConfig) -> None:
        self.core = EngineCore(model, config)
        self.config = config
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.on_error: Callable[[BaseException], None] | None = None

    def start_thread(self) -> None:
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

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self.core.has_work:
                    self._wake.wait()
                if self._stopping:
                    return
                try:
                    self.core.step()
                except Exception as error:  # fail the running requests, keep serving
                    for request in list(self.core.scheduler.running):
                        self.core.abort(request.request_id, FinishReason.ERROR)
                    if self.on_error is not None:
                        self.on_error(error)

    def call(self, fn: Callable, *args, **kwargs):
        """Run `fn` with the engine state locked (between steps) and wake the loop."""
        with self._wake:
            result = fn(*args, **kwargs)
            self._wake.notify_all()
            return result

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

    def abort(self, request_id: str) -> None:
        self.call(self.core.abort, request_id)

    def stats(self) -> EngineStats:
        return self.call(self.core.stats)


__all__ = ["EngineCore", "FrameStream", "LocalEngine", "RequestStatus", "new_request_id"]
