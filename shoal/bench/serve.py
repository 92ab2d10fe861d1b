"""`shoal bench serve`: HTTP and WebSocket load against a running Shoal (or any Fish-compatible)
server. For each concurrency level it keeps that many requests in flight and reports time to
first audio byte (p50/p95), audio seconds delivered per wall second, and errors.

TTFA is measured from sending the request (HTTP) or the first `text` event (WebSocket) to the
first audio bytes. Audio is requested as pcm so its duration is exact: bytes / 2 / sample_rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit, urlunsplit

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog. Shoal streams speech while it is generated."


@dataclass
class Sample:
    ttfa: float | None  # seconds; None when no audio arrived
    seconds: float  # request wall time
    audio_seconds: float
    error: str | None = None


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    errors: int
    ttfa_p50_ms: float | None
    ttfa_p95_ms: float | None
    audio_seconds_per_second: float
    wall_seconds: float
    error_examples: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float | None:
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
    }
    body["max_new_tokens"] = args.max_new_tokens
    if args.reference_id:
        body["reference_id"] = args.reference_id
    return body


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
                return Sample(
                    None, time.perf_counter() - started, 0.0, f"HTTP {reply.status_code}: {reply.text[:200]}"
                )
            async for chunk in reply.aiter_raw():
                if chunk and ttfa is None:
                    ttfa = time.perf_counter() - started
                received += len(chunk)
    except Exception as error:  # a benchmark reports failures, it does not stop on them
        return Sample(ttfa, time.perf_counter() - started, received / 2 / args.sample_rate, repr(error))
    return Sample(ttfa, time.perf_counter() - started, received / 2 / args.sample_rate)


def websocket_url(base_url: str) -> str:
    parts = urlsplit(base_url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/v1/tts/live", "", ""))


async def one_websocket(args: argparse.Namespace) -> Sample:
    import ormsgpack
    from websockets.asyncio.client import connect

    headers = {"Authorization": f"Bearer {args.api_key}", "model": args.model}
    request = tts_body(args) | {"text": ""}
    started = time.perf_counter()
    ttfa, received, first_text_at = None, 0, None
    try:
        async with connect(websocket_url(args.url), additional_headers=headers, max_size=None) as socket:
            await socket.send(ormsgpack.packb({"event": "start", "request": request}))
            first_text_at = time.perf_counter()
            for word in args.text.split(" "):
                await socket.send(ormsgpack.packb({"event": "text", "text": word + " "}))
            await socket.send(ormsgpack.packb({"event": "stop"}))
            while True:
                event = ormsgpack.unpackb(await socket.recv())
                if event.get("event") == "audio":
                    if ttfa is None:
                        ttfa = time.perf_counter() - first_text_at
                    received += len(event["audio"])
                elif event.get("event") == "finish":
                    if event.get("reason") != "stop":
                        raise RuntimeError(f"finish/{event.get('reason')}: {event.get('message', '')}")
                    break
    except Exception as error:
        return Sample(ttfa, time.perf_counter() - started, received / 2 / args.sample_rate, repr(error))
    return Sample(ttfa, time.perf_counter() - started, received / 2 / args.sample_rate)


async def run_level(mode: str, concurrency: int, args: argparse.Namespace) -> LevelResult:
    import httpx

    total = max(args.requests_per_level, concurrency)
    pending = iter(range(total))
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    async with httpx.AsyncClient(
        base_url=args.url, headers=headers, timeout=args.timeout, limits=limits
    ) as client:

        async def worker() -> None:
            for _ in pending:
                sample = await (one_http(client, args) if mode == "http" else one_websocket(args))
                samples.append(sample)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    ttfas = [s.ttfa for s in samples if s.ttfa is not None and s.error is None]
    errors = [s.error for s in samples if s.error]
    p50, p95 = percentile(ttfas, 0.5), percentile(ttfas, 0.95)
    return LevelResult(
        mode=mode,
        concurrency=concurrency,
        requests=len(samples),
        errors=len(errors),
        ttfa_p50_ms=None if p50 is None else round(p50 * 1000, 1),
        ttfa_p95_ms=None if p95 is None else round(p95 * 1000, 1),
        audio_seconds_per_second=round(sum(s.audio_seconds for s in samples) / wall, 3),
        wall_seconds=round(wall, 2),
        error_examples=sorted(set(errors))[:3],
    )


def format_row(result: LevelResult) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.0f}"

    return (
        f"{result.mode:5} {result.concurrency:>5} {result.requests:>8} {result.errors:>6} "
        f"{ms(result.ttfa_p50_ms):>9} {ms(result.ttfa_p95_ms):>9} {result.audio_seconds_per_second:>10.2f} "
        f"{result.wall_seconds:>8.1f}"
    )


async def sweep(args: argparse.Namespace) -> list[LevelResult]:
    modes = ["http", "ws"] if args.mode == "both" else [args.mode]
    print("mode  conc. requests errors  TTFA p50  TTFA p95  audio s/s   wall s")
    results = []
    for mode in modes:
        for concurrency in args.concurrency:
            result = await run_level(mode, concurrency, args)
            results.append(result)
            print(format_row(result), flush=True)
            for example in result.error_examples:
                print(f"      error: {example}")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=os.environ.get("SHOAL_URL", "http://127.0.0.1:8080"), help="server base URL"
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("SHOAL_API_KEY") or os.environ.get("FISH_API_KEY") or "local",
        help="bearer key (env SHOAL_API_KEY or FISH_API_KEY)",
    )
    parser.add_argument("--mode", choices=("http", "ws", "both"), default="both")
    parser.add_argument(
        "--concurrency",
        type=lambda text: [int(v) for v in text.split(",")],
        default=[1, 2, 4, 8],
        help="comma-separated levels (default 1,2,4,8)",
    )
    parser.add_argument("--requests-per-level", type=int, default=16, help="at least the concurrency")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--reference-id", help="a stored voice to speak with")
    parser.add_argument("--model", default="s2-pro", help="the `model` header")
    parser.add_argument("--sample-rate", type=int, default=44100)
    parser.add_argument("--chunk-length", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    parser.add_argument("--json", dest="json_path", help="also write the results to this JSON file")


def run(args: argparse.Namespace) -> int:
    results = asyncio.run(sweep(args))
    if args.json_path:
        with open(args.json_path, "w") as output:
            json.dump([asdict(result) for result in results], output, indent=2)
    ttfas = [r.ttfa_p50_ms for r in results if r.ttfa_p50_ms is not None]
    if ttfas:
        print(f"median of TTFA p50 across levels: {statistics.median(ttfas):.0f} ms")
    return 1 if all(r.errors == r.requests for r in results) else 0
