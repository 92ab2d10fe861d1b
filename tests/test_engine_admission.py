"""Realtime admission's two measured signals, on clocks the test drives: playback headroom (with
underruns counted once per gap) and generation speed from the step time."""

from __future__ import annotations

import math

import pytest

from shoal.config import RealtimePolicy
from shoal.engine.admission import RealtimeGate
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
    gate = RealtimeGate(RealtimePolicy(enabled=True, min_speed=1.5), frame_rate=20.0)
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
    policy = RealtimePolicy(enabled=True, min_headroom_seconds=0.1, grace_seconds=0.5)
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


def test_admissions_are_charged_before_their_steps_are_measured() -> None:
    """The measured speed is scaled by the rows it was measured over: 10 rows at 3x admit up to
    20 (1.5x), and an old average over fewer rows does not let a burst in."""
    gate = RealtimeGate(RealtimePolicy(enabled=True, min_speed=1.5), frame_rate=20.0)
    assert gate.admits(1000)  # nothing measured yet
    gate.observe_step(1 / 60, rows=10)  # 60 steps/s over 10 rows: 3x real time
    assert gate.admits(10) and gate.admits(20) and not gate.admits(21)
    assert gate.admits(5)  # fewer rows are never predicted faster than measured, nor slower
    gate.idle()
    assert gate.admits(1000)
    assert RealtimeGate(RealtimePolicy(enabled=False), 20.0).admits(1000)


def test_prefill_budget_keeps_a_step_within_the_realtime_speed() -> None:
    """At 20 frames/s and 1.5x a step may take 1/30 s: with decode steps of 10 ms and 20 us
    per prefill token, about 1,166 tokens fit beside the decode; never below the policy's floor
    nor above the engine's limit, and the limit itself until both costs are measured."""
    policy = RealtimePolicy(enabled=True, min_speed=1.5, min_prefill_tokens=64, step_time_smoothing=1.0)
    gate = RealtimeGate(policy, frame_rate=20.0)
    assert gate.prefill_token_budget(8192) == 8192  # nothing measured
    gate.observe_step(0.03, rows=4, prefill_tokens=1000)  # no decode-only step yet: no cost
    assert gate.prefill_seconds_per_token is None and gate.prefill_token_budget(8192) == 8192
    gate.observe_step(0.01, rows=4)
    assert gate.prefill_token_budget(8192) == 8192  # the decode alone: still no cost per token
    gate.observe_step(0.03, rows=4, prefill_tokens=1000)
    assert gate.prefill_seconds_per_token == pytest.approx(2e-5)
    assert gate.decode_seconds == pytest.approx(0.01)  # a prefill step leaves the decode time alone
    assert gate.prefill_token_budget(8192) == int((1 / 30 - 0.01) / 2e-5)
    assert gate.prefill_token_budget(500) == 500
    gate.observe_step(0.04, rows=64)  # the decode alone exceeds the step: the floor
    assert gate.prefill_token_budget(8192) == 64 and gate.prefill_token_budget(16) == 16
    gate.idle()  # a new batch: its decode time is measured afresh, the cost per token stays
    assert gate.prefill_token_budget(8192) == 8192 and gate.prefill_seconds_per_token is not None
    gate.forget()
    assert gate.prefill_seconds_per_token is None and gate.step_seconds is None
    assert RealtimeGate(RealtimePolicy(enabled=False), 20.0).prefill_token_budget(8192) == 8192


def test_disabled_policy_admits_by_memory_alone() -> None:
    gate = RealtimeGate(RealtimePolicy(enabled=False), frame_rate=20.0)
    gate.observe_step(1.0)
    dry = PlaybackClock()
    dry.deliver(0.1, now=0.0)
    assert gate.state(5.0, [dry]).open


def test_core_pauses_batch_work_holds_new_streams_and_expires_them(golden_dir) -> None:
    """On a real engine core (the golden tiny model): while a listened stream runs below the
    policy's speed, batch decoding pauses (its pages kept), a new standard request is not
    admitted and, past the maximum wait, ends with EngineOverloaded; batch work never expires."""
    import time

    import torch
    from model_testing import tiny_s2

    from shoal.config import EngineConfig
    from shoal.engine.api import EngineOverloaded, FinishReason, Priority
    from shoal.engine.core import EngineCore
    from shoal.engine.request import SamplingParams
    from shoal.models.prompt import build_prompt

    model = tiny_s2(golden_dir, torch.float32)
    policy = RealtimePolicy(enabled=True, min_speed=1e9, max_queue_wait_seconds=0.3)
    config = EngineConfig(device="cpu", dtype="float32", num_pages=64, page_size=16, realtime=policy)
    core = EngineCore(model, config)
    ended: dict[str, FinishReason] = {}

    def sink(request, frames, reason):
        if reason is not None:
            ended[request.request_id] = reason

    def new(name: str, priority: Priority):
        prompt = build_prompt(model.config, model.tokenizer, f"text {name}")
        request = core.new_request(
            prompt, SamplingParams(seed=1), max_new_frames=200, priority=priority, request_id=name, sink=sink
        )
        core.add(request)
        return request

    bulk = new("bulk", Priority.BATCH)
    for _ in range(3):
        core.step()
    assert bulk.num_frames > 0 and core.scheduler.last_gate.open  # only batch work: open
    listened = new("listened", Priority.STANDARD)
    for _ in range(3):
        core.step()
    assert listened.num_frames > 0
    frames_before = bulk.num_frames
    late = new("late", Priority.STANDARD)
    late_bulk = new("late-bulk", Priority.BATCH)
    core.step()
    gate = core.scheduler.last_gate
    assert not gate.open and "real time" in gate.reason
    assert bulk in core.scheduler.last_paused and bulk.block_table  # paused, pages kept
    assert late.status.value == "waiting" and late_bulk.status.value == "waiting"
    time.sleep(0.35)
    core.step()
    assert ended.get("late") is FinishReason.ERROR and isinstance(late.error, EngineOverloaded)
    assert "late-bulk" not in ended and late_bulk.status.value == "waiting"
    assert bulk.num_frames == frames_before  # no batch frame while the gate was closed
    assert core.stats().queue_timeouts == 1 and not core.stats().admitting
    core.abort("listened")
    core.step()  # no listened stream: open again, batch work resumes and the waiting bulk enters
    assert core.scheduler.last_gate.open and bulk.num_frames > frames_before
    assert late_bulk.status.value == "running"


def _core_with(golden_dir, policy: RealtimePolicy):
    """An engine core on the golden tiny model with `policy`, and a function queueing a standard
    request (50 frames) by name."""
    import torch
    from model_testing import tiny_s2

    from shoal.config import EngineConfig
    from shoal.engine.api import Priority
    from shoal.engine.core import EngineCore
    from shoal.engine.request import SamplingParams
    from shoal.models.prompt import build_prompt

    model = tiny_s2(golden_dir, torch.float32)
    settings = EngineConfig(device="cpu", dtype="float32", num_pages=128, page_size=16, realtime=policy)
    core = EngineCore(model, settings)

    def new(name: str, text: str = ""):
        prompt = build_prompt(model.config, model.tokenizer, text or f"text {name}")
        request = core.new_request(
            prompt, SamplingParams(seed=1), max_new_frames=50, priority=Priority.STANDARD, request_id=name
        )
        core.add(request)
        return request

    return core, new


def test_one_open_gate_admits_only_what_keeps_the_batch_up(golden_dir) -> None:
    """A burst of new requests against a measured speed: the scheduler admits those the charged
    speed allows in one step and keeps the rest waiting (and may still resume admitted work)."""
    core, new = _core_with(golden_dir, RealtimePolicy(enabled=True, min_speed=1.5))
    running = [new("a"), new("b")]
    for _ in range(3):
        core.step()
    assert all(r.num_frames > 0 for r in running)
    gate = core.scheduler.gate
    gate.idle()
    gate.observe_step(1 / (3.0 * gate.frame_rate), rows=2)  # 3x real time over 2 rows
    burst = [new(f"burst{i}") for i in range(5)]
    plan = core.scheduler.schedule()
    admitted = [r for r in burst if r.status.value == "running"]
    assert admitted == burst[:2]  # 4 rows at 1.5x; a fifth would run at 1.2x
    assert {r for r, _ in plan.prefills} == set(admitted)


def test_a_playing_stream_caps_the_prefill_of_new_ones(golden_dir) -> None:
    """While a listened stream plays, a step prefills only what its measured costs allow beside
    the decode; before its first audio nothing caps the prefill."""
    policy = RealtimePolicy(enabled=True, min_speed=1.5, min_prefill_tokens=4)
    core, new = _core_with(golden_dir, policy)
    playing = new("playing")
    for _ in range(3):
        core.step()
    gate = core.scheduler.gate
    gate.step_seconds, gate.rows = 1e-3, 1.0  # fast: the gate is open (not this CPU's step time)
    gate.decode_seconds = 1 / (1.5 * gate.frame_rate) - 10 * 1e-3  # room for 10 tokens at 1 ms each
    gate.prefill_seconds_per_token = 1e-3
    long_text = "a much longer text that needs many more prompt tokens than ten of them"
    waiting = new("waiting", long_text)
    plan = core.scheduler.schedule()  # the stream has no audio yet: the engine's whole budget
    assert dict(plan.prefills)[waiting] == waiting.num_pending > 10
    core.scheduler.remove(waiting)
    playing.playback = PlaybackClock()
    playing.playback.deliver(0.5)  # its first audio: now someone listens
    again = new("again", long_text)
    plan = core.scheduler.schedule()
    assert sum(n for _, n in plan.prefills) == 10 and dict(plan.prefills)[again] == 10


def test_a_queue_that_is_not_draining_admits_the_newest_first(golden_dir) -> None:
    """Once the oldest waiting request has waited `newest_first_after_seconds`, the newest is
    admitted first (the stale ones expire with a 503 instead of every admitted one starting
    late); a queue that drains in time stays first come, first served."""
    import time

    policy = RealtimePolicy(enabled=True, min_speed=1.5, newest_first_after_seconds=0.25)
    core, new = _core_with(golden_dir, policy)
    running = new("running")
    core.step()
    gate = core.scheduler.gate
    gate.observe_step(1 / (3.0 * gate.frame_rate), rows=1)  # 3x over 1 row: room for one more
    fresh = [new(f"fresh{i}") for i in range(3)]
    core.scheduler.schedule()
    assert [r.status.value for r in fresh] == ["running", "waiting", "waiting"]  # in time: FIFO
    core.scheduler.remove(fresh[0])
    stale = fresh[1]
    stale.arrival_time = time.monotonic() - 1.0
    newest = new("newest")
    core.scheduler.schedule()
    assert newest.status.value == "running" and stale.status.value == "waiting"
    assert fresh[2].status.value == "waiting" and running.status.value == "running"
