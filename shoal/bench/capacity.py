"""In-process capacity: what the engine and codec alone deliver (no HTTP, no format encoding),
the denominator of "how much of the engine's throughput survives the API under open-loop load".

Closed loop: `--concurrency` clients each submit one request after another to a `LocalEngine`
built exactly as `shoal serve` builds it (this command takes `shoal serve`'s options, so the
same SERVE_ARGS apply), with lengths drawn from `--frames` and a `--voice-share` of requests
speaking with one of `--voices` stored-voice-like references (synthetic audio encoded by the
engine's codec, as `POST /model` does). After `--warmup-seconds`, frames and audio delivered in
a window of `--seconds` give the capacity; requests/s is frames/s over the mean frames per
request.

    python -m shoal.bench.capacity --checkpoint CKPT [--weight-format fp8 ...] --concurrency 64 \
        --frames 64-384 --seconds 12 --json capacity.json
    python -m shoal.bench.capacity --summary OPEN_LOOP_JSON [CAPACITY_JSON]   (the ratio table)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

from shoal.bench.open_loop import VOICE_TEXT, frame_range, overload_label, share, synthetic_voice_samples
from shoal.bench.serve import percentile
from shoal.engine.compile_cache import compile_cache_environment

TEXT = "The quick brown fox jumps over the lazy dog. Shoal streams speech while it is generated."


@dataclass
class Capacity:
    concurrency: int
    frames: tuple[int, int]
    voice_share: float
    window_seconds: float
    frames_per_second: float
    audio_seconds_per_second: float
    frames_per_request: float  # mean of the requests finished in the window (else the range's mean)
    requests_per_second: float  # frames_per_second / frames_per_request
    first_audio_p50_ms: float | None
    first_audio_p95_ms: float | None
    requests_finished: int


@dataclass
class Tally:
    """Running totals the clients add to; the window reads them before and after."""

    samples: int = 0
    finished_samples: int = 0
    finished: int = 0


async def client(engine, name: str, plan: random.Random, voices: list, deadline: float, tally, waits, args):
    """One request after another until the deadline; notes (submit time, first audio wait)."""
    from shoal.engine.api import SynthesisRequest

    serial = 0
    while time.perf_counter() < deadline:
        frames = plan.randint(*args.frames)
        voice = plan.randrange(len(voices)) if voices and plan.random() < args.voice_share else None
        request = SynthesisRequest(
            text=args.text,
            references=() if voice is None else (voices[voice],),  # equal references share a prefix
            max_new_frames=frames,
            request_id=f"{name}-{serial}",
        )
        serial += 1
        submitted, received = time.perf_counter(), 0
        async for chunk in engine.submit(request):
            if received == 0:
                waits.append((submitted, time.perf_counter() - submitted))
            received += len(chunk.samples)
            tally.samples += len(chunk.samples)
        tally.finished += 1
        tally.finished_samples += received


async def make_voices(engine, count: int, seconds: float) -> list:
    """References as `POST /model` stores them: synthetic audio encoded by the engine's codec."""
    from shoal.engine.api import VoiceReference

    voices = []
    for index in range(count):
        codes = await engine.encode_reference(synthetic_voice_samples(index, seconds), 16000)
        voices.append(VoiceReference(VOICE_TEXT, codes))
    return voices


async def measure(engine, args: argparse.Namespace) -> Capacity:
    """The closed loop on a started engine: warm-up, then the window."""
    voices = await make_voices(engine, args.voices, args.voice_seconds) if args.voice_share > 0 else []
    tally, waits = Tally(), []
    deadline = time.perf_counter() + args.warmup_seconds + args.seconds
    tasks = [
        asyncio.create_task(
            client(engine, f"c{i}", random.Random(f"{args.seed}/{i}"), voices, deadline, tally, waits, args)
        )
        for i in range(args.concurrency)
    ]
    try:
        await asyncio.sleep(args.warmup_seconds)
        before = (time.perf_counter(), tally.samples, tally.finished, tally.finished_samples)
        window_start = time.time()
        await asyncio.sleep(args.seconds)
        after = (time.perf_counter(), tally.samples, tally.finished, tally.finished_samples)
        # wall-clock bounds, so a GPU monitor's samples can be matched to the window
        print(f"capacity window (epoch s): {window_start:.2f} {time.time():.2f}", flush=True)
    finally:
        failed = [task.exception() for task in tasks if task.done() and not task.cancelled()]
        for task in tasks:  # the requests still running are aborted (their pages freed)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    errors = [error for error in failed if error is not None]
    if errors:  # a client that died would make the capacity look lower than it is
        raise RuntimeError(f"{len(errors)} of {len(tasks)} clients failed") from errors[0]
    window = after[0] - before[0]
    audio_rate = (after[1] - before[1]) / engine.sample_rate / window
    finished = after[2] - before[2]
    mean_frames = (
        (after[3] - before[3]) / engine.sample_rate * engine.frame_rate / finished
        if finished
        else sum(args.frames) / 2
    )
    in_window = [wait for submitted, wait in waits if before[0] <= submitted < after[0]]
    p50, p95 = percentile(in_window, 0.5), percentile(in_window, 0.95)
    frames_rate = audio_rate * engine.frame_rate
    return Capacity(
        concurrency=args.concurrency,
        frames=tuple(args.frames),
        voice_share=args.voice_share,
        window_seconds=round(window, 2),
        frames_per_second=round(frames_rate, 1),
        audio_seconds_per_second=round(audio_rate, 3),
        frames_per_request=round(mean_frames, 1),
        requests_per_second=round(frames_rate / mean_frames, 3),
        first_audio_p50_ms=None if p50 is None else round(1000 * p50, 1),
        first_audio_p95_ms=None if p95 is None else round(1000 * p95, 1),
        requests_finished=finished,
    )


async def measure_checkpoint(args: argparse.Namespace) -> Capacity:
    from shoal.server.cli import build_engine

    started = time.perf_counter()
    engine = build_engine(args)  # as `shoal serve` builds it, warm-up included
    print(f"engine loaded in {time.perf_counter() - started:.0f} s", flush=True)
    await engine.start()
    try:
        return await measure(engine, args)
    finally:
        await engine.stop()


# ---- the summary table -------------------------------------------------------------------------


def summary_table(open_loop: dict, capacity: dict | None) -> str:
    """The open-loop rates, the sustainable one, the in-process capacity and their ratio."""
    lines = [f"open loop over HTTP + WebSocket ({open_loop.get('criteria', '')}):"]
    lines.append(
        "  rate/s   sent  503%  err%  first audio p50/p95/p99 ms  frames/s  in flight  underrun%  ok?"
    )
    for rate in open_loop["rates"]:
        waits = "/".join(
            "-" if rate[key] is None else f"{rate[key]:.0f}"
            for key in ("first_audio_p50_ms", "first_audio_p95_ms", "first_audio_p99_ms")
        )
        lines.append(
            f"  {rate['rate']:6.2f} {rate['sent']:>6} {100 * rate['share_503']:>5.1f} "
            f"{100 * rate['error_share']:>5.1f}  {waits:>26} {rate['frames_per_second']:>9.0f} "
            f"{rate['mean_concurrency']:>10.1f} {100 * rate['underrun_share']:>10.1f}  "
            f"{'yes' if rate['sustainable'] else 'no'}"
        )
    overload = open_loop.get("overload")
    if overload:
        lines.append(
            f"  overload {overload_label(overload.get('factor'))}: {overload['rate']:.2f}/s, "
            f"{100 * overload['share_503']:.1f}% got 503, admitted streams underran "
            f"{100 * overload['underrun_share']:.1f}%, first audio p95 {overload['first_audio_p95_ms']} ms, "
            f"{overload['frames_per_second']:.0f} frames/s"
        )
    best = open_loop.get("sustainable")
    lines.append("")
    lines.append("                          requests/s   frames/s  audio-s/s  first audio p95 ms")
    if best:
        lines.append(
            f"  HTTP sustainable        {best['rate']:>10.2f} {best['frames_per_second']:>10.0f} "
            f"{best['audio_seconds_per_second']:>10.1f} {best['first_audio_p95_ms']:>19.0f}"
        )
    else:
        lines.append("  HTTP sustainable        none of the rates tried")
    if capacity:
        p95 = capacity["first_audio_p95_ms"]
        lines.append(
            f"  in-process capacity     {capacity['requests_per_second']:>10.2f} "
            f"{capacity['frames_per_second']:>10.0f} {capacity['audio_seconds_per_second']:>10.1f} "
            f"{'-' if p95 is None else f'{p95:.0f}':>19}   (closed loop, {capacity['concurrency']} in flight)"
        )
    else:
        lines.append("  in-process capacity     not measured")
    if best and capacity and capacity["frames_per_second"] > 0:
        ratio = best["frames_per_second"] / capacity["frames_per_second"]
        lines.append(f"  HTTP sustainable / in-process capacity (frames/s): {ratio:.2f}")
    return "\n".join(lines)


def print_summary(open_loop_path: str, capacity_path: str | None) -> int:
    with open(open_loop_path) as file:
        open_loop = json.load(file)
    capacity = None
    if capacity_path:
        try:
            with open(capacity_path) as file:
                capacity = json.load(file)
        except (OSError, ValueError) as error:
            print(f"(no in-process capacity: {error})")
    print(summary_table(open_loop, capacity))
    return 0


# ---- the command line --------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from shoal.server.cli import add_arguments as add_serve_arguments

    add_serve_arguments(parser)  # the engine's options, as `shoal serve` takes them
    group = parser.add_argument_group("capacity")
    group.add_argument("--concurrency", type=int, default=64, help="clients, each one request at a time")
    group.add_argument("--frames", type=frame_range, default=(64, 384), help="max_new_frames: N or LOW-HIGH")
    group.add_argument("--voice-share", type=share, default=0.5, help="share speaking with a stored voice")
    group.add_argument("--voices", type=int, default=2)
    group.add_argument("--voice-seconds", type=float, default=5.0)
    group.add_argument("--text", default=TEXT)
    group.add_argument("--seconds", type=float, default=12.0, help="the measured window")
    group.add_argument("--warmup-seconds", type=float, default=4.0)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--json", dest="json_path", help="write the result to this JSON file")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--summary"]:
        if not 2 <= len(argv) <= 3:
            print("usage: python -m shoal.bench.capacity --summary OPEN_LOOP_JSON [CAPACITY_JSON]")
            return 2
        return print_summary(argv[1], argv[2] if len(argv) == 3 else None)
    parser = argparse.ArgumentParser(
        prog="python -m shoal.bench.capacity", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    # The engine compiles what `shoal serve --data-dir` compiled: found there, not compiled again.
    os.environ.update(compile_cache_environment(args.data_dir))
    result = asyncio.run(measure_checkpoint(args))
    print(
        f"in-process capacity at {result.concurrency} in flight: {result.frames_per_second:.0f} frames/s, "
        f"{result.audio_seconds_per_second:.1f} audio-s/s, {result.requests_per_second:.2f} requests/s of "
        f"{result.frames_per_request:.0f} frames; first audio p50/p95 {result.first_audio_p50_ms}/"
        f"{result.first_audio_p95_ms} ms",
        flush=True,
    )
    if args.json_path:
        with open(args.json_path, "w") as file:
            json.dump(asdict(result), file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
