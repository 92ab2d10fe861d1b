"""Realtime-aware admission: take a new stream only while every admitted one stays ahead of playback.

Continuous batching admits whatever fits in memory, and past the GPU's capacity each new stream
slows every running one: all of them fall behind their listeners together. The gate closes
instead, and new requests wait (a bounded time, then 503), as soon as either measured signal says
the admitted streams would not keep up:

- speed: every decoding stream gains one frame per engine step, so its generation runs at
  (steps per second) / (model frame rate) times real time. Below `min_speed` the batch as a whole
  is too slow, whatever the codec does. Chunked delivery needs a margin above 1: a chunk must be
  generated while the one before it plays. Each admission is charged to the speed before its
  steps are measured (`admits`), so the gate lets in only what keeps the batch above it.
- headroom: what the listener of each playing stream has buffered (`playback.PlaybackClock`). It
  also sees what the step time does not (the codec, the host falling behind): a stream older than
  `grace_seconds` with less than `min_headroom_seconds` buffered is about to underrun.

The gate also bounds each step, not only the average: a step that prefills a burst of admissions
(thousands of tokens) stalls every playing stream for its whole length, and a stream that has just
started has a fraction of a second buffered. While one plays, `prefill_token_budget` caps a step's
prefill tokens at what fits beside its decode within 1 / (`min_speed` x frame rate), from the
measured decode time and prefill cost per token (chunked prefill under a step-time target, as
Sarathi-Serve bounds its stalls).

While the gate is closed, batch-priority streams pause their decoding (they keep their pages) so
that the steps are spent on the streams someone is listening to; they resume when it reopens.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from shoal.config import RealtimePolicy
from shoal.engine.playback import PlaybackClock


class WaitHistogram:
    """Cumulative counts of admitted requests' queue waits (Prometheus histogram semantics)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.total += seconds
        self.count += 1
        for i, bound in enumerate(self.bounds):
            if seconds <= bound:
                self.counts[i] += 1


@dataclass(frozen=True)
class GateState:
    open: bool
    speed: float  # measured generation speed per stream, times real time (inf before any step)
    min_headroom: float | None  # smallest headroom of the streams past their grace period
    reason: str = ""


class RealtimeGate:
    """The admission decision, from the measured step time and the playing streams' clocks."""

    def __init__(self, policy: RealtimePolicy, frame_rate: float) -> None:
        self.policy = policy
        self.frame_rate = frame_rate
        self.step_seconds: float | None = None  # moving average over decoding steps
        self.rows = 0.0  # moving average of the rows those steps decoded
        self.decode_seconds: float | None = None  # ... over the steps without prefill
        self.prefill_seconds_per_token: float | None = None  # what a step's prefill added, per token

    def observe_step(self, seconds: float, rows: int = 1, prefill_tokens: int = 0) -> None:
        """Book one decoding step's wall time (from its start to the next step's start), the
        rows it decoded and the prefill tokens it ran beside them."""
        weight = self.policy.step_time_smoothing
        if self.step_seconds is None:
            self.step_seconds, self.rows = seconds, float(rows)
        else:
            self.step_seconds += weight * (seconds - self.step_seconds)
            self.rows += weight * (rows - self.rows)
        if not prefill_tokens:
            self.decode_seconds = moving_average(self.decode_seconds, seconds, weight)
        elif self.decode_seconds is not None:
            per_token = max(0.0, seconds - self.decode_seconds) / prefill_tokens
            self.prefill_seconds_per_token = moving_average(self.prefill_seconds_per_token, per_token, weight)

    def prefill_token_budget(self, limit: int) -> int:
        """Prefill tokens for the next step while listened streams play: as many as keep the
        step within 1 / (min_speed x frame rate) beside its decode, at least
        `min_prefill_tokens` (requests mid-prefill must progress), at most `limit`. `limit`
        itself until both costs are measured."""
        policy = self.policy
        if not policy.enabled or self.decode_seconds is None or not self.prefill_seconds_per_token:
            return limit
        slack = 1.0 / (policy.min_speed * self.frame_rate) - self.decode_seconds
        tokens = int(slack / self.prefill_seconds_per_token) if slack > 0 else 0
        return max(min(policy.min_prefill_tokens, limit), min(tokens, limit))

    @property
    def speed(self) -> float:
        if not self.step_seconds:
            return math.inf
        return 1.0 / (self.step_seconds * self.frame_rate)

    def admits(self, rows: int) -> bool:
        """Whether `rows` decoding streams (those running plus the ones admitted this step) would
        still run at `min_speed`. The measured speed is scaled by the rows it was measured over:
        admissions are charged before their steps show in the average, so one open gate cannot
        let a burst in. Scaling in proportion errs on the side of the admitted streams (a step's
        fixed costs make more rows cheaper than that); the next measurements correct it."""
        if not self.policy.enabled or not self.step_seconds:
            return True
        predicted = self.speed * min(1.0, self.rows / max(rows, 1))
        return predicted >= self.policy.min_speed

    def forget(self) -> None:
        """Drop every measurement (after the warm-up, whose first steps compile kernels)."""
        self.idle()
        self.prefill_seconds_per_token = None

    def idle(self) -> None:
        """Nothing is decoding: the next batch starts afresh (an old slow average must not keep
        the gate closed over an empty engine). The prefill cost per token is the model's and stays."""
        self.step_seconds = None
        self.rows = 0.0
        self.decode_seconds = None

    def state(self, now: float, playing: Iterable[PlaybackClock]) -> GateState:
        """Open or closed for the next admission; `playing`: the running streams' clocks."""
        speed = self.speed
        lowest = None
        for clock in playing:
            headroom = clock.headroom(now)
            if headroom is None or clock.playing_for(now) < self.policy.grace_seconds:
                continue
            lowest = headroom if lowest is None else min(lowest, headroom)
        if not self.policy.enabled:
            return GateState(True, speed, lowest)
        if speed < self.policy.min_speed:
            return GateState(False, speed, lowest, f"generation at {speed:.2f}x real time")
        if lowest is not None and lowest < self.policy.min_headroom_seconds:
            return GateState(False, speed, lowest, f"a stream has {lowest * 1000:.0f} ms of audio buffered")
        return GateState(True, speed, lowest)


def moving_average(current: float | None, sample: float, weight: float) -> float:
    """Exponential moving average; the first sample starts it."""
    return sample if current is None else current + weight * (sample - current)
