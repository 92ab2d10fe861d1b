"""Prometheus metrics for `GET /metrics`: request outcomes and latency from the server, load and
memory from `Engine.stats()` read at scrape time (so the numbers are never stale).

With several API processes (`shoal serve --api-workers N`) the server's counters and histograms
use prometheus_client's multiprocess mode: the main process points `PROMETHEUS_MULTIPROC_DIR`
at a fresh directory before it starts the workers, each worker writes its values to files
there, and whichever worker answers a scrape sums them all (`MultiProcessCollector`). The
engine's gauges and counters come once, from the engine's stats, never summed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.engine.api import QUEUE_WAIT_BUCKETS, Engine, EngineStats, EngineUnavailable
from shoal.engine.router import EngineStatus, RoutedEngine

# From the engine's handover of a chunk to its bytes on the client's connection.
DELIVERY_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TTFA_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class EngineCollector(Collector):
    """Engine gauges and counters computed on each scrape; while the engine process does not
    answer, only `shoal_engine_up 0` and the stream count."""

    def __init__(self, engine: Engine, active_streams: Callable[[], int]) -> None:
        self.engine = engine
        self.active_streams = active_streams

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.engine.stats()
        except EngineUnavailable:
            stats = None
        up = int(stats is not None)
        yield gauge("shoal_engine_up", "Whether the engine answers (0 while it is down or restarting)", up)
        yield gauge("shoal_active_streams", "Open synthesis streams", self.active_streams())
        if stats is not None:
            yield from engine_metrics(stats)
        if isinstance(self.engine, RoutedEngine):
            yield from per_engine_metrics(self.engine.statuses())


def per_engine_metrics(statuses: list[EngineStatus]) -> Iterator[Metric]:
    """With several engines (`--gpus`): the load of each, labelled `engine` (its place in
    --gpus), beside the totals above."""
    engine_label = ["engine"]
    families = {
        "up": GaugeMetricFamily("shoal_engine_process_up", "Whether it answers", labels=engine_label),
        "restarts": CounterMetricFamily(
            "shoal_engine_restarts", "Engine process restarts this API process saw", labels=engine_label
        ),
        "running": GaugeMetricFamily(
            "shoal_engine_running_batch_size", "Requests in this engine's decode batch", labels=engine_label
        ),
        "waiting": GaugeMetricFamily(
            "shoal_engine_queue_depth", "Requests waiting in this engine", labels=["engine", "priority"]
        ),
        "pages": GaugeMetricFamily(
            "shoal_engine_kv_pages_used", "This engine's KV pages in use", labels=engine_label
        ),
        "prefix": GaugeMetricFamily(
            "shoal_engine_prefix_cache_pages", "This engine's voice prefix pages", labels=engine_label
        ),
        "fps": GaugeMetricFamily(
            "shoal_engine_frames_per_second", "Frames per second this engine generates", labels=engine_label
        ),
        "admitting": GaugeMetricFamily(
            "shoal_engine_admitting", "Whether this engine admits new streams now", labels=engine_label
        ),
        "headroom": GaugeMetricFamily(
            "shoal_engine_min_headroom_seconds",
            "Least audio buffered by a listener of this engine",
            labels=engine_label,
        ),  # fmt: skip
        "underruns": CounterMetricFamily(
            "shoal_engine_streams_underrun",
            "This engine's streams whose listener heard a gap",
            labels=engine_label,
        ),  # fmt: skip
    }
    for status in statuses:
        engine = str(status.index)
        families["up"].add_metric([engine], int(status.up))
        families["restarts"].add_metric([engine], status.restarts)
        stats = status.stats
        if stats is None:
            continue
        families["running"].add_metric([engine], stats.running)
        for priority, depth in sorted(stats.waiting.items()):
            families["waiting"].add_metric([engine, priority], depth)
        families["pages"].add_metric([engine], stats.pages_used)
        families["prefix"].add_metric([engine], stats.prefix_cache_pages)
        families["fps"].add_metric([engine], stats.frames_per_second)
        families["admitting"].add_metric([engine], int(stats.admitting))
        if stats.min_headroom_seconds is not None:
            families["headroom"].add_metric([engine], stats.min_headroom_seconds)
        families["underruns"].add_metric([engine], stats.streams_underrun)
    yield from families.values()


def engine_metrics(stats: EngineStats) -> Iterator[Metric]:
    yield gauge("shoal_running_batch_size", "Requests in the running decode batch", stats.running)
    queue = GaugeMetricFamily("shoal_queue_depth", "Requests waiting, by priority", labels=["priority"])
    for priority, depth in sorted(stats.waiting.items()):
        queue.add_metric([priority], depth)
    yield queue
    yield gauge("shoal_kv_pages_used", "KV cache pages in use", stats.pages_used)
    yield gauge("shoal_kv_pages_free", "KV cache pages free", stats.pages_free)
    yield gauge(
        "shoal_prefix_cache_pages", "KV pages held by the voice prefix cache", stats.prefix_cache_pages
    )
    yield gauge("shoal_frames_per_second", "Generated frames per second", stats.frames_per_second)
    yield gauge("shoal_steps_per_second", "Engine decode steps per second", stats.steps_per_second)
    # Realtime admission (engine/admission.py).
    admitting = int(stats.admitting)
    yield gauge(
        "shoal_admitting", "Whether the engine admits new streams now (realtime admission)", admitting
    )
    yield gauge(
        "shoal_generation_speed",
        "Decoding streams' generation speed, times real time",
        stats.generation_speed,
    )
    headroom = GaugeMetricFamily(
        "shoal_min_headroom_seconds", "Least audio buffered by a playing stream's listener (none: no sample)"
    )
    if stats.min_headroom_seconds is not None:
        headroom.add_metric([], stats.min_headroom_seconds)
    yield headroom
    yield gauge(
        "shoal_paused_batch_requests",
        "Batch decodes paused for realtime streams' headroom",
        stats.paused_batch,
    )
    yield CounterMetricFamily(
        "shoal_streams_underrun", "Streams whose listener heard a gap", value=stats.streams_underrun
    )
    yield CounterMetricFamily(
        "shoal_underrun_seconds", "Seconds of gaps listeners heard", value=stats.underrun_seconds
    )
    yield CounterMetricFamily(
        "shoal_queue_timeouts", "Requests ended with a 503 after waiting too long", value=stats.queue_timeouts
    )
    yield queue_wait_histogram(stats)
    yield SummaryMetricFamily(
        "shoal_engine_time_to_first_audio_seconds",
        "Ended streams' time from submission to first audio inside the engine (the server's "
        "shoal_time_to_first_audio_seconds adds the API's part)",
        count_value=stats.first_audio_count,
        sum_value=stats.first_audio_sum,
    )
    yield CounterMetricFamily("shoal_engine_steps", "Engine steps booked", value=stats.steps)
    yield CounterMetricFamily(
        "shoal_engine_steps_ahead",
        "Decode steps launched before the previous step was booked (the GPU busy while the host books)",
        value=stats.steps_ahead,
    )
    yield CounterMetricFamily(
        "shoal_engine_gc_pause_seconds",
        "Seconds the garbage collector paused the engine's process (its GPU loop and vocoder too)",
        value=stats.gc_pause_seconds,
    )
    yield gauge(
        "shoal_engine_gc_longest_pause_seconds",
        "The longest garbage-collector pause in the engine's process since it started",
        stats.gc_longest_pause_seconds,
    )


def queue_wait_histogram(stats: EngineStats) -> HistogramMetricFamily:
    """The engine's cumulative queue-wait counts per `QUEUE_WAIT_BUCKETS` bound, plus +Inf."""
    counts = list(stats.queue_wait_buckets) or [0] * len(QUEUE_WAIT_BUCKETS)
    buckets = [
        (floatToGoString(bound), count) for bound, count in zip(QUEUE_WAIT_BUCKETS, counts, strict=False)
    ]
    buckets.append(("+Inf", stats.queue_wait_count))
    return HistogramMetricFamily(
        "shoal_queue_wait_seconds", "Time admitted requests waited in the engine's queue", buckets=buckets,
        sum_value=stats.queue_wait_sum,
    )  # fmt: skip


class ServerMetrics:
    """One registry per app, so several apps (tests) never collide in the global registry.
    `multiprocess_dir`: the API processes' shared `PROMETHEUS_MULTIPROC_DIR` (set in the
    environment before prometheus_client was imported), whose files a scrape sums."""

    def __init__(
        self, engine: Engine, active_streams: Callable[[], int], multiprocess_dir: Path | None = None
    ) -> None:
        if multiprocess_dir is not None and values.ValueClass is values.MutexValue:
            raise RuntimeError("PROMETHEUS_MULTIPROC_DIR must be set before prometheus_client is imported")
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "shoal_requests", "HTTP requests and WebSocket sessions by route and status",
            ["route", "status"], registry=self.registry,
        )  # fmt: skip
        self.time_to_first_audio = Histogram(
            "shoal_time_to_first_audio_seconds", "From request arrival to the first audio bytes",
            ["route"], buckets=TTFA_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.delivery_lag = Histogram(
            "shoal_audio_delivery_lag_seconds",
            "From the engine's handover of an audio chunk to its bytes written to the client's "
            "connection (the wire from the engine, format encoding, the event loop)",
            ["route"], buckets=DELIVERY_LAG_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.audio_seconds = Counter(
            "shoal_audio_seconds", "Seconds of audio delivered to clients", registry=self.registry
        )
        engine_collector = EngineCollector(engine, active_streams)
        if multiprocess_dir is None:
            self.registry.register(engine_collector)
            self.exposed = self.registry
        else:  # this process's counters are in the files too: expose the files' sums
            self.exposed = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.exposed, path=str(multiprocess_dir))
            self.exposed.register(engine_collector)

    def observe_first_audio(self, route: str, seconds: float) -> None:
        self.time_to_first_audio.labels(route=route).observe(seconds)

    def delivery_lag_observer(self, route: str) -> Callable[[float], None]:
        """What `synthesis.DeliveryWatch` calls with each chunk's delay on `route`."""
        return self.delivery_lag.labels(route=route).observe

    def observe_audio(self, seconds: float) -> None:
        self.audio_seconds.inc(seconds)

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.exposed)


class RequestCounterMiddleware:
    """Counts every HTTP response by its route template (not the raw path, to bound cardinality)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", "unmatched")
            metrics: ServerMetrics | None = getattr(scope["app"].state, "metrics", None)
            if metrics is not None and path != "/metrics":
                metrics.count(path, status)
