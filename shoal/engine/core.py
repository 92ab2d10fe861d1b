"""The synchronous engine core: one step = schedule, launch the decode, run prefill chunks,
wait for the frames, deliver them.

`EngineCore.step()` runs a whole step; `begin_step()` / `end_step()` split it at the one point
where the host waits for the GPU, so a threaded caller (`engine.py`) can let other threads
touch the engine state while the GPU computes. Between `launch_decode` and the wait, the host
plans and launches the step's prefill chunks, overlapping the decode on the GPU.

With `overlap_steps`, `begin_step()` also launches the next decode of the same rows ("ahead")
before the step it returns is read back, when nothing can change the batch in between (pure
decode, nothing waiting, no row finished or aborted, no row at its last frame, pages free):
the GPU computes step n+1 from the tokens and window step n left on the device while the host
books step n. Bookkeeping therefore lags one step: a request that stops (`<|im_end|>`) or is
aborted at step n still has a row in step n+1, whose frame is dropped, and its pages are freed
when step n+1 is booked; then the batch is drained (the next `begin_step` returns the step
ahead without launching another) and scheduled normally. On the CPU the same lagged
bookkeeping runs, only synchronously.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from shoal.config import EngineConfig
from shoal.engine.api import (
    DEFAULT_FRAME_RATE,
    EngineOverloaded,
    EngineStats,
    FinishReason,
    InvalidRequest,
    Priority,
)
from shoal.engine.kv_cache import KVCacheManager, kv_bytes_per_page, kv_storage_dtype
from shoal.engine.playback import PlaybackClock
from shoal.engine.request import Request, RequestStatus, SamplingParams
from shoal.engine.runner import ModelRunner, PendingDecode
from shoal.engine.scheduler import Scheduler, StepPlan
from shoal.engine.stalls import StallWatch
from shoal.models.prompt import voice_prefix_key

_ids = itertools.count()


def new_request_id() -> str:
    return f"req-{next(_ids)}"


def size_page_pool(model, config: EngineConfig, max_seq_len: int) -> int:
    """Pages: the configured count, else a fraction of free GPU memory, else a CPU default."""
    if config.num_pages is not None:
        return config.num_pages
    c = model.config
    weight = model.embeddings.weight
    kv_dtype = kv_storage_dtype(config, weight.dtype)
    per_page = kv_bytes_per_page(c.n_layer, config.page_size, c.n_local_heads, c.head_dim, kv_dtype)
    if weight.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(weight.device)
        return max(1, int(free * config.memory_fraction) // per_page)
    return config.cpu_num_pages


@dataclass
class PendingStep:
    """A launched step: its plan, the decode in flight and the prefill's frames on the device."""

    plan: StepPlan
    decode: PendingDecode | None = None
    completing: list[Request] = field(default_factory=list)
    prefill_frames: torch.Tensor | None = None
    # On the host as numpy int32 [rows, N+1]: booked row by row without a torch op per frame.
    decode_frames: np.ndarray | list = field(default_factory=list)
    prefill_frames_host: np.ndarray | list = field(default_factory=list)
    ahead: bool = False  # launched before the previous step was booked (overlap_steps)
    # Requests that finished while this step (ahead) still runs a row for them: their pages
    # are freed when this step is booked.
    release: list[Request] = field(default_factory=list)
    _rows: set | None = field(default=None, repr=False)

    def runs(self, request: Request) -> bool:
        """Whether this step computes a row for `request`."""
        if self._rows is None:
            self._rows = set(self.plan.decodes)
        return request in self._rows

    def wait(self) -> None:
        """Block until the step's frames are on the host (the only sync of a step)."""
        if self.decode is not None:
            self.decode_frames = self.decode.result().numpy()
        if self.prefill_frames is not None:
            self.prefill_frames_host = self.prefill_frames.cpu().numpy()


class EngineCore:
    """Scheduler + runner + the per-step bookkeeping; single-threaded."""

    def __init__(self, model, config: EngineConfig, frame_rate: float = DEFAULT_FRAME_RATE) -> None:
        """`frame_rate`: frames per second of audio, which realtime admission compares the step
        rate with."""
        self.model = model
        self.config = config
        self.max_seq_len = min(config.max_seq_len or model.config.max_seq_len, model.config.max_seq_len)
        num_pages = size_page_pool(model, config, self.max_seq_len)
        self.kv = KVCacheManager(num_pages, config.page_size)
        self.scheduler = Scheduler(config, self.kv, self.max_seq_len, frame_rate)
        self.expired = 0  # requests that waited past the realtime policy's maximum (503)
        self.streams_underrun = 0  # ended streams whose listener heard a gap
        self.underrun_seconds = 0.0
        self.first_audio_seconds = 0.0  # ended streams' time from submission to first audio
        self.first_audio_streams = 0
        self._last_decode_booked: float | None = None
        self.step_stalls = StallWatch("an engine step")
        self.runner = ModelRunner(model, config, num_pages, self.max_seq_len)
        self.im_end_id = model.config.im_end_id
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self.frames_out = 0
        self._inflight: PendingStep | None = None  # a step launched ahead, not yet returned
        self.steps_ahead = 0  # decode steps launched ahead (overlap_steps)
        self.rows_discarded = 0  # rows of those steps whose request had finished
        self.last_sink_error: Exception | None = None  # the last exception a sink raised
        self._rate_window: deque[tuple[float, int, int]] = deque(maxlen=64)  # (time, steps, frames)

    def new_request(
        self,
        prompt: torch.Tensor,
        params: SamplingParams,
        *,
        max_new_frames: int,
        priority: Priority = Priority.STANDARD,
        prefix_len: int = 0,
        prefix_key: str | None = None,
        request_id: str | None = None,
        sink=None,
    ) -> Request:
        """Validate and build a Request (max_new_frames clipped to the context, as the reference)."""
        if prompt.shape[0] != self.runner.num_rows:
            raise InvalidRequest(f"prompt has {prompt.shape[0]} rows, expected {self.runner.num_rows}")
        room = self.max_seq_len - prompt.shape[1]
        if room <= 0:
            raise InvalidRequest(f"prompt of {prompt.shape[1]} tokens exceeds max_seq_len {self.max_seq_len}")
        self.check_values(prompt)
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
            prefix_key=prefix_key,
            sink=sink,
        )

    def check_values(self, prompt: torch.Tensor) -> None:
        """Token ids within the vocabulary and codes within the codebook, so that a bad value
        fails its own request here rather than the whole batch's step (an index error)."""
        c = self.model.config
        if prompt.numel() == 0:
            return
        tokens, codes = prompt[0], prompt[1:]
        if int(tokens.min()) < 0 or int(tokens.max()) >= c.vocab_size:
            raise InvalidRequest(f"prompt token ids must be in [0, {c.vocab_size})")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= c.codebook_size):
            raise InvalidRequest(f"prompt codes must be in [0, {c.codebook_size})")

    def add(self, request: Request, bypass_limit: bool = False) -> None:
        if request.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request.request_id}")
        self.scheduler.add(request, bypass_limit)
        self.requests[request.request_id] = request

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORTED) -> bool:
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        self._finish(request, reason)
        self._notify(request, None, reason)
        return True

    def _notify(self, request: Request, frames: torch.Tensor | None, reason: FinishReason | None) -> None:
        """Call the request's sink. A sink that raises (e.g. its event loop is closed) fails
        only its own request (ERROR, pages freed), never the step or the other requests."""
        if request.sink is None:
            return
        try:
            request.sink(request, frames, reason)
        except Exception as error:
            self.last_sink_error = error
            if not request.is_finished:
                self.requests.pop(request.request_id, None)
                self._finish(request, FinishReason.ERROR)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Finish `request`; a step launched ahead that still writes its KV keeps its pages
        until that step is booked."""
        ahead = self._inflight
        if ahead is not None and ahead.runs(request):
            self.scheduler.finish(request, reason, free_pages=False)
            ahead.release.append(request)
        else:
            self.scheduler.finish(request, reason)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running) or self.scheduler.num_waiting > 0 or self._inflight is not None

    @property
    def inflight(self) -> PendingStep | None:
        """The step launched ahead (overlap_steps) that the next `begin_step` returns."""
        return self._inflight

    def discard_inflight(self) -> None:
        """Drop the step launched ahead without booking it (after a failure); frees the pages
        its finished rows kept."""
        step, self._inflight = self._inflight, None
        if step is not None:
            for request in step.release:
                self.kv.free(request)

    def step(self) -> list[Request]:
        """Run one step; returns the requests that got a frame."""
        pending = self.begin_step()
        if pending is None:
            return []
        pending.wait()
        return self.end_step(pending)

    def begin_step(self) -> PendingStep | None:
        """Schedule, launch the decode, run the prefill chunks (the host part overlaps the
        decode on the GPU). Returns the step to wait for and book next, None when there is
        nothing to run. With `overlap_steps`: the step launched ahead by the previous call if
        there is one (else a newly scheduled one), and, when the batch cannot change, the next
        decode of the same rows is launched before returning."""
        if self._inflight is not None:
            pending, self._inflight = self._inflight, None
        else:
            self._expire_waiting()
            plan = self.scheduler.schedule()
            if plan.empty:
                return None
            pending = PendingStep(plan)
            self.runner.begin_step(prefills=bool(plan.prefills), decodes=bool(plan.decodes))
            if plan.decodes:
                pending.decode = self.runner.launch_decode(plan.decodes)
            if plan.prefills:
                pending.completing, pending.prefill_frames = self.runner.prefill(plan.prefills)
        if self.config.overlap_steps and self._can_run_ahead(pending):
            self._inflight = self._launch_ahead(pending)
        return pending

    def _expire_waiting(self) -> None:
        """End the requests that waited past the realtime policy's maximum with EngineOverloaded
        (the server's 503 with Retry-After): capacity did not free up for them in time."""
        limit = self.scheduler.gate.policy.max_queue_wait_seconds
        for request in self.scheduler.expire_waiting(time.monotonic()):
            self.requests.pop(request.request_id, None)
            request.error = EngineOverloaded(f"no capacity within {limit:g} s")
            self.scheduler.finish(request, FinishReason.ERROR)
            self.expired += 1
            self._notify(request, None, FinishReason.ERROR)

    def _can_run_ahead(self, pending: PendingStep) -> bool:
        """Whether the decode after `pending` (not booked yet) has the same rows: `pending`
        is a pure decode of every running request, none finished, none at its last frame, no
        request waiting, and the pages for one more position each can be had."""
        plan = pending.plan
        if plan.prefills or not plan.decodes or pending.decode is None or self.scheduler.num_waiting:
            return False
        if len(self.scheduler.running) != len(plan.decodes) or not self.runner.host.holds(plan.decodes):
            return False
        need = 0
        for request in plan.decodes:
            if request.status is not RequestStatus.RUNNING:
                return False
            # `pending` makes frame num_frames; the step ahead frame num_frames + 1, at
            # position seq_len (KV through seq_len + 1).
            if request.num_frames + 1 >= request.max_new_frames or request.seq_len + 1 > self.max_seq_len:
                return False
            need += self.kv.extra_pages_needed(request, request.seq_len + 1)
        return need == 0 or self.kv.can_allocate(need)

    def _launch_ahead(self, pending: PendingStep) -> PendingStep:
        decodes = list(pending.plan.decodes)
        for request in decodes:
            self.kv.grow(request, request.seq_len + 1)
        ahead = PendingStep(StepPlan(decodes=decodes), ahead=True)
        ahead.decode = self.runner.launch_decode(decodes, ahead=1)
        self.steps_ahead += 1
        return ahead

    def end_step(self, pending: PendingStep) -> list[Request]:
        """Book the step's progress and deliver its frames (after `pending.wait()`)."""
        plan = pending.plan
        produced: list[tuple[Request, torch.Tensor]] = []
        for request, frame in zip(plan.decodes, pending.decode_frames, strict=True):
            if request.is_finished:  # aborted while the step ran, or finished before it (ahead)
                self.rows_discarded += pending.ahead
                continue
            request.num_computed += 1
            produced.append((request, frame))
        completing = dict(zip(pending.completing, pending.prefill_frames_host, strict=True))
        for request, count in plan.prefills:
            if request.is_finished:
                continue
            request.num_computed += count
            self.kv.register_prefix(request)
            if request in completing:
                produced.append((request, completing[request]))
        for request, frame in produced:
            self._deliver(request, frame)
        for request in pending.release:
            self.kv.free(request)
        pending.release.clear()
        self.steps += 1
        self.frames_out += len(produced)
        now = time.monotonic()
        self._rate_window.append((now, self.steps, self.frames_out))
        # The decoding streams' pace, for realtime admission: time between booked decode steps.
        if plan.decodes:
            if self._last_decode_booked is not None:
                seconds, prefilled = now - self._last_decode_booked, sum(n for _, n in plan.prefills)
                self.scheduler.gate.observe_step(seconds, len(plan.decodes), prefilled)
                self.step_stalls.observe(
                    seconds, lambda: f"{len(plan.decodes)} rows, {prefilled} prefill tokens"
                )
            self._last_decode_booked = now
        else:
            self._last_decode_booked = None
        return [r for r, _ in produced]

    def _deliver(self, request: Request, frame: np.ndarray) -> None:
        """Book one frame (int32 [N+1]) and hand it to the request's sink as a [1, N+1] tensor
        sharing its memory (each step's frames are a fresh array, never written again)."""
        request.append_frame(frame)
        reason = None
        if int(frame[0]) == self.im_end_id and not self.config.ignore_eos:
            reason = FinishReason.STOP
        elif request.num_frames >= request.max_new_frames:
            reason = FinishReason.LENGTH
        if reason is not None:
            self.requests.pop(request.request_id, None)
            self._finish(request, reason)
        self._notify(request, torch.from_numpy(frame[None]), reason)

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
        scheduler = self.scheduler
        gate, waits = scheduler.gate_state(time.monotonic()), scheduler.queue_waits
        speed = scheduler.gate.speed
        return EngineStats(
            running=len(scheduler.running),
            waiting={p.name.lower(): len(q) for p, q in scheduler.waiting.items()},
            pages_used=self.kv.pool.num_used,
            pages_free=self.kv.pool.num_free,
            steps_per_second=steps_ps,
            frames_per_second=frames_ps,
            prefix_cache_pages=self.kv.prefix_cache_pages,
            admitting=gate.open,
            generation_speed=0.0 if speed == float("inf") else speed,
            min_headroom_seconds=gate.min_headroom,
            paused_batch=len(scheduler.last_paused),
            streams_underrun=self.streams_underrun,
            underrun_seconds=self.underrun_seconds,
            queue_timeouts=self.expired,
            queue_wait_sum=waits.total,
            queue_wait_count=waits.count,
            queue_wait_buckets=tuple(waits.counts),
            first_audio_sum=self.first_audio_seconds,
            first_audio_count=self.first_audio_streams,
            steps=self.steps,
            steps_ahead=self.steps_ahead,
        )

    def book_playback(self, clock: PlaybackClock, submitted_at: float | None = None) -> None:
        """A stream has ended: count its listener's gaps and, given when it was submitted, its
        time to first audio inside the engine (any thread; the totals only grow)."""
        if clock.underruns:
            self.streams_underrun += 1
            self.underrun_seconds += clock.stalled_seconds
        if submitted_at is not None and clock.first_delivered_at is not None:
            self.first_audio_seconds += clock.first_delivered_at - submitted_at
            self.first_audio_streams += 1

    def prefill_voice(self, prefix: torch.Tensor, key: str | None = None) -> bool:
        """Compute a voice prefix's whole pages now and keep them in the prefix cache under `key`
        (`voice_prefix_key(prefix)` when not given), where requests starting with this prefix
        find them. False when it is cached already, under one page, or the pool cannot spare the
        pages now (nothing is evicted for it then; the voice's first request caches it instead)."""
        shared = (prefix.shape[1] // self.config.page_size) * self.config.page_size
        if shared == 0:
            return False
        key = key if key is not None else voice_prefix_key(prefix)
        if self.kv.has_prefix(key):
            return False
        self.check_values(prefix)
        warm = Request("voice-prefill", prefix[:, :shared], SamplingParams(), max_new_frames=1)
        if not self.kv.can_allocate(self.kv.pages_for(shared)):
            return False  # pool busy: the voice's first request computes and caches it instead
        self.kv.grow(warm, shared)
        try:
            self.runner.begin_step(decodes=False)
            self.runner.prefill([(warm, shared)])  # the frame it samples is not wanted
            if self.runner.device.type == "cuda":
                torch.cuda.current_stream().synchronize()
        except BaseException:
            self.kv.free(warm)
            raise
        self.kv.prefill_prefix_entry(key, warm.block_table, shared)
        warm.block_table = []
        return True


__all__ = ["EngineCore", "PendingStep", "new_request_id", "size_page_pool"]
