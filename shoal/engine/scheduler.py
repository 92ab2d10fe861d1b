"""Continuous batching: which requests run in the next step, and with how many tokens.

Every step: running requests in steady decode get one token each (most urgent first, growing
their block tables page by page); then prefill chunks fill the per-step prefill budget:
requests already mid-prefill first, then newly admitted ones in order of effective priority
(realtime > standard > batch, aged by waiting time). When slots or pages run short, the least
urgent running request (latest arrival within its class) is preempted: its pages are freed and
it waits again with the frames it has, to be re-prefilled later (prompt + frames), which
reproduces its uninterrupted output because sampling randomness is counter-based.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from shoal.config import EngineConfig
from shoal.engine.admission import GateState, RealtimeGate, WaitHistogram
from shoal.engine.api import DEFAULT_FRAME_RATE, QUEUE_WAIT_BUCKETS, EngineOverloaded, FinishReason, Priority
from shoal.engine.kv_cache import KVCacheManager
from shoal.engine.request import Request, RequestStatus


@dataclass
class StepPlan:
    """One step's work. `prefills` are (request, new tokens); a chunk that reaches the end of
    its request's sequence yields that request's next frame."""

    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    paused: list[Request] = field(default_factory=list)  # batch decodes held back by the closed gate

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        max_seq_len: int,
        frame_rate: float = DEFAULT_FRAME_RATE,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_seq_len = max_seq_len
        self.waiting: dict[Priority, list[Request]] = {p: [] for p in Priority}
        self.running: list[Request] = []
        self.gate = RealtimeGate(config.resolved_realtime(), frame_rate)
        self.last_gate: GateState | None = None  # the decision of the latest schedule()
        self.queue_waits = WaitHistogram(QUEUE_WAIT_BUCKETS)  # first admissions only
        self.last_paused: list[Request] = []

    # Queue --------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return sum(len(q) for q in self.waiting.values())

    def add(self, request: Request, bypass_limit: bool = False) -> None:
        """Queue a new request; raises EngineOverloaded when its class's queue is full
        (`bypass_limit`: the next text batch of a request already accepted)."""
        queue = self.waiting[request.priority]
        limit = self.config.queue_limits.get(request.priority.name.lower())
        if not bypass_limit and limit is not None and len(queue) >= limit:
            raise EngineOverloaded(f"{request.priority.name.lower()} queue is full ({limit} waiting)")
        if request.seq_len + request.max_new_frames - request.num_frames > self.max_seq_len + 1:
            raise ValueError("request does not fit in max_seq_len")
        request.status = RequestStatus.WAITING
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        queue = self.waiting[request.priority]
        keys = [r.arrival for r in queue]
        queue.insert(bisect.bisect(keys, request.arrival), request)

    def remove(self, request: Request, free_pages: bool = True) -> None:
        """Take a request out of the engine (finished, aborted, failed) and free its pages
        (`free_pages=False`: the caller frees them later, after a step in flight that still
        writes them)."""
        if request in self.running:
            self.running.remove(request)
        queue = self.waiting[request.priority]
        if request in queue:
            queue.remove(request)
        if free_pages:
            self.kv.free(request)
        request.status = RequestStatus.FINISHED

    def finish(self, request: Request, reason: FinishReason, free_pages: bool = True) -> None:
        request.finish_reason = reason
        self.remove(request, free_pages)

    # Scheduling ---------------------------------------------------------------------------

    def _urgency(self, request: Request, now: float) -> tuple[int, float, int]:
        """Sort key, smaller = more urgent: effective class, then the listener's buffered audio
        (least first: a stream far ahead of playback can best afford to wait), then arrival."""
        headroom = request.playback.headroom(now) if request.playback is not None else None
        return (
            request.effective_priority(now, self.config.aging_seconds),
            -1.0 if headroom is None else headroom,
            request.arrival,
        )

    def gate_state(self, now: float) -> GateState:
        """Realtime admission over the running streams someone listens to (not batch work, which
        only fills what they leave): open when there are none."""
        listened = self._listened()
        if not listened:
            return GateState(True, self.gate.speed, None)
        return self.gate.state(now, [r.playback for r in listened if r.playback is not None])

    def expire_waiting(self, now: float) -> list[Request]:
        """Requests that waited longer than the realtime policy's maximum for capacity, taken
        out of the queue (the caller ends them with a 503). Only those that may expire: never
        batch work, nor a later text batch of a synthesis already playing."""
        policy = self.gate.policy
        if not policy.enabled:
            return []
        expired = []
        for priority in (Priority.REALTIME, Priority.STANDARD):
            queue = self.waiting[priority]
            for request in list(queue):  # in arrival order: stop at the first still in time
                if not request.may_expire or request.num_frames or request.continuation:
                    continue
                if now - request.arrival_time <= policy.max_queue_wait_seconds:
                    break
                queue.remove(request)
                expired.append(request)
        return expired

    def _victim(self, now: float, than: Request | None, plan: StepPlan) -> Request | None:
        """The least urgent running request, if it is less urgent than `than` (None: any)."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda r: self._urgency(r, now))
        if than is not None and self._urgency(victim, now)[0] <= self._urgency(than, now)[0]:
            return None
        return victim

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        plan.preempted.append(victim)
        if victim in plan.decodes:
            plan.decodes.remove(victim)
        plan.prefills = [(r, n) for r, n in plan.prefills if r is not victim]
        self._enqueue(victim)

    def _reserve(self, request: Request, upto: int, now: float, plan: StepPlan, any_victim: bool) -> bool:
        """Grow `request`'s pages to cover `upto` tokens, preempting less urgent running work
        (or, for a running request with `any_victim`, the least urgent one even if it is
        itself). Returns False when the pages cannot be had."""
        need = self.kv.extra_pages_needed(request, upto)
        while not self.kv.can_allocate(need):
            victim = self._victim(now, None if any_victim else request, plan)
            if victim is None:
                return False
            self._preempt(victim, plan)
            if victim is request:
                return False
        self.kv.grow(request, upto)
        return True

    def schedule(self) -> StepPlan:
        now = time.monotonic()
        plan = StepPlan()
        if not self._listened():
            self.gate.idle()  # a new batch of listened streams starts from a fresh measurement
        gate = self.last_gate = self.gate_state(now)
        self.last_paused = plan.paused
        # 1. Decodes of running requests, most urgent first; batch work pauses while the gate is
        #    closed (it keeps its pages), so that the steps serve the streams being listened to.
        for request in sorted(self.running, key=lambda r: self._urgency(r, now)):
            if request not in self.running or not request.is_decoding:
                continue
            if not gate.open and request.priority is Priority.BATCH:
                plan.paused.append(request)
                continue
            if self._reserve(request, request.seq_len, now, plan, any_victim=True):
                plan.decodes.append(request)
        # 2. Prefill chunks: running requests mid-prefill, then admissions; while someone listens,
        #    no more than keeps the step within the realtime speed.
        budget = self.config.max_prefill_tokens
        if self._listened_playing():
            budget = self.gate.prefill_token_budget(budget)
        prefilling = [r for r in self.running if not r.is_decoding]
        for request in sorted(prefilling, key=lambda r: self._urgency(r, now)):
            if budget <= 0:
                break
            if request not in self.running or request.is_decoding:
                continue
            budget -= self._plan_chunk(request, budget, now, plan)
        # New streams only while the gate is open and the batch with them would keep up; each
        # one is charged before its steps show in the measured speed.
        fresh = gate.open
        rows = len(self.running) - len(plan.paused)
        while budget > 0:
            candidate = self._next_waiting(now, fresh=fresh)
            if candidate is None:
                break
            starts = not (candidate.num_frames or candidate.continuation)
            if starts and not self.gate.admits(rows + 1):
                fresh = False  # already admitted streams may still resume
                continue
            if not self._admit(candidate, now, plan):
                break
            rows += starts
            budget -= self._plan_chunk(candidate, budget, now, plan)
        return plan

    def _listened_playing(self) -> bool:
        """Whether a running stream someone listens to has started playing."""
        return any(r.playback is not None and r.playback.first_audio_at is not None for r in self._listened())

    def _listened(self) -> list[Request]:
        """The running streams someone listens to (all but batch work)."""
        return [r for r in self.running if r.priority is not Priority.BATCH]

    def _plan_chunk(self, request: Request, budget: int, now: float, plan: StepPlan) -> int:
        count = min(request.num_pending, budget)
        if count <= 0 or not self._reserve(request, request.num_computed + count, now, plan, False):
            return 0
        plan.prefills.append((request, count))
        return count

    def _next_waiting(self, now: float, fresh: bool = True) -> Request | None:
        """The most urgent waiting request; with `fresh` False (the realtime gate is closed) only
        those of streams already admitted: preempted ones and later text batches."""
        heads = [head for q in self.waiting.values() if (head := self._queue_head(q, now, fresh))]
        return min(heads, key=lambda r: self._urgency(r, now)) if heads else None

    def _queue_head(self, queue: list[Request], now: float, fresh: bool) -> Request | None:
        """A class's next request: a stream already admitted (preempted, a later text batch)
        first; then, with `fresh`, the oldest new one, or the newest once the oldest that may
        expire has waited `newest_first_after_seconds` (the queue is not draining: serve the
        requests still in time, let the stale ones expire)."""
        resumed = next((r for r in queue if r.num_frames or r.continuation), None)
        if resumed is not None or not fresh or not queue:
            return resumed
        oldest = queue[0]
        policy = self.gate.policy
        stale = now - oldest.arrival_time > policy.newest_first_after_seconds
        if policy.enabled and oldest.may_expire and stale:
            return queue[-1]
        return oldest

    def _admit(self, request: Request, now: float, plan: StepPlan) -> bool:
        """Move the most urgent waiting request into the running set if a slot and the pages
        for a first chunk can be had (preempting less urgent work if needed)."""
        while len(self.running) >= self.config.max_running_requests:
            victim = self._victim(now, request, plan)
            if victim is None:
                return False
            self._preempt(victim, plan)
        self.waiting[request.priority].remove(request)
        self.kv.attach_prefix(request)
        first_chunk = request.num_computed + min(request.num_pending, self.config.max_prefill_tokens)
        if not self.kv.can_allocate(self.kv.extra_pages_needed(request, first_chunk)):
            while not self.kv.can_allocate(self.kv.extra_pages_needed(request, first_chunk)):
                victim = self._victim(now, request, plan)
                if victim is None:
                    self.kv.free(request)
                    self._enqueue(request)
                    return False
                self._preempt(victim, plan)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        if request.num_frames == 0 and not request.continuation and request.num_preemptions == 0:
            self.queue_waits.observe(time.monotonic() - request.arrival_time)
        return True
