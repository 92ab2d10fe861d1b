"""`RoutedEngine`: several engines (one process per GPU) behind the one `Engine` API the server
uses, as `shoal serve --gpus 0,1` runs them.

Where a request goes (`RoutingPolicy`):
- A voice's requests go to its home engine, picked by rendezvous hashing of the voice over the
  engines that answer: every API process picks the same one without talking to the others, so
  the voice's prefix pages are computed once and hit after. When an engine stops answering only
  its voices move, and they move back when it returns.
- The home engine is left for the engine with the most capacity when its load (running plus
  waiting requests) exceeds the least loaded engine's by more than the policy's slack, or when
  it stops admitting new streams (realtime admission: its streams are close to underrunning).
- Capacity ranks engines by whether they admit, then by load, then by their listeners' least
  buffered audio. Loads come from each engine's last heartbeat (at most half a second old), plus
  the requests this router sent it since, so that a burst is spread instead of piled on the
  engine that looked idle.

An engine that dies is left out until its supervisor has it answering again; the others keep
serving. Its requests that had not sent audio yet are sent again to another engine (so a crash
costs them a prefill, not a 503); those already streaming fail with `EngineUnavailable` (a cut
stream; job items retry and land on another engine).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from collections.abc import AsyncIterator, Sequence, Set
from dataclasses import dataclass

import numpy as np

from shoal.config import RoutingPolicy
from shoal.engine.api import (
    AudioChunk,
    Engine,
    EngineStats,
    EngineUnavailable,
    FinishReason,
    RequestHandle,
    SynthesisRequest,
    VoiceReference,
)

log = logging.getLogger("shoal.engine.router")


def voice_key(references: tuple[VoiceReference, ...]) -> bytes | None:
    """A digest of the voice (its references' texts and codes); None without references."""
    if not references:
        return None
    digest = hashlib.blake2b(digest_size=16)
    for reference in references:
        codes = np.ascontiguousarray(reference.codes)
        digest.update(reference.text.encode())
        digest.update(repr((codes.dtype.str, codes.shape)).encode())
        digest.update(codes.tobytes())
    return digest.digest()


def rendezvous_weight(key: bytes, engine_index: int) -> int:
    """Highest-random-weight hashing: the voice's home is the answering engine of top weight."""
    digest = hashlib.blake2b(key + engine_index.to_bytes(4, "little"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def load_of(stats: EngineStats) -> int:
    return stats.running + sum(stats.waiting.values())


def combine_stats(snapshots: Sequence[EngineStats]) -> EngineStats:
    """One snapshot for several engines: counts and rates summed; admitting if any admits; the
    slowest decoding engine's speed and the least headroom anywhere (the numbers that say
    whether some listener is about to hear a gap)."""
    if not snapshots:
        raise ValueError("no engine stats to combine")
    if len(snapshots) == 1:
        return snapshots[0]
    waiting: dict[str, int] = {}
    for stats in snapshots:
        for priority, depth in stats.waiting.items():
            waiting[priority] = waiting.get(priority, 0) + depth
    speeds = [stats.generation_speed for stats in snapshots if stats.running > 0 and stats.generation_speed]
    headrooms = [stats.min_headroom_seconds for stats in snapshots if stats.min_headroom_seconds is not None]
    bucket_lists = [stats.queue_wait_buckets for stats in snapshots if stats.queue_wait_buckets]
    buckets = tuple(int(sum(counts)) for counts in zip(*bucket_lists, strict=True)) if bucket_lists else ()
    return EngineStats(
        running=sum(stats.running for stats in snapshots),
        waiting=waiting,
        pages_used=sum(stats.pages_used for stats in snapshots),
        pages_free=sum(stats.pages_free for stats in snapshots),
        steps_per_second=sum(stats.steps_per_second for stats in snapshots),
        frames_per_second=sum(stats.frames_per_second for stats in snapshots),
        prefix_cache_pages=sum(stats.prefix_cache_pages for stats in snapshots),
        admitting=any(stats.admitting for stats in snapshots),
        generation_speed=min(speeds) if speeds else 0.0,
        min_headroom_seconds=min(headrooms) if headrooms else None,
        paused_batch=sum(stats.paused_batch for stats in snapshots),
        streams_underrun=sum(stats.streams_underrun for stats in snapshots),
        underrun_seconds=sum(stats.underrun_seconds for stats in snapshots),
        first_audio_sum=sum(stats.first_audio_sum for stats in snapshots),
        first_audio_count=sum(stats.first_audio_count for stats in snapshots),
        queue_timeouts=sum(stats.queue_timeouts for stats in snapshots),
        queue_wait_sum=sum(stats.queue_wait_sum for stats in snapshots),
        queue_wait_count=sum(stats.queue_wait_count for stats in snapshots),
        queue_wait_buckets=buckets,
        gc_pause_seconds=sum(stats.gc_pause_seconds for stats in snapshots),
        gc_longest_pause_seconds=max(stats.gc_longest_pause_seconds for stats in snapshots),
        steps=sum(stats.steps for stats in snapshots),
        steps_ahead=sum(stats.steps_ahead for stats in snapshots),
    )


class RoutedHandle(RequestHandle):
    """A request's handle on the engine it was sent to; if that engine is lost before the first
    audio, the request is sent to another engine that has not had it, and the stream goes on
    from there. After the first audio a lost engine ends the stream (EngineUnavailable)."""

    def __init__(
        self, router: RoutedEngine, request: SynthesisRequest, index: int, handle: RequestHandle
    ) -> None:
        self._router = router
        self._request = request
        self._handle = handle
        self._tried = {index}

    @property
    def request_id(self) -> str:  # type: ignore[override]
        return self._handle.request_id

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._handle.finish_reason

    async def __aiter__(self) -> AsyncIterator[AudioChunk]:
        started = False
        while True:
            try:
                async for chunk in self._handle:
                    started = True
                    yield chunk
                return
            except EngineUnavailable as error:
                if started:
                    raise
                log.warning("engine lost before a request's first audio (%s): sending it to another", error)
                _, self._handle = self._router._send(self._request, self._tried)

    async def aclose(self) -> None:
        await self._handle.aclose()


@dataclass(frozen=True)
class EngineStatus:
    """One engine as the router sees it now (health and per-engine metrics)."""

    index: int
    up: bool
    stats: EngineStats | None
    pid: int | None = None
    restarts: int = 0  # engine process restarts this API process has seen


class RoutedEngine(Engine):
    """The Engine API over several engines. Like the engines it holds, `submit` and the handles
    belong to the event loop that called `start`; `stats` may be called from any thread."""

    def __init__(self, engines: Sequence[Engine], policy: RoutingPolicy | None = None) -> None:
        if not engines:
            raise ValueError("a routed engine needs at least one engine")
        self.engines = list(engines)
        self.policy = policy or RoutingPolicy()
        self._pending = [0] * len(self.engines)  # requests sent since the engine's last stats
        self._seen_stats: list[EngineStats | None] = [None] * len(self.engines)
        self._random = random.Random()

    # What the server reads: the first answering engine's (every engine serves the same model).

    @property
    def sample_rate(self) -> int:  # type: ignore[override]
        return self._reference_engine().sample_rate

    @property
    def frame_rate(self) -> float:  # type: ignore[override]
        return self._reference_engine().frame_rate

    @property
    def model_name(self) -> str:  # type: ignore[override]
        return self._reference_engine().model_name

    def _reference_engine(self) -> Engine:
        answering = self._answering()
        return self.engines[answering[0][0]] if answering else self.engines[0]

    async def start(self) -> None:
        await asyncio.gather(*(engine.start() for engine in self.engines))

    async def stop(self) -> None:
        await asyncio.gather(*(engine.stop() for engine in self.engines), return_exceptions=True)

    # Routing -----------------------------------------------------------------------------------

    def _answering(self, exclude: Set[int] = frozenset()) -> list[tuple[int, EngineStats]]:
        """(index, stats) of the engines that answer now, less `exclude`, with the router's
        pending requests folded into each snapshot's count until the engine's next snapshot
        includes them."""
        answering = []
        for index, engine in enumerate(self.engines):
            if index in exclude:
                continue
            try:
                stats = engine.stats()
            except EngineUnavailable:
                continue
            if stats is not self._seen_stats[index]:
                self._seen_stats[index] = stats
                self._pending[index] = 0
            answering.append((index, stats))
        return answering

    def _load(self, index: int, stats: EngineStats) -> int:
        return load_of(stats) + self._pending[index]

    def _capacity_rank(self, index: int, stats: EngineStats) -> tuple:
        headroom = stats.min_headroom_seconds
        return (stats.admitting, -self._load(index, stats), float("inf") if headroom is None else headroom)

    def choose(self, references: tuple[VoiceReference, ...] = (), exclude: Set[int] = frozenset()) -> int:
        """The index of the engine this request (of this voice) goes to, among those not in
        `exclude`; EngineUnavailable when none of them answers."""
        answering = self._answering(exclude)
        if not answering:
            raise EngineUnavailable("no engine is answering")
        if len(answering) == 1:
            return answering[0][0]
        if self.policy.mode == "random":
            return self._random.choice(answering)[0]
        best_index, best_stats = max(answering, key=lambda item: self._capacity_rank(*item))
        key = voice_key(references) if self.policy.mode == "voice" else None
        if key is None:
            return best_index
        home_index, home_stats = max(answering, key=lambda item: rendezvous_weight(key, item[0]))
        least_load = self._load(best_index, best_stats)
        slack = max(self.policy.affinity_slack, self.policy.affinity_fraction * least_load)
        if home_stats.admitting and self._load(home_index, home_stats) <= least_load + slack:
            return home_index
        return best_index

    def submit(self, request: SynthesisRequest) -> RequestHandle:
        """Send the request to the engine `choose` picks; one that has just stopped answering
        is skipped for the next."""
        return RoutedHandle(self, request, *self._send(request, set()))

    def _send(self, request: SynthesisRequest, tried: set[int]) -> tuple[int, RequestHandle]:
        """(engine index, handle) of the request sent to the best engine not in `tried` (which
        gains it); EngineUnavailable when every answering engine was tried."""
        while True:
            index = self.choose(request.references, exclude=tried)
            tried.add(index)
            try:
                handle = self.engines[index].submit(request)
            except EngineUnavailable as error:
                log.warning("engine %d refused a request: %s", index, error)
                continue
            self._pending[index] += 1
            return index, handle

    def abort(self, request_id: str) -> None:
        """Sent to every engine: only the one running the request has it (request ids are unique
        per API process), the others ignore an unknown id."""
        for engine in self.engines:
            engine.abort(request_id)

    async def prefill_voice(self, references: tuple[VoiceReference, ...], *args) -> None:
        """Prefill on the engine the voice's requests will go to."""
        await self.engines[self.choose(references)].prefill_voice(references, *args)

    def check_voice(self, references: tuple[VoiceReference, ...]) -> None:
        self.engines[self.choose(references)].check_voice(references)

    async def encode_reference(self, audio: np.ndarray, sample_rate: int) -> np.ndarray:
        return await self.engines[self.choose()].encode_reference(audio, sample_rate)

    # Stats -------------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        """The answering engines' stats combined; EngineUnavailable when none answers."""
        answering = self._answering()
        if not answering:
            raise EngineUnavailable("no engine is answering")
        return combine_stats([stats for _, stats in answering])

    async def refresh_stats(self) -> EngineStats:
        """Every answering engine's stats now (engines in other processes are asked)."""
        fresh = await asyncio.gather(*(self._fresh_stats(engine) for engine in self.engines))
        snapshots = [stats for stats in fresh if stats is not None]
        if not snapshots:
            raise EngineUnavailable("no engine is answering")
        return combine_stats(snapshots)

    @staticmethod
    async def _fresh_stats(engine: Engine) -> EngineStats | None:
        refresh = getattr(engine, "refresh_stats", None)
        try:
            if refresh is not None:
                return await refresh()
            return await asyncio.to_thread(engine.stats)
        except EngineUnavailable:
            return None

    def statuses(self) -> list[EngineStatus]:
        """Each engine's state, in `--gpus` order (for health and per-engine metrics)."""
        statuses = []
        for index, engine in enumerate(self.engines):
            try:
                stats: EngineStats | None = engine.stats()
            except EngineUnavailable:
                stats = None
            statuses.append(
                EngineStatus(
                    index=index,
                    up=stats is not None,
                    stats=stats,
                    pid=getattr(engine, "pid", None),
                    restarts=getattr(engine, "restarts", 0),
                )
            )
        return statuses


__all__ = ["EngineStatus", "RoutedEngine", "RoutedHandle", "combine_stats", "rendezvous_weight", "voice_key"]
