"""`shoal bench serve --arrivals poisson --rate R [R ...]`: open-loop load. Requests arrive at
Poisson times whatever the server's state (a closed loop waits for each answer, so a slow server
is offered less load and looks better than it is), drawn from a seeded mix of lengths
(`max_new_tokens`), stored voices, formats and transports (HTTP `/v1/tts`, WebSocket
`/v1/tts/live`).

Each rate runs for `--duration` seconds of arrivals, then its requests are waited for (at most
`--drain-timeout` s). Per rate: first audio p50/p95/p99 (HTTP: from sending the POST to the first
audio bytes; WebSocket: from the first `text` event, as the server's metric); delivered audio
seconds and frames per second and the mean number of requests in flight, both over the arrival
window less its first `--ramp-seconds` (the empty server filling up); the share of streams
with an underrun and their stall seconds (`serve_playback`); the share of 503 answers and of
all failures. A rate is sustainable when p95 first audio, the underrun share and the failure
share are within `--max-p95-ms`, `--max-underrun-share` and `--max-error-share`;
`--find-sustainable` then doubles or bisects the rate (from the `--rate` results) until the
highest sustainable one is known to within `--precision`, or `--time-budget` runs out.

Stored voices: `--voices N` are created through `POST /model` from synthetic audio (a seeded
buzz with a syllable-like envelope) before the first rate and deleted after the last.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import random
import time
import wave
from collections import Counter
from dataclasses import asdict, dataclass, field

from shoal.bench import serve_playback
from shoal.bench.serve import describe, percentile, text_events, websocket_url
from shoal.bench.server_metrics import ServerView, parse_snapshot, server_view
from shoal.engine.api import DEFAULT_FRAME_RATE
from shoal.engine.remote import DEFAULT_PING_INTERVAL

FORMATS = ("pcm", "wav", "mp3", "opus")
# The engine's counters reach the API processes with its pongs: one ping interval and a margin.
HEARTBEAT_SECONDS = DEFAULT_PING_INTERVAL + 0.1
OPUS_SAMPLE_RATE = 48000  # the only rate both opus and the server's default agree on
VOICE_TEXT = "This is a synthetic reference voice, made up for the load benchmark."
HEADER = (
    "  rate  sent    ok  503%  err%  first audio ms p50/p95/p99  audio s/s  frames/s  in flight"
    "  underrun%  stall s  client cpu%  ok?"
)


@dataclass(frozen=True)
class Workload:
    """What the requests are made of; each request draws from it independently."""

    frames: tuple[int, int]  # max_new_tokens, uniform in [low, high]
    formats: dict[str, float]  # format -> weight
    ws_share: float  # share sent over /v1/tts/live
    voice_share: float  # share that speak with one of the stored voices
    voices: int  # stored voices to create


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    send_at: float  # seconds after the rate's start
    frames: int
    audio_format: str
    transport: str  # "http" or "ws"
    voice: int | None  # index of the stored voice, None: the model's default voice


@dataclass
class Trace:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    request: PlannedRequest
    scheduled: float
    opened: float = 0.0  # the client began (HTTP: the POST; WebSocket: the handshake)
    sent: float | None = None  # first audio counts from here (HTTP: the POST; WS: the first text)
    finished: float | None = None
    arrivals: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)  # kept for mp3 and opus only
    error_kind: str | None = None  # "503", "429", ..., "timeout", "cut off", "other"
    error: str | None = None
    seconds: list[float] = field(default_factory=list)  # playable audio per chunk, after the run

    def record(self, chunk: bytes) -> None:
        self.arrivals.append(time.perf_counter())
        self.sizes.append(len(chunk))
        if self.request.audio_format in ("mp3", "opus"):
            self.payloads.append(chunk)

    def fail(self, kind: str, message: str) -> None:
        if self.error_kind is None:
            self.error_kind, self.error = kind, message


@dataclass
class RateResult:
    rate: float  # offered requests per second
    duration: float
    sent: int
    completed: int
    errors: dict[str, int]
    share_503: float
    error_share: float  # every failure, 503s included
    first_audio_p50_ms: float | None
    first_audio_p95_ms: float | None
    first_audio_p99_ms: float | None
    audio_seconds_per_second: float
    frames_per_second: float
    mean_concurrency: float
    underrun_share: float  # of the completed streams, those with at least one underrun
    stall_seconds: float  # all completed streams together
    audio_seconds_per_request: float
    client_lag_p99_ms: float  # how late the load generator started requests against the schedule
    # The load generator's CPU time over the rate's wall time: near 1 its own event loop is the
    # bottleneck, and late chunks may be its lateness, not the server's.
    client_cpu_share: float
    wall_seconds: float
    sustainable: bool
    by_kind: dict[str, dict] = field(default_factory=dict)  # "http/mp3" -> its own numbers
    error_examples: list[str] = field(default_factory=list)
    server: dict | None = None  # `server_metrics.ServerView` of the run (None: no /metrics)


# ---- the workload ------------------------------------------------------------------------------


def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration) of a Poisson process of `rate` per second."""
    times, now = [], 0.0
    while True:
        now += rng.expovariate(rate)
        if now >= duration:
            return times
        times.append(now)


def plan_requests(workload: Workload, rate: float, duration: float, seed: int) -> list[PlannedRequest]:
    """The seeded schedule for one rate: the same seed and rate give the same requests."""
    rng = random.Random(f"{seed}/{rate:.6g}")
    names, weights = list(workload.formats), list(workload.formats.values())
    planned = []
    for index, send_at in enumerate(poisson_arrivals(rate, duration, rng)):
        frames = rng.randint(*workload.frames)
        audio_format = rng.choices(names, weights)[0]
        transport = "ws" if rng.random() < workload.ws_share else "http"
        with_voice = rng.random() < workload.voice_share
        voice = rng.randrange(workload.voices) if workload.voices and with_voice else None
        planned.append(PlannedRequest(index, send_at, frames, audio_format, transport, voice))
    return planned


def warmup_requests(workload: Workload) -> list[PlannedRequest]:
    """One short request per format and transport in use, and one per stored voice."""
    transports = [t for t, share in (("http", 1 - workload.ws_share), ("ws", workload.ws_share)) if share > 0]
    combos = [(f, t) for f in workload.formats for t in transports]
    voices = list(range(workload.voices)) if workload.voice_share > 0 else []
    planned = []
    for index in range(max(len(combos), len(voices))):
        audio_format, transport = combos[index % len(combos)]
        voice = voices[index] if index < len(voices) else None
        planned.append(PlannedRequest(index, 0.0, workload.frames[0], audio_format, transport, voice))
    return planned


def request_body(planned: PlannedRequest, voice_ids: list[str], args: argparse.Namespace) -> dict:
    body = {
        "text": args.text,
        "format": planned.audio_format,
        "sample_rate": OPUS_SAMPLE_RATE if planned.audio_format == "opus" else args.sample_rate,
        "chunk_length": args.chunk_length,
        "max_new_tokens": planned.frames,
        "latency": args.latency,
    }
    if planned.voice is not None:
        body["reference_id"] = voice_ids[planned.voice]
    elif args.reference_id:
        body["reference_id"] = args.reference_id
    return body


# ---- one request -------------------------------------------------------------------------------


async def http_request(client, trace: Trace, body: bytes, args: argparse.Namespace) -> None:
    headers = {"Content-Type": "application/msgpack", "model": args.model}
    trace.sent = time.perf_counter()
    async with client.stream("POST", "/v1/tts", content=body, headers=headers) as reply:
        if reply.status_code != 200:
            await reply.aread()
            trace.fail(str(reply.status_code), f"HTTP {reply.status_code}: {reply.text[:200]}")
            return
        async for chunk in reply.aiter_raw():
            if chunk:
                trace.record(chunk)


async def websocket_request(trace: Trace, request: dict, args: argparse.Namespace) -> None:
    import ormsgpack
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Bearer {args.api_key}", "model": args.model}
    events = [ormsgpack.packb({"event": "text", "text": text}) for text in text_events(request["text"])]
    start = ormsgpack.packb({"event": "start", "request": request | {"text": ""}})
    async with connect(
        websocket_url(args.url), additional_headers=headers, max_size=None, open_timeout=args.timeout
    ) as socket:
        await socket.send(start)
        trace.sent = time.perf_counter()
        for event in events:
            await socket.send(event)
        await socket.send(ormsgpack.packb({"event": "stop"}))
        while True:
            event = ormsgpack.unpackb(await socket.recv())
            if event.get("event") == "audio" and event.get("audio"):
                trace.record(event["audio"])
            elif event.get("event") == "finish":
                if event.get("reason") != "stop":
                    message = str(event.get("message", ""))
                    kind = "503" if message.startswith("server is at capacity") else "other"
                    trace.fail(kind, f"finish/{event.get('reason')}: {message}"[:300])
                return


def error_kind(error: BaseException) -> str:
    """A refused WebSocket handshake carries its HTTP status; anything else is "other"."""
    status = getattr(getattr(error, "response", None), "status_code", None)
    if status is not None:
        return str(status)
    return "timeout" if isinstance(error, TimeoutError) else "other"


async def run_request(client, trace: Trace, voice_ids: list[str], args: argparse.Namespace) -> None:
    """Never raises: a failure is recorded in the trace (a benchmark counts failures)."""
    import ormsgpack

    body = request_body(trace.request, voice_ids, args)
    trace.opened = time.perf_counter()
    try:
        async with asyncio.timeout(args.timeout):
            if trace.request.transport == "ws":
                await websocket_request(trace, body, args)
            else:
                await http_request(client, trace, ormsgpack.packb(body), args)
    except asyncio.CancelledError:
        trace.fail("cut off", f"still running {args.drain_timeout:g} s after the last arrival")
        raise
    except Exception as error:  # noqa: BLE001 (counted, not raised)
        trace.fail(error_kind(error), describe(error))
    finally:
        trace.finished = time.perf_counter()


# ---- one rate ----------------------------------------------------------------------------------


def http_client(args: argparse.Namespace):
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    return httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout, limits=limits)


async def run_schedule(
    client, planned: list[PlannedRequest], voice_ids: list[str], args: argparse.Namespace
) -> tuple[float, list[Trace]]:
    """Start each request at its time, whatever the others are doing; wait for them (at most
    --drain-timeout s after the last arrival). Returns (the schedule's start, the traces)."""
    start = time.perf_counter()
    traces, tasks = [], []
    for request in planned:
        delay = start + request.send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        trace = Trace(request, scheduled=start + request.send_at)
        traces.append(trace)
        tasks.append(asyncio.create_task(run_request(client, trace, voice_ids, args)))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=args.drain_timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return start, traces


def measure_audio(traces: list[Trace], args: argparse.Namespace) -> None:
    """Each chunk's playable seconds (decoding mp3 here, after the run, off the timing path)."""
    for trace in traces:
        audio_format = trace.request.audio_format
        rate = OPUS_SAMPLE_RATE if audio_format == "opus" else args.sample_rate
        try:
            if audio_format in ("pcm", "wav"):  # the sizes are enough; the bytes were not kept
                header = serve_playback.WAV_HEADER_BYTES if audio_format == "wav" else 0
                trace.seconds = serve_playback.pcm_chunk_seconds(trace.sizes, rate, header)
            else:
                trace.seconds = serve_playback.chunk_seconds(audio_format, trace.payloads, rate)
        except Exception as error:  # noqa: BLE001 (an undecodable stream is a failed request)
            trace.seconds = [0.0] * len(trace.arrivals)
            trace.fail("other", f"undecodable {audio_format}: {describe(error)}")
        trace.payloads = []


def overlap(begin: float, end: float, window: tuple[float, float]) -> float:
    return max(0.0, min(end, window[1]) - max(begin, window[0]))


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def stream_numbers(traces: list[Trace]) -> dict:
    """Counts, first audio and underruns of a group of traces (all of a rate, or one kind)."""
    ok = [t for t in traces if t.error_kind is None]
    waits = [t.arrivals[0] - t.sent for t in ok if t.arrivals and t.sent is not None]
    plays = [serve_playback.playback(t.arrivals, t.seconds) for t in ok]
    return {
        "requests": len(traces),
        "completed": len(ok),
        "errors": len(traces) - len(ok),
        "first_audio_p50_ms": ms(percentile(waits, 0.5)),
        "first_audio_p95_ms": ms(percentile(waits, 0.95)),
        "first_audio_p99_ms": ms(percentile(waits, 0.99)),
        "underrun_share": round(sum(p.underruns > 0 for p in plays) / len(plays), 4) if plays else 0.0,
        "stall_seconds": round(sum(p.stall_seconds for p in plays), 3),
        "audio_seconds": sum(p.audio_seconds for p in plays),
    }


def sustainable(result: RateResult, args: argparse.Namespace) -> bool:
    return (
        result.completed > 0
        and result.first_audio_p95_ms is not None
        and result.first_audio_p95_ms <= args.max_p95_ms
        and result.underrun_share <= args.max_underrun_share
        and result.error_share <= args.max_error_share
    )


def summarize(
    rate: float, start: float, traces: list[Trace], wall: float, args, cpu_seconds: float = 0.0
) -> RateResult:
    numbers = stream_numbers(traces)
    ramp = min(args.ramp_seconds, args.duration / 2)
    window = (start + ramp, start + args.duration)
    span = window[1] - window[0]
    delivered = sum(
        seconds
        for trace in traces
        for arrival, seconds in zip(trace.arrivals, trace.seconds, strict=True)
        if window[0] <= arrival < window[1]
    )
    in_flight = sum(overlap(t.opened, t.finished or t.opened, window) for t in traces)
    kinds = Counter(t.error_kind for t in traces if t.error_kind)
    sent = len(traces)
    lags = [max(0.0, t.opened - t.scheduled) for t in traces]
    groups: dict[str, list[Trace]] = {}
    for trace in traces:
        groups.setdefault(f"{trace.request.transport}/{trace.request.audio_format}", []).append(trace)
        if trace.request.voice is not None:
            groups.setdefault("stored voice", []).append(trace)
    by_kind = {}
    for name, group in sorted(groups.items()):
        by_kind[name] = {k: v for k, v in stream_numbers(group).items() if k != "audio_seconds"}
    result = RateResult(
        rate=rate,
        duration=args.duration,
        sent=sent,
        completed=numbers["completed"],
        errors=dict(sorted(kinds.items())),
        share_503=round(kinds["503"] / sent, 4) if sent else 0.0,
        error_share=round(numbers["errors"] / sent, 4) if sent else 0.0,
        first_audio_p50_ms=numbers["first_audio_p50_ms"],
        first_audio_p95_ms=numbers["first_audio_p95_ms"],
        first_audio_p99_ms=numbers["first_audio_p99_ms"],
        audio_seconds_per_second=round(delivered / span, 3),
        frames_per_second=round(delivered * args.frame_rate / span, 1),
        mean_concurrency=round(in_flight / span, 2),
        underrun_share=numbers["underrun_share"],
        stall_seconds=numbers["stall_seconds"],
        audio_seconds_per_request=round(numbers["audio_seconds"] / max(1, numbers["completed"]), 3),
        client_lag_p99_ms=ms(percentile(lags, 0.99)) or 0.0,
        client_cpu_share=round(cpu_seconds / wall, 3) if wall > 0 else 0.0,
        wall_seconds=round(wall, 2),
        sustainable=False,
        by_kind=by_kind,
        error_examples=sorted({t.error for t in traces if t.error})[:3],
    )
    result.sustainable = sustainable(result, args)
    return result


def write_traces(path: str | None, rate: float, start: float, traces: list[Trace]) -> None:
    """One JSON line per request, times in seconds from the rate's start (for later analysis)."""
    if not path:
        return
    with open(path, "a") as output:
        for trace in traces:

            def since(moment: float | None) -> float | None:
                return None if moment is None else round(moment - start, 6)

            line = {
                "rate": rate,
                **asdict(trace.request),
                "scheduled": since(trace.scheduled),
                "opened": since(trace.opened),
                "sent": since(trace.sent),
                "finished": since(trace.finished),
                "error": trace.error,
                "chunks": [
                    [since(a), round(s, 6)] for a, s in zip(trace.arrivals, trace.seconds, strict=True)
                ],
            }
            output.write(json.dumps(line) + "\n")


async def wait_until_idle(client, limit: float = 15.0) -> None:
    """Between rates: until the server runs and queues nothing (so rates do not overlap)."""
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline:
        try:
            health = (await client.get("/v1/health")).json()
            if health["running"] == 0 and not any(health["waiting"].values()):
                return
        except Exception:  # noqa: BLE001 (a server that does not report its load: just wait a bit)
            await asyncio.sleep(1.0)
            return
        await asyncio.sleep(0.1)


async def metrics_snapshot(client) -> dict[str, float] | None:
    """The server's counters now (`server_metrics`); None when it has no readable /metrics."""
    try:
        reply = await client.get("/metrics")
        return parse_snapshot(reply.text) if reply.status_code == 200 else None
    except Exception:  # noqa: BLE001 (a server without metrics: the client's numbers still stand)
        return None


async def run_rate(client, rate: float, workload: Workload, voice_ids: list[str], args) -> RateResult:
    planned = plan_requests(workload, rate, args.duration, args.seed)
    before = await metrics_snapshot(client)
    began, cpu_began = time.perf_counter(), time.process_time()
    start, traces = await run_schedule(client, planned, voice_ids, args)
    wall, cpu_seconds = time.perf_counter() - began, time.process_time() - cpu_began
    measure_audio(traces, args)
    write_traces(args.traces_path, rate, start, traces)
    result = summarize(rate, start, traces, wall, args, cpu_seconds)
    await wait_until_idle(client)  # so rates do not overlap; every stream's counters are booked
    if before is not None:
        await asyncio.sleep(HEARTBEAT_SECONDS)  # ... and sent to the API processes
        after = await metrics_snapshot(client)
        if after is not None:
            result.server = asdict(server_view(before, after))
    return result


# ---- the sustainable rate ----------------------------------------------------------------------


def highest_sustainable(results: list[RateResult]) -> RateResult | None:
    passing = [r for r in results if r.sustainable]
    return max(passing, key=lambda r: r.rate) if passing else None


def next_rate(
    results: list[RateResult], growth: float, precision: float, floor: float = 0.01
) -> float | None:
    """The next rate to try: past the highest sustainable one by `growth` until one fails, below
    the lowest by `growth` until one passes, then the geometric middle of the highest passing
    and the lowest failing above it, until they are within `precision` of each other. None when
    done, or when the next rate down would be below `floor` (too few arrivals to judge)."""
    best = highest_sustainable(results)
    failing = [r.rate for r in results if not r.sustainable and (best is None or r.rate > best.rate)]
    if best is None:
        lowest = min(failing) / growth
        return lowest if lowest >= floor else None
    if not failing:
        return best.rate * growth
    high = min(failing)
    if high / best.rate <= 1 + precision:
        return None
    return round(math.sqrt(best.rate * high), 3)


# ---- stored voices -----------------------------------------------------------------------------


def synthetic_voice_samples(index: int, seconds: float, sample_rate: int = 16000):
    """Mono float32 audio: a buzz with a few harmonics, its pitch drifting, under a 4 Hz
    syllable-like envelope, plus a little noise (any non-silent audio makes a stored voice);
    each index sounds different, so voices do not share prompt prefixes."""
    import numpy as np

    rng = np.random.default_rng(index)
    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pitch = 110 + (40 * index) % 120 + 15 * np.sin(2 * np.pi * 0.3 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    buzz = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t + rng.uniform(0, 6))
    signal = buzz * envelope + 0.1 * rng.standard_normal(t.size)
    return (0.6 * signal / np.max(np.abs(signal))).astype(np.float32)


def synthetic_voice(index: int, seconds: float, sample_rate: int = 16000) -> bytes:
    """`synthetic_voice_samples` as a 16-bit wav file, for `POST /model`."""
    samples = synthetic_voice_samples(index, seconds, sample_rate)
    output = io.BytesIO()
    with wave.open(output, "wb") as writer:
        writer.setnchannels(1)
        writer.setsampwidth(2)
        writer.setframerate(sample_rate)
        writer.writeframes((samples * 32767).astype("<i2").tobytes())
    return output.getvalue()


async def create_voices(client, count: int, seconds: float) -> list[str]:
    """`count` stored voices through `POST /model`; returns their ids."""
    ids = []
    for index in range(count):
        files = [("voices", (f"bench-{index}.wav", synthetic_voice(index, seconds), "audio/wav"))]
        data = {"title": f"shoal bench voice {index}", "texts": VOICE_TEXT, "visibility": "private"}
        reply = await client.post("/model", files=files, data=data)
        if reply.status_code != 201:
            raise RuntimeError(f"creating a stored voice: HTTP {reply.status_code} {reply.text[:300]}")
        ids.append(reply.json()["_id"])
    return ids


async def delete_voices(client, ids: list[str]) -> None:
    for voice_id in ids:
        try:
            await client.delete(f"/model/{voice_id}")
        except Exception as error:  # noqa: BLE001 (the results matter more than the clean-up)
            print(f"could not delete stored voice {voice_id}: {describe(error)}", flush=True)


# ---- the sweep ---------------------------------------------------------------------------------


def format_row(result: RateResult) -> str:
    def number(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    waits = "/".join(
        number(v) for v in (result.first_audio_p50_ms, result.first_audio_p95_ms, result.first_audio_p99_ms)
    )
    return (
        f"{result.rate:6.2f} {result.sent:>5} {result.completed:>5} {100 * result.share_503:>5.1f} "
        f"{100 * result.error_share:>5.1f}  {waits:>26} {result.audio_seconds_per_second:>10.2f} "
        f"{result.frames_per_second:>9.0f} {result.mean_concurrency:>10.1f} "
        f"{100 * result.underrun_share:>10.1f} {result.stall_seconds:>8.2f} "
        f"{100 * result.client_cpu_share:>12.0f}  {'yes' if result.sustainable else 'no'}"
    )


def print_server_view(result: RateResult) -> None:
    if result.server is not None:
        print(f"        {ServerView(**result.server).line()}", flush=True)


def criteria(args: argparse.Namespace) -> str:
    return (
        f"p95 first audio <= {args.max_p95_ms:g} ms, underruns <= {100 * args.max_underrun_share:g}%, "
        f"failures <= {100 * args.max_error_share:g}%"
    )


def report(
    results: list[RateResult],
    workload: Workload,
    args: argparse.Namespace,
    overload: RateResult | None = None,
) -> dict:
    best = highest_sustainable(results)
    return {
        "settings": {
            key: getattr(args, key)
            for key in (
                "url",
                "text",
                "duration",
                "seed",
                "chunk_length",
                "sample_rate",
                "frame_rate",
                "ramp_seconds",
                "drain_timeout",
                "max_p95_ms",
                "max_underrun_share",
                "max_error_share",
            )
        },  # fmt: skip
        "workload": asdict(workload),
        "rates": [asdict(result) for result in results],
        "sustainable": None
        if best is None
        else {
            "rate": best.rate,
            "frames_per_second": best.frames_per_second,
            "audio_seconds_per_second": best.audio_seconds_per_second,
            "first_audio_p95_ms": best.first_audio_p95_ms,
            "mean_concurrency": best.mean_concurrency,
        },
        "criteria": criteria(args),
        # --overload: one run at that multiple of the sustainable rate (what admission protects)
        "overload": None
        if overload is None
        else {"factor": overload_factor(results, overload.rate), **asdict(overload)},
    }


def overload_factor(results: list[RateResult], rate: float) -> float | None:
    """An overload rate over the sustainable one (None: nothing was sustainable)."""
    best = highest_sustainable(results)
    return round(rate / best.rate, 4) if best else None


def overload_label(factor: float | None) -> str:
    return "with no sustainable rate found" if factor is None else f"{factor:g}x the sustainable rate"


def write_json(path: str | None, payload: dict) -> None:
    if path:
        with open(path, "w") as output:
            json.dump(payload, output, indent=2)


async def sweep(args: argparse.Namespace) -> list[RateResult]:
    workload = workload_from(args)
    started = time.perf_counter()
    results: list[RateResult] = []
    if args.traces_path:
        open(args.traces_path, "w").close()
    async with http_client(args) as client:
        voice_ids = (
            await create_voices(client, workload.voices, args.voice_seconds) if workload.voices else []
        )
        try:
            if args.warmup > 0:
                for _ in range(args.warmup):
                    warm = warmup_requests(workload)
                    _, traces = await run_schedule(client, warm, voice_ids, args)
                    failed = [t.error for t in traces if t.error]
                    note = f", {len(failed)} failed: {failed[0]}" if failed else ""
                    print(f"warm-up: {len(traces)} request(s){note}", flush=True)
                await wait_until_idle(client)
            print(HEADER, flush=True)
            rates = list(args.rate)
            probe_wall = args.duration + 5.0  # a rate's expected wall time, updated as they run
            while rates:
                rate = rates.pop(0)
                left = args.time_budget - (time.perf_counter() - started) if args.time_budget else math.inf
                if args.overload and results:  # the overload run's time is kept for it
                    left -= probe_wall
                if left < probe_wall:
                    print(f"{rate:6.2f}  skipped: {left:.0f} s left of --time-budget", flush=True)
                    break
                result = await run_rate(client, rate, workload, voice_ids, args)
                probe_wall = max(probe_wall, result.wall_seconds + 2.0)
                results.append(result)
                print(format_row(result), flush=True)
                print_server_view(result)
                for example in result.error_examples:
                    print(f"        error: {example}", flush=True)
                write_json(args.json_path, report(results, workload, args))
                if not rates and args.find_sustainable:
                    following = next_rate(results, args.growth, args.precision, floor=2 / args.duration)
                    if following is not None and all(abs(r.rate - following) > 1e-9 for r in results):
                        rates.append(following)
            overload = await run_overload(client, results, workload, voice_ids, args, started)
            if overload is not None:
                write_json(args.json_path, report(results, workload, args, overload))
        finally:
            await delete_voices(client, voice_ids)
    best = highest_sustainable(results)
    if best is None:
        print(f"sustainable: none of the rates tried ({criteria(args)})", flush=True)
    else:
        print(
            f"sustainable: {best.rate:g} requests/s = {best.frames_per_second:.0f} frames/s, "
            f"{best.audio_seconds_per_second:.1f} audio-s/s ({criteria(args)})",
            flush=True,
        )
    return results


async def run_overload(
    client, results: list[RateResult], workload: Workload, voice_ids: list[str], args, started: float
) -> RateResult | None:
    """With --overload F: offer F times the sustainable rate once (--overload-rate R: R requests/s,
    whatever the rates before found). Past capacity the admitted streams should still play
    without gaps while the excess gets 503 (realtime admission); it is reported apart and never
    counts as a sustainable rate."""
    best = highest_sustainable(results)
    fixed = getattr(args, "overload_rate", None)
    if fixed is None and (not args.overload or best is None):
        return None
    rate = fixed if fixed is not None else best.rate * args.overload
    left = args.time_budget - (time.perf_counter() - started) if args.time_budget else math.inf
    if left < args.duration + 5.0:
        print(f"overload at {rate:.2f}/s skipped: {left:.0f} s left of --time-budget", flush=True)
        return None
    result = await run_rate(client, rate, workload, voice_ids, args)
    print(f"{format_row(result)}  <- overload, {overload_label(overload_factor(results, rate))}", flush=True)
    print_server_view(result)
    return result


# ---- the command line --------------------------------------------------------------------------


def frame_range(text: str) -> tuple[int, int]:
    """`64-384` -> (64, 384); `256` -> (256, 256)."""
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW-HIGH, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def format_weights(text: str) -> dict[str, float]:
    """`pcm:2,mp3,opus` -> {"pcm": 2.0, "mp3": 1.0, "opus": 1.0}."""
    weights = {}
    for item in text.split(","):
        name, _, weight = item.strip().partition(":")
        if name not in FORMATS:
            raise argparse.ArgumentTypeError(f"unknown format {name!r}; choose from {', '.join(FORMATS)}")
        try:
            weights[name] = float(weight or 1)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad weight in {item!r}") from None
    if not weights or any(w < 0 for w in weights.values()) or sum(weights.values()) <= 0:
        raise argparse.ArgumentTypeError(f"expected non-negative weights, some positive: {text!r}")
    return {name: weight for name, weight in weights.items() if weight > 0}


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return value


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def workload_from(args: argparse.Namespace) -> Workload:
    voices = args.voices if args.voice_share > 0 else 0
    return Workload(args.frames, args.formats, args.ws_share, args.voice_share, voices)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("open loop (--arrivals poisson)")
    group.add_argument("--rate", type=positive, nargs="+", default=[1.0], help="requests per second")
    group.add_argument("--duration", type=positive, default=20.0, help="seconds of arrivals per rate")
    group.add_argument("--frames", type=frame_range, default=(64, 384), help="max_new_tokens: N or LOW-HIGH")
    group.add_argument(
        "--formats", type=format_weights, default=format_weights("pcm,wav,mp3,opus"), help="e.g. pcm:2,mp3:1"
    )
    group.add_argument("--ws-share", type=share, default=0.25, help="share over /v1/tts/live")
    group.add_argument("--voice-share", type=share, default=0.5, help="share with a stored voice")
    group.add_argument("--voices", type=int, default=2, help="stored voices to create (and delete after)")
    group.add_argument("--voice-seconds", type=positive, default=5.0, help="length of each voice's audio")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument(
        "--frame-rate", type=positive, default=DEFAULT_FRAME_RATE, help="frames per audio second"
    )
    group.add_argument(
        "--ramp-seconds", type=float, default=2.0, help="left out of the delivered rate and in-flight mean"
    )
    group.add_argument(
        "--drain-timeout", type=positive, default=30.0, help="seconds after the last arrival to wait"
    )
    group.add_argument(
        "--find-sustainable", action="store_true", help="search for the highest sustainable rate"
    )
    group.add_argument("--max-p95-ms", type=positive, default=200.0)
    group.add_argument("--max-underrun-share", type=share, default=0.01)
    group.add_argument("--max-error-share", type=share, default=0.01)
    group.add_argument("--growth", type=positive, default=2.0, help="rate factor until the search brackets")
    group.add_argument("--precision", type=positive, default=0.1, help="stop when high / low <= 1 + this")
    group.add_argument(
        "--overload",
        type=positive,
        help="after --find-sustainable: offer this multiple of the sustainable rate once (e.g. 1.5)",
    )
    group.add_argument(
        "--overload-rate",
        type=positive,
        help="the overload run at this rate (requests/s) instead, even when no rate was sustainable",
    )
    group.add_argument("--traces", dest="traces_path", help="write every request's chunks (JSON lines)")


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(sweep(args))
    sent = sum(r.sent for r in results)
    failed = sum(r.sent - r.completed for r in results)
    print(f"{sent} requests, {failed} failed")
    return 1 if not results or failed == sent else 0
