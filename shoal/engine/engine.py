"""The threaded, asyncio-facing engine: `LocalEngine` runs an `EngineCore` (core.py) on its
own thread, and only that thread touches the engine state.

Callers (the event loop, executor threads) never wait for a step. `submit` and `abort` put a
command into a thread-safe inbox (`queue.SimpleQueue`) that the engine thread drains at every
step boundary, and blocks on while idle, so a command wakes it at once. `stats` reads a
snapshot the engine thread publishes at every boundary. Queue limits are checked in `submit`
against per-class counts (the published waiting counts plus the submitted requests not yet
drained, reserved under a lock held for a few instructions, never across a step), so
`EngineOverloaded` is still raised synchronously.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import Future

import numpy as np
import torch

from shoal.config import EngineConfig
from shoal.engine.api import (
    Engine,
    EngineOverloaded,
    EngineStats,
    FinishReason,
    InvalidRequest,
    Priority,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)
from shoal.engine.core import EngineCore, new_request_id
from shoal.engine.handles import V15_MAX_LENGTH, FrameStream, SynthesisHandle
from shoal.engine.request import Request, SamplingParams
from shoal.engine.vocoder import Vocoder
from shoal.models.prompt import Reference, build_prompt, voice_prefix_length

_STOP = object()


class Admission:
    """Waiting requests per class as `submit` sees them: the scheduler's waiting lists as of
    the engine thread's last snapshot, plus requests submitted but not yet drained from the
    inbox. The lock guards a few integer updates only."""

    def __init__(self, limits: Callable[[], dict[str, int]]) -> None:
        self._limits = limits
        self._lock = threading.Lock()
        self.waiting = {p: 0 for p in Priority}  # as of the last snapshot
        self.undrained = {p: 0 for p in Priority}
        self.stats: EngineStats | None = None

    def reserve(self, priority: Priority) -> None:
        """Count one more waiting request of `priority`, or raise EngineOverloaded."""
        name = priority.name.lower()
        limit = self._limits().get(name)
        with self._lock:
            if limit is not None and self.waiting[priority] + self.undrained[priority] >= limit:
                raise EngineOverloaded(f"{name} queue is full ({limit} waiting)")
            self.undrained[priority] += 1

    def release(self, priority: Priority) -> None:
        """Undo a reservation whose request never reached the inbox."""
        with self._lock:
            self.undrained[priority] -= 1

    def publish(self, stats: EngineStats, waiting: dict[Priority, int], drained: dict[Priority, int]) -> None:
        """Engine thread: the state after a boundary; `drained` requests moved from the inbox
        into the scheduler since the last call (and are counted in `waiting` now)."""
        with self._lock:
            self.stats = stats
            self.waiting = waiting
            for priority, count in drained.items():
                self.undrained[priority] -= count

    def snapshot(self) -> EngineStats:
        with self._lock:
            stats, undrained = self.stats, dict(self.undrained)
        waiting = {p.name.lower(): stats.waiting.get(p.name.lower(), 0) + undrained[p] for p in Priority}
        return dataclasses.replace(stats, waiting=waiting)


class LocalEngine(Engine):
    """The Engine the server drives: an EngineCore on its own thread, plus the vocoder."""

    def __init__(self, model, config: EngineConfig, codec=None, model_name: str = "s2-pro") -> None:
        self.config = config
        self.codec = codec
        self.vocoder = None
        if codec is not None:
            streams = 2 * config.max_running_requests
            self.vocoder = Vocoder(
                codec, streams, config.vocoder_chunk_frames, config.vocoder_first_chunk_frames
            )
            # Before the KV pool is sized from free memory, so the codec's graphs are counted.
            if config.use_cuda_graphs and self.vocoder.capture_graphs():
                torch.cuda.empty_cache()
        self.core = EngineCore(model, config)
        self.sample_rate = codec.sample_rate if codec is not None else 44100
        self.frame_rate = self.sample_rate / (codec.frame_length if codec is not None else 2048)
        self.model_name = model_name
        self.v15_max_length = V15_MAX_LENGTH  # 1.5 long text: `reference.generate_long`'s max_length
        self._handles: dict[str, SynthesisHandle] = {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._admission = Admission(lambda: self.config.queue_limits)
        self._drained = {p: 0 for p in Priority}
        self._thread: threading.Thread | None = None
        self.last_error: BaseException | None = None
        self._publish()

    # Thread --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.start_thread()

    async def stop(self) -> None:
        self.stop_thread()

    def start_thread(self) -> None:
        if self.vocoder is not None:
            self.vocoder.start()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="shoal-engine", daemon=True)
            self._thread.start()

    def stop_thread(self) -> None:
        if self._thread is not None:
            self._inbox.put(_STOP)
            self._thread.join()
            self._thread = None
        if self.vocoder is not None:
            self.vocoder.stop()

    def _loop(self) -> None:
        while True:
            self._publish()
            if not self._drain(block=not self.core.has_work):
                return
            pending = self._guarded(self.core.begin_step)
            self._publish()  # admissions; the GPU computes meanwhile
            if pending is None:
                continue
            try:
                pending.wait()
            except Exception as error:
                self._fail(error)
                continue
            self._guarded(self.core.end_step, pending)

    def _drain(self, block: bool) -> bool:
        """Apply the inbox's commands in order (waiting for the first one if `block`).
        Returns False when asked to stop."""
        try:
            command = self._inbox.get() if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while command is not _STOP:
            fn, args = command
            self._guarded(fn, *args)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
        return False

    def _publish(self) -> None:
        waiting = {p: len(q) for p, q in self.core.scheduler.waiting.items()}
        self._admission.publish(self.core.stats(), waiting, self._drained)
        self._drained = {p: 0 for p in Priority}

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except Exception as error:  # fail what was running, keep serving the rest
            self._fail(error)
            return None

    def _fail(self, error: BaseException) -> None:
        self.last_error = error
        for request in list(self.core.scheduler.running):
            self.core.abort(request.request_id, FinishReason.ERROR)
        self.core.discard_inflight()  # a step launched ahead (overlap_steps) is not booked
        self.core.runner.host.invalidate()

    def _post(self, fn: Callable, *args) -> None:
        self._inbox.put((fn, args))

    def call(self, fn: Callable, *args) -> Future:
        """Run `fn(*args)` on the engine thread at the next step boundary; the returned
        future holds its result (run here at once when the thread is not running)."""
        future: Future = Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as error:
                    future.set_exception(error)

        if self._thread is None or threading.current_thread() is self._thread:
            run()
        else:
            self._post(run)
        return future

    # Engine thread: the commands -----------------------------------------------------------

    def _add(self, request: Request) -> None:
        self._drained[request.priority] += 1
        try:
            self.core.add(request, bypass_limit=True)  # the limit was checked in submit
        except Exception as error:
            self.last_error = error
            if request.sink is not None:
                request.sink(request, None, FinishReason.ERROR)

    def _abort(self, request_id: str, handle: SynthesisHandle | None) -> None:
        if handle is not None and handle.current is not None:
            request_id = handle.current.request_id  # the text batch running now
        self.core.abort(request_id)

    # Engine API (any thread; never waits for the engine thread) ------------------------------

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not request.text.strip():
            raise InvalidRequest("text is empty")
        request_id = request.request_id or new_request_id()
        if request_id in self._handles:
            raise InvalidRequest(f"duplicate request id {request_id}")
        seed = request.sampling.seed if request.sampling.seed is not None else secrets.randbits(63)
        self._admission.reserve(request.priority)
        try:
            handle = SynthesisHandle(self, request, request_id, seed)
            first = handle.next_request()
        except ValueError as error:  # bad reference codes and the like
            self._admission.release(request.priority)
            raise InvalidRequest(str(error)) from error
        except BaseException:
            self._admission.release(request.priority)
            raise
        self._handles[request_id] = handle
        self._post(self._add, first)
        return handle

    def abort(self, request_id: str) -> None:
        """Queue the abort; the engine thread frees the request's pages at its next step
        boundary (at once when idle)."""
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle.aborted = True  # no further text batch starts
        self._post(self._abort, request_id, handle)

    async def prefill_voice(self, references: tuple[VoiceReference, ...], voice_key: str) -> None:
        model = self.core.model
        refs = tuple(Reference(r.text, torch.as_tensor(r.codes).long()) for r in references)
        prefix = build_prompt(model.config, model.tokenizer, "", refs)
        prefix = prefix[:, : voice_prefix_length(model.config, model.tokenizer, refs)]
        await asyncio.wrap_future(self.call(self.core.prefill_voice, prefix))

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
        """The engine thread's last snapshot (at most one step old), submitted requests not
        yet drained counted as waiting."""
        return self._admission.snapshot()

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
        self._admission.reserve(priority)
        self._post(self._add, request)
        return stream


__all__ = ["Admission", "EngineCore", "FrameStream", "LocalEngine", "SynthesisHandle", "new_request_id"]
