"""`shoal bench serve`: HTTP and WebSocket load against a running Shoal (or any Fish-compatible)
server, in one of two modes.

`--arrivals closed` (the default): for each concurrency level it keeps that many requests in
flight and reports time to first audio byte (p50/p95), audio seconds delivered per wall second,
and errors. `--arrivals poisson --rate R [R ...]`: open-loop load from a mix of lengths, stored
voices, formats and transports, with underruns and the highest sustainable rate
(`shoal.bench.open_loop`, which documents it).

Time to first audio (TTFA): HTTP, from sending `POST /v1/tts` to the first audio bytes of the
reply; WebSocket (`/v1/tts/live`), from sending the first `text` event to the first `audio`
event (the server's `shoal_time_to_first_audio_seconds{route="live"}` starts at the same event).
Closed loop requests pcm so its duration is exact: bytes / 2 / sample_rate. Each level runs
max(--requests-per-level, --rounds x concurrency) requests; `--warmup` requests per mode run
first and are not counted (the first requests compile kernels and fill caches).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit, urlunsplit

from shoal.engine.api import LATENCY_MODES
from shoal.tuning import environment

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog. Shoal streams speech while it is generated."
HEADER = (
    "mode  conc. requests errors  TTFA p50  TTFA p95  audio s/s  audio s/req   wall s\n"
    "                                    (ms)      (ms)"
)


@dataclass
class Sample:
    ttfa: float | None  # seconds; None when no audio arrived
    seconds: float  # request wall time
    audio_seconds: float
    error: str | None = None
    reused: bool = False  # a WebSocket session after the first on its socket (`--ws-sessions`)


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    errors: int
    ttfa_p50_ms: float | None
    ttfa_p95_ms: float | None
    audio_seconds_per_second: float
    audio_seconds_per_request: float  # mean over the requests without error
    wall_seconds: float
    error_examples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


def tts_body(args: argparse.Namespace) -> dict:
    body = {
        "text": args.text,
        "format": "pcm",
        "sample_rate": args.sample_rate,
        "chunk_length": args.chunk_length,
        "max_new_tokens": args.max_new_tokens,
        "latency": args.latency,
    }
    if args.reference_id:
        body["reference_id"] = args.reference_id
    return body


def pcm_seconds(received: int, args: argparse.Namespace) -> float:
    return received / 2 / args.sample_rate


async def one_http(client, args: argparse.Namespace) -> Sample:
    import ormsgpack

    headers = {"Content-Type": "application/msgpack", "model": args.model}
    started = time.perf_counter()
    ttfa, received = None, 0
    try:
        async with client.stream(
            "POST", "/v1/tts", content=ormsgpack.packb(tts_body(args)), headers=headers
        ) as reply:
            if reply.status_code != 200:
                await reply.aread()
                message = f"HTTP {reply.status_code}: {reply.text[:200]}"
                return Sample(None, time.perf_counter() - started, 0.0, message)
            async for chunk in reply.aiter_raw():
                if chunk and ttfa is None:
                    ttfa = time.perf_counter() - started
                received += len(chunk)
    except Exception as error:  # a benchmark reports failures, it does not stop on them
        return Sample(ttfa, time.perf_counter() - started, pcm_seconds(received, args), describe(error))
    return Sample(ttfa, time.perf_counter() - started, pcm_seconds(received, args))


def websocket_url(base_url: str) -> str:
    parts = urlsplit(base_url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/v1/tts/live", "", ""))


def text_events(text: str) -> list[str]:
    """The text as a client streams it: word by word (each with its trailing space)."""
    words = text.split(" ")
    return [word + " " for word in words[:-1]] + [words[-1]]


async def one_websocket(args: argparse.Namespace) -> list[Sample]:
    """`--ws-sessions` sessions in turn on one socket (as LiveKit's Fish plugin reuses one per
    turn): the first prefills the voice, the later ones find it prefilled. TTFA starts at each
    session's first `text` event."""
    import ormsgpack
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Bearer {args.api_key}", "model": args.model}
    request = tts_body(args) | {"text": ""}
    samples: list[Sample] = []
    started = time.perf_counter()
    ttfa, received, first_text_at = None, 0, None
    try:
        async with connect(
            websocket_url(args.url), additional_headers=headers, max_size=None, open_timeout=args.timeout
        ) as socket:
            for session in range(args.ws_sessions):
                started = time.perf_counter()
                ttfa, received, first_text_at = None, 0, None
                await socket.send(ormsgpack.packb({"event": "start", "request": request}))
                for text in text_events(args.text):
                    if first_text_at is None:
                        first_text_at = time.perf_counter()
                    await socket.send(ormsgpack.packb({"event": "text", "text": text}))
                await socket.send(ormsgpack.packb({"event": "stop"}))
                while True:
                    event = ormsgpack.unpackb(await socket.recv())
                    kind = event.get("event")
                    if kind == "audio":
                        if ttfa is None and event.get("audio"):
                            ttfa = time.perf_counter() - first_text_at
                        received += len(event.get("audio") or b"")
                    elif kind == "finish":
                        if event.get("reason") != "stop":
                            raise RuntimeError(f"finish/{event.get('reason')}: {event.get('message', '')}")
                        break
                seconds = time.perf_counter() - started
                samples.append(Sample(ttfa, seconds, pcm_seconds(received, args), reused=session > 0))
    except Exception as error:
        seconds = time.perf_counter() - started
        failed = Sample(ttfa, seconds, pcm_seconds(received, args), describe(error), reused=bool(samples))
        samples.append(failed)
    return samples


def describe(error: BaseException) -> str:
    """A short, groupable description (refused WebSocket handshakes carry the HTTP status)."""
    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if status is not None:
        body = getattr(response, "body", b"") or b""
        return f"{type(error).__name__}: HTTP {status} {body[:200].decode('utf-8', 'replace')}".strip()
    return f"{type(error).__name__}: {error}"[:300]


def summarize(mode: str, concurrency: int, samples: list[Sample], wall: float) -> LevelResult:
    ttfas = [s.ttfa for s in samples if s.ttfa is not None and s.error is None]
    errors = [s.error for s in samples if s.error]
    complete = [s.audio_seconds for s in samples if s.error is None]
    p50, p95 = percentile(ttfas, 0.5), percentile(ttfas, 0.95)
    return LevelResult(
        mode=mode,
        concurrency=concurrency,
        requests=len(samples),
        errors=len(errors),
        ttfa_p50_ms=None if p50 is None else round(p50 * 1000, 1),
        ttfa_p95_ms=None if p95 is None else round(p95 * 1000, 1),
        audio_seconds_per_second=round(sum(s.audio_seconds for s in samples) / wall, 3) if wall > 0 else 0.0,
        audio_seconds_per_request=round(sum(complete) / len(complete), 3) if complete else 0.0,
        wall_seconds=round(wall, 2),
        error_examples=sorted(set(errors))[:3],
    )


async def run_requests(mode: str, concurrency: int, total: int, args: argparse.Namespace):
    """`total` requests, `concurrency` in flight; returns (samples, wall seconds)."""
    import httpx

    pending = iter(range(total))
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:

        async def worker() -> None:
            for _ in pending:
                if mode == "http":
                    samples.append(await one_http(client, args))
                else:
                    samples.extend(await one_websocket(args))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return samples, wall


async def run_level(mode: str, concurrency: int, args: argparse.Namespace) -> list[LevelResult]:
    """One level's row; with `--ws-sessions` above 1 a second WebSocket row, `ws+`, for the
    sessions that reused their socket and its prefilled voice."""
    total = max(args.requests_per_level, args.rounds * concurrency, concurrency)
    samples, wall = await run_requests(mode, concurrency, total, args)
    first = [s for s in samples if not s.reused]
    rows = [summarize(mode, concurrency, first, wall)]
    if len(first) < len(samples):
        rows.append(summarize(f"{mode}+", concurrency, [s for s in samples if s.reused], wall))
    return rows


def format_row(result: LevelResult) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    return (
        f"{result.mode:5} {result.concurrency:>5} {result.requests:>8} {result.errors:>6} "
        f"{ms(result.ttfa_p50_ms):>9} {ms(result.ttfa_p95_ms):>9} {result.audio_seconds_per_second:>10.2f} "
        f"{result.audio_seconds_per_request:>12.2f} {result.wall_seconds:>8.1f}"
    )


def levels(args: argparse.Namespace) -> list[tuple[str, int]]:
    modes = ["http", "ws"] if args.mode == "both" else [args.mode]
    plan = []
    for mode in modes:
        sweep = args.ws_concurrency if mode == "ws" and args.ws_concurrency else args.concurrency
        plan += [(mode, concurrency) for concurrency in sweep]
    return plan


def write_json(path: str | None, results: list[LevelResult], args: argparse.Namespace) -> None:
    if not path:
        return
    settings = {
        key: getattr(args, key)
        for key in ("url", "text", "max_new_tokens", "chunk_length", "sample_rate", "rounds", "warmup")
    }
    payload = {"settings": settings, "levels": [asdict(result) for result in results]}
    with open(path, "w") as output:
        json.dump(payload, output, indent=2)


async def sweep(args: argparse.Namespace) -> list[LevelResult]:
    started = time.perf_counter()
    plan = levels(args)
    results: list[LevelResult] = []
    warmed: set[str] = set()
    print(HEADER, flush=True)
    for mode, concurrency in plan:
        if args.time_budget and time.perf_counter() - started > args.time_budget:
            print(
                f"{mode:5} {concurrency:>5}  skipped: past --time-budget {args.time_budget:.0f} s", flush=True
            )
            continue
        if mode not in warmed and args.warmup > 0:
            warmed.add(mode)
            samples, wall = await run_requests(mode, 1, args.warmup, args)
            failed = [s.error for s in samples if s.error]
            note = f", {len(failed)} failed: {failed[0]}" if failed else ""
            print(f"{mode:5} warm-up: {args.warmup} request(s) in {wall:.1f} s{note}", flush=True)
        for result in await run_level(mode, concurrency, args):
            results.append(result)
            print(format_row(result), flush=True)
            for example in result.error_examples:
                print(f"      error: {example}", flush=True)
        write_json(args.json_path, results, args)  # after every level: a cut-off run keeps its rows
    return results


def concurrency_list(text: str) -> list[int]:
    values = [int(v) for v in text.replace(" ", ",").split(",") if v.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=environment("URL", "http://127.0.0.1:8080"), help="server base URL")
    parser.add_argument(
        "--api-key",
        default=environment("API_KEY") or os.environ.get("FISH_API_KEY") or "local",
        help="bearer key (environment API_KEY, or FISH_API_KEY)",
    )
    parser.add_argument(
        "--arrivals",
        choices=("closed", "poisson"),
        default="closed",
        help="closed: fixed concurrency levels; poisson: open-loop arrivals at --rate (see below)",
    )
    parser.add_argument("--mode", choices=("http", "ws", "both"), default="both", help="closed loop")
    parser.add_argument(
        "--concurrency",
        type=concurrency_list,
        default=[1, 2, 4, 8],
        help="closed loop: comma-separated levels (default 1,2,4,8)",
    )
    parser.add_argument(
        "--ws-concurrency",
        type=concurrency_list,
        default=None,
        help="levels for the WebSocket sweep (default: --concurrency)",
    )
    parser.add_argument("--requests-per-level", type=int, default=16, help="at least this many per level")
    parser.add_argument("--rounds", type=int, default=1, help="and at least rounds x concurrency per level")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="uncounted requests per mode before its sweep (poisson: rounds of one short request per "
        "format, transport and stored voice)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=0.0,
        help="seconds; later levels (rates) are skipped once past it",
    )
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--reference-id", help="a stored voice to speak with")
    parser.add_argument("--model", default="s2-pro", help="the `model` header")
    parser.add_argument("--sample-rate", type=int, default=44100, help="poisson: opus asks for 48000")
    parser.add_argument("--chunk-length", type=int, default=200)
    parser.add_argument(
        "--ws-sessions",
        type=int,
        default=1,
        help="closed loop: sessions in turn on each WebSocket; above 1 the reused ones get a row "
        "of their own (ws+: the voice already prefilled)",
    )
    parser.add_argument(
        "--latency",
        choices=LATENCY_MODES,
        default="balanced",
        help="the requests' latency mode (default: the official SDK's)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=1024, help="closed loop (poisson: --frames)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--json", dest="json_path", help="also write the results to this JSON file")
    from shoal.bench import open_loop

    open_loop.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.arrivals == "poisson":
        from shoal.bench import open_loop

        return open_loop.run(args)
    results = asyncio.run(sweep(args))
    requests = sum(r.requests for r in results)
    errors = sum(r.errors for r in results)
    print(f"{requests} requests, {errors} errors")
    return 1 if not results or errors == requests else 0
