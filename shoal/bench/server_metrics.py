"""What the server saw during one load run, from its `/metrics` before and after: where a
client's first audio went (queue wait, the engine, the API) and where its gaps were made (the
engine's own underrun count, the API's delivery lag, the garbage collector).

The engine books a stream's first audio and underruns when the stream ends, and its counters
reach the API processes with the next heartbeat, so the snapshot after a run is taken once the
server is idle and a heartbeat later (`open_loop.run_rate`).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# What a snapshot keeps -> the sample it sums over every label set (routes).
SERIES = {
    "queue_wait_sum": "shoal_queue_wait_seconds_sum",
    "queue_wait_count": "shoal_queue_wait_seconds_count",
    "engine_first_audio_sum": "shoal_engine_time_to_first_audio_seconds_sum",
    "engine_first_audio_count": "shoal_engine_time_to_first_audio_seconds_count",
    "server_first_audio_sum": "shoal_time_to_first_audio_seconds_sum",
    "server_first_audio_count": "shoal_time_to_first_audio_seconds_count",
    "delivery_lag_sum": "shoal_audio_delivery_lag_seconds_sum",
    "delivery_lag_count": "shoal_audio_delivery_lag_seconds_count",
    "engine_underrun_streams": "shoal_streams_underrun_total",
    "engine_underrun_seconds": "shoal_underrun_seconds_total",
    "gc_pause_seconds": "shoal_engine_gc_pause_seconds_total",
    "steps": "shoal_engine_steps_total",
    "steps_ahead": "shoal_engine_steps_ahead_total",
}
LATE_DELIVERY_SECONDS = 0.1  # a chunk later than this after the engine handed it over is "late"


def parse_snapshot(text: str) -> dict[str, float]:
    """The series above (summed over routes) and the delivery lag's count within
    `LATE_DELIVERY_SECONDS`, from a /metrics page."""
    wanted = {name: key for key, name in SERIES.items()}
    values = dict.fromkeys(SERIES, 0.0) | {"delivery_on_time": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is not None:
                values[key] += sample.value
            elif (
                sample.name == "shoal_audio_delivery_lag_seconds_bucket"
                and float(sample.labels.get("le", "nan")) == LATE_DELIVERY_SECONDS
            ):
                values["delivery_on_time"] += sample.value
    return values


@dataclass
class ServerView:
    """One run's deltas; means in milliseconds, None where nothing was counted."""

    queue_wait_ms: float | None
    engine_first_audio_ms: float | None  # submission to first audio inside the engine
    server_first_audio_ms: float | None  # request to first bytes at the server
    delivery_lag_ms: float | None  # engine handover to bytes on the connection, per chunk
    late_delivery_share: float | None  # chunks more than LATE_DELIVERY_SECONDS after handover
    engine_underrun_streams: int
    engine_underrun_seconds: float
    gc_pause_ms: float
    steps_ahead_share: float | None = None  # of the engine's steps, those launched ahead

    def line(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.0f} ms"

        late = "-" if self.late_delivery_share is None else f"{100 * self.late_delivery_share:.2f}%"
        ahead = "-" if self.steps_ahead_share is None else f"{100 * self.steps_ahead_share:.0f}%"
        return (
            f"server: queue wait {ms(self.queue_wait_ms)}, first audio in the engine "
            f"{ms(self.engine_first_audio_ms)}, at the server {ms(self.server_first_audio_ms)}; "
            f"delivery lag {ms(self.delivery_lag_ms)} ({late} over {1000 * LATE_DELIVERY_SECONDS:.0f} ms); "
            f"engine underruns {self.engine_underrun_streams} ({self.engine_underrun_seconds:.2f} s); "
            f"GC pauses {self.gc_pause_ms:.0f} ms; steps run ahead {ahead}"
        )


def server_view(before: dict[str, float], after: dict[str, float]) -> ServerView:
    delta = {key: after[key] - before[key] for key in after}

    def mean_ms(name: str) -> float | None:
        count = delta[f"{name}_count"]
        return round(1000 * delta[f"{name}_sum"] / count, 1) if count > 0 else None

    chunks = delta["delivery_lag_count"]
    return ServerView(
        queue_wait_ms=mean_ms("queue_wait"),
        engine_first_audio_ms=mean_ms("engine_first_audio"),
        server_first_audio_ms=mean_ms("server_first_audio"),
        delivery_lag_ms=mean_ms("delivery_lag"),
        late_delivery_share=round(1 - delta["delivery_on_time"] / chunks, 5) if chunks > 0 else None,
        engine_underrun_streams=round(delta["engine_underrun_streams"]),
        engine_underrun_seconds=round(delta["engine_underrun_seconds"], 3),
        gc_pause_ms=round(1000 * delta["gc_pause_seconds"], 1),
        steps_ahead_share=round(delta["steps_ahead"] / delta["steps"], 4) if delta["steps"] > 0 else None,
    )
