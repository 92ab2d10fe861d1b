"""The routing rules of `RoutedEngine` (engine/router.py) on engines whose load the test sets:
voice affinity that is the same in every router, spill-over to capacity, bursts spread by the
router's own count, engines that stop answering, and the combined stats. The real thing, two
engine processes behind one API, is tests/test_data_parallel.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from shoal.config import RoutingPolicy
from shoal.engine.api import (
    AudioChunk,
    Engine,
    EngineStats,
    EngineUnavailable,
    FinishReason,
    QueuedHandle,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)
from shoal.engine.router import RoutedEngine, combine_stats, voice_key


def stats(running: int = 0, waiting: int = 0, *, admitting: bool = True, **fields) -> EngineStats:
    return EngineStats(
        running=running,
        waiting={"standard": waiting},
        pages_used=running,
        pages_free=100,
        steps_per_second=10.0,
        frames_per_second=10.0 * running,
        admitting=admitting,
        **fields,
    )


class SentHandle(QueuedHandle):
    """What the test says the engine sends back: chunks, then a finish reason or an error."""

    def deliver_all(self, *items) -> None:
        for item in items:
            self._queue.put_nowait(item)

    async def aclose(self) -> None:
        pass


class LoadedEngine(Engine):
    """An engine whose stats the test sets; it records what was sent to it."""

    sample_rate = 44100
    frame_rate = 21.5
    model_name = "test"

    def __init__(self, snapshot: EngineStats | None = None) -> None:
        self.snapshot = snapshot or stats()
        self.up = True
        self.submitted: list[SynthesisRequest] = []
        self.handles: list[SentHandle] = []
        self.aborted: list[str] = []
        self.prefilled = 0

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        if not self.up:
            raise EngineUnavailable("down")
        self.submitted.append(request)
        self.handles.append(SentHandle())
        return self.handles[-1]

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def prefill_voice(self, references: tuple[VoiceReference, ...]) -> None:
        self.prefilled += 1

    def check_voice(self, references: tuple[VoiceReference, ...]) -> None:
        pass

    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        return np.zeros((10, 2), dtype=np.int64)

    def stats(self) -> EngineStats:
        if not self.up:
            raise EngineUnavailable("down")
        return self.snapshot

    def heartbeat(self, snapshot: EngineStats) -> None:
        """A new snapshot, as a pong brings: the router stops counting what it sent before."""
        self.snapshot = snapshot


def voice(seed: int) -> tuple[VoiceReference, ...]:
    codes = np.random.default_rng(seed).integers(0, 1024, size=(10, 30))
    return (VoiceReference(text=f"voice {seed}", codes=codes),)


def request(references=()) -> SynthesisRequest:
    return SynthesisRequest(text="Hello.", references=references)


def sent_to(router: RoutedEngine, references=()) -> int:
    """Which engine the router sends a request to."""
    before = [len(engine.submitted) for engine in router.engines]
    router.submit(request(references))
    after = [len(engine.submitted) for engine in router.engines]
    return next(index for index, (b, a) in enumerate(zip(before, after, strict=True)) if a > b)


def routed(engines: list[LoadedEngine], **policy) -> RoutedEngine:
    return RoutedEngine(engines, RoutingPolicy(**policy))


def test_a_voice_has_one_home_in_every_router_and_voices_spread():
    """Rendezvous hashing: two routers (two API processes) agree on each voice's engine with no
    shared state, and 40 voices do not all land on one of four engines."""
    engines = [LoadedEngine() for _ in range(4)]
    first, second = RoutedEngine(engines), RoutedEngine(list(engines))
    homes = set()
    for seed in range(40):
        references = voice(seed)
        choice = first.choose(references)
        assert second.choose(references) == choice
        assert first.choose(references) == choice  # and stays, while loads are even
        homes.add(choice)
    assert len(homes) == 4


def test_a_voice_stays_home_within_the_slack_then_spills_to_capacity():
    engines = [LoadedEngine(), LoadedEngine()]
    router = routed(engines, affinity_slack=2, affinity_fraction=0.0)
    references = voice(7)
    home = router.choose(references)
    other = 1 - home
    engines[home].heartbeat(stats(running=2))
    assert sent_to(router, references) == home  # 2 ahead: within the slack
    engines[home].heartbeat(stats(running=3))
    assert sent_to(router, references) == other  # 3 ahead: the least loaded engine
    engines[home].heartbeat(stats(running=0, admitting=False))
    assert sent_to(router, references) == other  # home no longer admits
    engines[home].heartbeat(stats(running=40))
    engines[other].heartbeat(stats(running=36))
    router_fraction = routed(engines, affinity_slack=0, affinity_fraction=0.25)
    assert router_fraction.choose(references) == home  # 4 ahead of 36: within a quarter


def test_a_burst_is_spread_by_what_the_router_sent_since_the_last_heartbeat():
    engines = [LoadedEngine(), LoadedEngine(), LoadedEngine()]
    router = routed(engines, mode="capacity")
    targets = [sent_to(router) for _ in range(9)]
    assert sorted(targets) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for engine, running in zip(engines, (5, 1, 3), strict=True):
        engine.heartbeat(stats(running=running))  # the snapshot now holds what was sent
    assert sent_to(router) == 1
    engines[1].heartbeat(stats(running=1, admitting=False))
    assert sent_to(router) == 2  # an engine that admits beats a less loaded one that does not


def test_capacity_prefers_more_playback_headroom_at_equal_load():
    engines = [
        LoadedEngine(stats(2, min_headroom_seconds=0.3)),
        LoadedEngine(stats(2, min_headroom_seconds=2.0)),
    ]
    assert routed(engines, mode="capacity").choose() == 1


def test_an_engine_that_stops_answering_is_skipped_and_its_voices_move_then_return():
    engines = [LoadedEngine(), LoadedEngine()]
    router = routed(engines)
    references = voice(3)
    home = router.choose(references)
    engines[home].up = False
    assert sent_to(router, references) == 1 - home
    assert router.stats().running == 0  # the answering engine's stats alone
    engines[home].up = True
    assert router.choose(references) == home
    for engine in engines:
        engine.up = False
    with pytest.raises(EngineUnavailable):
        router.submit(request(references))
    with pytest.raises(EngineUnavailable):
        router.stats()


def test_random_routing_uses_every_answering_engine():
    engines = [LoadedEngine(), LoadedEngine()]
    router = routed(engines, mode="random")
    references = voice(1)
    assert {router.choose(references) for _ in range(64)} == {0, 1}


def test_prefill_goes_where_the_voices_requests_go_and_abort_reaches_every_engine():
    engines = [LoadedEngine(), LoadedEngine()]
    router = routed(engines)
    references = voice(11)
    home = router.choose(references)
    asyncio.run(router.prefill_voice(references))
    assert [engine.prefilled for engine in engines][home] == 1 and sum(e.prefilled for e in engines) == 1
    router.abort("request-1")
    assert all(engine.aborted == ["request-1"] for engine in engines)


def test_voice_key_depends_on_text_and_codes_only():
    assert voice_key(()) is None
    assert voice_key(voice(1)) == voice_key(voice(1))
    assert voice_key(voice(1)) != voice_key(voice(2))
    changed = (VoiceReference(text="other", codes=voice(1)[0].codes),)
    assert voice_key(changed) != voice_key(voice(1))


def test_combined_stats_sum_counts_and_keep_the_worst_stream():
    first = stats(3, 1, generation_speed=2.5, min_headroom_seconds=0.8, queue_wait_count=4,
                  queue_wait_buckets=(1, 2, 4), streams_underrun=1, gc_pause_seconds=0.02,
                  gc_longest_pause_seconds=0.01, steps=100, steps_ahead=60)  # fmt: skip
    second = stats(1, 2, admitting=False, generation_speed=1.8, min_headroom_seconds=1.5,
                   queue_wait_count=2, queue_wait_buckets=(0, 1, 2), gc_pause_seconds=0.03,
                   gc_longest_pause_seconds=0.03, steps=50, steps_ahead=10)  # fmt: skip
    idle = stats(0, 0, generation_speed=9.0)
    combined = combine_stats([first, second, idle])
    assert combined.running == 4 and combined.waiting == {"standard": 3}
    assert combined.admitting and combined.generation_speed == 1.8  # the idle engine's speed is not one
    assert combined.min_headroom_seconds == 0.8 and combined.streams_underrun == 1
    assert combined.queue_wait_count == 6 and combined.queue_wait_buckets == (1, 3, 6)
    assert combined.gc_pause_seconds == 0.05 and combined.gc_longest_pause_seconds == 0.03
    assert (combined.steps, combined.steps_ahead) == (150, 70)
    assert combine_stats([first]) is first


def chunk(value: float) -> AudioChunk:
    return AudioChunk(samples=np.full(4, value, dtype=np.float32), sample_rate=44100)


async def received(handle: RequestHandle) -> list[float]:
    return [float(item.samples[0]) async for item in handle]


def test_a_request_whose_engine_is_lost_before_its_first_audio_goes_to_another():
    async def scenario() -> None:
        engines = [LoadedEngine(), LoadedEngine()]
        router = routed(engines, mode="capacity")
        handle = router.submit(request())
        lost = engines[0].handles[0]
        engines[1].heartbeat(stats(running=5))  # engine 0 still looks best, and still answers
        lost.deliver_all(EngineUnavailable("the engine process closed its connection"))
        task = asyncio.ensure_future(received(handle))
        await asyncio.sleep(0)
        for _ in range(1000):  # sent again, to the engine that had not had it
            if engines[1].handles or task.done():
                break
            await asyncio.sleep(0)
        assert engines[1].handles, task.exception() if task.done() else "not sent again"
        engines[1].handles[0].deliver_all(chunk(1.0), chunk(2.0), FinishReason.STOP)
        assert await task == [1.0, 2.0] and handle.finish_reason is FinishReason.STOP

        # Lost after its first audio: the stream ends with the error, and is not sent again.
        streaming = router.submit(request())
        first = next(engine for engine in engines if len(engine.handles) == 2).handles[1]
        first.deliver_all(chunk(3.0), EngineUnavailable("gone"))
        with pytest.raises(EngineUnavailable):
            await received(streaming)
        assert sum(len(engine.handles) for engine in engines) == 3

        # No other engine to try: the request fails as the lone engine's would.
        alone = routed([LoadedEngine()])
        single = alone.submit(request())
        alone.engines[0].handles[0].deliver_all(EngineUnavailable("gone"))
        with pytest.raises(EngineUnavailable):
            await received(single)

    asyncio.run(scenario())
