"""Realtime admission's two measured signals, on clocks the test drives: playback headroom (with
underruns counted once per gap) and generation speed from the step time."""

from __future__ import annotations

import math

import pytest

from shoal.engine.admission import RealtimeGate, RealtimePolicy
from shoal.engine.playback import PlaybackClock


def test_headroom_counts_each_gap_once_and_resumes_after_it() -> None:
    clock = PlaybackClock()
    assert clock.headroom(0.0) is None and clock.playing_for(0.0) == 0.0
    assert clock.deliver(0.2, now=10.0) is None  # first audio: playback starts here
    assert clock.headroom(10.1) == pytest.approx(0.1)
    assert clock.deliver(0.4, now=10.15) is None  # in time: 0.05 s still buffered
    assert clock.headroom(10.15) == pytest.approx(0.45)
    gap = clock.deliver(0.4, now=11.0)  # 0.6 s played out at 10.6: a 0.4 s gap
    assert gap == pytest.approx(0.4)
    assert clock.underruns == 1 and clock.stalled_seconds == pytest.approx(0.4)
    assert clock.headroom(11.0) == pytest.approx(0.4)  # the listener resumed with the new chunk
    assert clock.deliver(0.4, now=11.3) is None and clock.underruns == 1
    assert clock.playing_for(11.3) == pytest.approx(0.9)  # 1.3 s since the first audio, less the gap


def test_gate_closes_on_slow_steps_and_reopens_when_idle() -> None:
    gate = RealtimeGate(RealtimePolicy(min_speed=1.5), frame_rate=20.0)
    assert gate.state(0.0, []).open and math.isinf(gate.speed)
    gate.observe_step(0.01)  # 100 steps/s: 5x real time
    assert gate.state(0.0, []).open and gate.speed == pytest.approx(5.0)
    for _ in range(40):
        gate.observe_step(0.05)  # 20 steps/s: 1x real time
    state = gate.state(0.0, [])
    assert not state.open and "real time" in state.reason and state.speed < 1.5
    gate.idle()
    assert gate.state(0.0, []).open


def test_gate_closes_when_a_playing_stream_runs_dry_after_its_grace() -> None:
    policy = RealtimePolicy(min_headroom_seconds=0.1, grace_seconds=0.5)
    gate = RealtimeGate(policy, frame_rate=20.0)
    gate.observe_step(0.005)
    young, old = PlaybackClock(), PlaybackClock()
    young.deliver(0.2, now=9.95)  # 0.15 s buffered but only 0.05 s old: still in its grace
    old.deliver(2.0, now=8.0)  # 2 s from 8.0: 0.05 s left at 9.95 + ... at 10.0: 0.0
    state = gate.state(10.0, [young, old])
    assert not state.open and state.min_headroom == pytest.approx(0.0) and "buffered" in state.reason
    old.deliver(1.0, now=10.0)
    state = gate.state(10.0, [young, old])
    assert state.open and state.min_headroom == pytest.approx(1.0)


def test_disabled_policy_admits_by_memory_alone() -> None:
    gate = RealtimeGate(RealtimePolicy(enabled=False), frame_rate=20.0)
    gate.observe_step(1.0)
    dry = PlaybackClock()
    dry.deliver(0.1, now=0.0)
    assert gate.state(5.0, [dry]).open
