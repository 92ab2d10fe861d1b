"""Prometheus metrics for `GET /metrics`: request outcomes and latency from the server, load and
memory from `Engine.stats()` read at scrape time (so the numbers are never stale)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shoal.engine.api import Engine

TTFA_BUCKETS = (0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0)


class EngineCollector(Collector):
    """Engine gauges computed on each scrape."""

    def __init__(self, engine: Engine, active_streams: Callable[[], int]) -> None:
        self.engine = engine
        self.active_streams = active_streams

    def collect(self) -> Iterator[GaugeMetricFamily]:
        stats = self.engine.stats()
        yield GaugeMetricFamily(
            "shoal_running_batch_size", "Requests in the running decode batch", stats.running
        )
        queue = GaugeMetricFamily("shoal_queue_depth", "Requests waiting, by priority", labels=["priority"])
        for priority, depth in sorted(stats.waiting.items()):
            queue.add_metric([priority], depth)
        yield queue
        yield GaugeMetricFamily("shoal_kv_pages_used", "KV cache pages in use", stats.pages_used)
        yield GaugeMetricFamily("shoal_kv_pages_free", "KV cache pages free", stats.pages_free)
        yield GaugeMetricFamily(
            "shoal_prefix_cache_pages", "KV pages held by the voice prefix cache", stats.prefix_cache_pages
        )
        yield GaugeMetricFamily(
            "shoal_frames_per_second", "Generated frames per second", stats.frames_per_second
        )
        yield GaugeMetricFamily(
            "shoal_steps_per_second", "Engine decode steps per second", stats.steps_per_second
        )
        yield GaugeMetricFamily("shoal_active_streams", "Open synthesis streams", self.active_streams())


class ServerMetrics:
    """One registry per app, so several apps (tests) never collide in the global registry."""

    def __init__(self, engine: Engine, active_streams: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "shoal_requests", "HTTP requests and WebSocket sessions by route and status",
            ["route", "status"], registry=self.registry,
        )  # fmt: skip
        self.time_to_first_audio = Histogram(
            "shoal_time_to_first_audio_seconds", "From request arrival to the first audio bytes",
            ["route"], buckets=TTFA_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.audio_seconds = Counter(
            "shoal_audio_seconds", "Seconds of audio delivered to clients", registry=self.registry
        )
        self.registry.register(EngineCollector(engine, active_streams))

    def observe_first_audio(self, route: str, seconds: float) -> None:
        self.time_to_first_audio.labels(route=route).observe(seconds)

    def observe_audio(self, seconds: float) -> None:
        self.audio_seconds.inc(seconds)

    def count(self, route: str, status: int) -> None:
        self.requests.labels(route=route, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


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
