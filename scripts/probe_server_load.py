"""Where a loaded engine's time goes, in process (no HTTP): closed-loop clients keep C requests
running for a while, and the probe reports frames and audio per second, the engine's steps per
second, the codec calls' share of the wall time, and the CPU time of each thread (engine,
vocoder, event loop, the rest). With `--py-spy PATH`, py-spy samples this process meanwhile
(only the thread holding the GIL, and every thread), for a later `--summarize`.

Usage (GPU): python scripts/probe_server_load.py [--checkpoint /tmp/ckpt] [--weight-format fp8]
             [--concurrency 64] [--frames 256] [--seconds 12] [--py-spy /tmp/site/bin/py-spy --out DIR]
Summary of py-spy's raw files: python scripts/probe_server_load.py --summarize DIR
Writes a random S2-Pro-size checkpoint first when the directory has none.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import os
import subprocess
import threading
import time
from pathlib import Path

from shoal.bench.probes import record_codec_calls
from shoal.config import EngineConfig
from shoal.engine.api import SynthesisRequest
from shoal.engine.load import load_engine

TEXT = "Shoal streams speech while it is generated, one frame at a time."
TICKS = os.sysconf("SC_CLK_TCK")
NAMED_THREADS = ("shoal-engine", "shoal-vocoder", "MainThread", "process")


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds per Python thread name, plus "process" (all threads, native ones too)."""
    result = {}
    for thread in threading.enumerate():
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        result[thread.name] = (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime
    times = os.times()
    result["process"] = times.user + times.system
    return result


def instrument(engine) -> tuple[list, list, list]:
    """Each delivered frame's time, each codec call's (start, end, streams), and the seconds
    the engine thread spends in its decode uploads (one running total)."""
    frames: list[float] = []
    uploading = [0.0]
    core = engine.core
    host = core.runner.host
    upload = host.upload

    def timed_upload(*args, **kwargs):
        start = time.perf_counter()
        upload(*args, **kwargs)
        uploading[0] += time.perf_counter() - start

    host.upload = timed_upload
    deliver = core._deliver

    def timed_deliver(request, frame):
        frames.append(time.perf_counter())
        return deliver(request, frame)

    core._deliver = timed_deliver
    return frames, record_codec_calls(engine.vocoder), uploading


async def client(
    engine,
    name: str,
    frames: int,
    deadline: float,
    samples: list[int],
    first_audio: list[tuple[float, float]],
) -> None:
    """Submit one request after another until the deadline; add up the audio samples received
    and note each request's (submit time, seconds to its first audio)."""
    serial = 0
    while time.perf_counter() < deadline:
        request = SynthesisRequest(text=TEXT, request_id=f"{name}-{serial}", max_new_frames=frames)
        serial += 1
        submitted = time.perf_counter()
        async for chunk in engine.submit(request):
            if submitted is not None:
                first_audio.append((submitted, time.perf_counter() - submitted))
                submitted = None
            samples[0] += len(chunk.samples)


def start_py_spy(binary: str, out: Path, seconds: int, tag: str) -> list[subprocess.Popen]:
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for mode in ("gil", "idle"):
        command = [binary, "record", "--pid", str(os.getpid()), "--duration", str(seconds), "--rate", "200"]
        command += ["--format", "raw", "--threads", "--nonblocking", f"--{mode}"]
        command += ["-o", str(out / f"pyspy_{mode}{tag}.txt")]
        log = open(out / f"pyspy_{mode}{tag}.log", "w")  # noqa: SIM115 (the child keeps it)
        spies.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log))
    return spies


async def measure(engine, args, concurrency: int, frames: list, calls: list, uploading: list) -> dict:
    samples, first_audio = [0], []
    deadline = time.perf_counter() + args.warmup_seconds + args.seconds
    tasks = [
        asyncio.create_task(
            client(engine, f"c{concurrency}-{i}", args.frames, deadline, samples, first_audio)
        )
        for i in range(concurrency)
    ]
    await asyncio.sleep(args.warmup_seconds)
    # The window: counters before and after.
    spies = []
    if args.py_spy:
        spies = start_py_spy(args.py_spy, Path(args.out), max(1, int(args.seconds * 0.8)), f"_c{concurrency}")
    core = engine.core

    def snapshot() -> dict:
        steps = core._rate_window[-1][1] if core._rate_window else 0
        return {
            "t": time.perf_counter(),
            "cpu": thread_cpu_seconds(),
            "frames": len(frames),
            "calls": len(calls),
            "samples": samples[0],
            "steps": steps,
            "upload": uploading[0],
        }

    before = snapshot()
    await asyncio.sleep(args.seconds)
    after = snapshot()
    await asyncio.gather(*tasks)
    for spy in spies:
        spy.wait()
    window = after["t"] - before["t"]
    codec_calls = calls[before["calls"] : after["calls"]]
    codec_busy = sum(end - begin for begin, end, _ in codec_calls)
    cpu = {name: (value - before["cpu"].get(name, 0.0)) / window for name, value in after["cpu"].items()}
    steps = after["steps"] - before["steps"]
    # First audio of the requests submitted in the window (the first round's burst is outside it).
    waits = sorted(wait for t, wait in first_audio if before["t"] <= t < after["t"]) or [float("nan")]
    return {
        "concurrency": concurrency,
        "frames/s": (after["frames"] - before["frames"]) / window,
        "audio s/s": (after["samples"] - before["samples"]) / engine.sample_rate / window,
        "steps/s": steps / window,
        "ms/step": 1000 * window / steps if steps else float("nan"),
        "upload ms/step": 1000 * (after["upload"] - before["upload"]) / steps if steps else float("nan"),
        "codec calls/s": len(codec_calls) / window,
        "codec busy": codec_busy / window,
        "streams/call": sum(c[2] for c in codec_calls) / max(1, len(codec_calls)),
        "first audio p50 ms": 1000 * waits[len(waits) // 2],
        "first audio p95 ms": 1000 * waits[min(len(waits) - 1, int(0.95 * len(waits)))],
        "cpu": cpu,
    }


async def main(args) -> None:
    config = EngineConfig(
        max_running_requests=max(args.concurrency),
        prefill_graph_segments=args.prefill_graph_segments,
        vocoder_max_chunk_frames=args.max_chunk_frames,
    )
    engine = load_engine(args.checkpoint, weight_format=args.weight_format, config=config)
    frames, calls, uploading = instrument(engine)
    captured = engine.vocoder.policy
    await engine.start()
    try:
        for concurrency, cap in itertools.product(args.concurrency, args.chunk_caps or [None]):
            if cap is not None:  # the largest chunk of the growth, among the captured ones
                engine.vocoder.policy = dataclasses.replace(captured, max_chunk_frames=cap)
            print(f"-- largest chunk {engine.vocoder.policy.largest_chunk}")
            row = await measure(engine, args, concurrency, frames, calls, uploading)
            cpu = row.pop("cpu")
            print("  ".join(f"{k} {v:.3g}" for k, v in row.items()))
            named = {k: v for k, v in cpu.items() if k in NAMED_THREADS}
            other = sum(v for k, v in cpu.items() if k not in named)
            shares = "  ".join(f"{k} {v:.2f}" for k, v in named.items())
            print(f"    CPU (fraction of one core): {shares}  other Python threads {other:.2f}")
    finally:
        await engine.stop()


def summarize(folder: Path, top: int = 12) -> None:
    """Per thread: its share of py-spy's samples, and its heaviest leaf functions."""
    for path in sorted(folder.glob("pyspy_*.txt")):
        mode = path.stem
        per_thread: collections.Counter = collections.Counter()
        leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for line in path.read_text().splitlines():
            stack, _, count = line.rpartition(" ")
            if not count.isdigit():
                continue
            frames = stack.split(";")
            thread = next((f for f in frames if f.startswith("thread ")), frames[0])
            per_thread[thread] += int(count)
            ours = [f for f in frames if "(shoal/" in f]  # the deepest of our frames
            leaves[thread][ours[-1] if ours else frames[-1]] += int(count)
        total = sum(per_thread.values()) or 1
        print(f"== {mode}: {total} samples")
        for thread, count in per_thread.most_common():
            print(f"  {100 * count / total:5.1f}%  {thread}")
            for leaf, n in leaves[thread].most_common(top):
                print(f"          {100 * n / total:5.1f}%  {leaf}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="/tmp/ckpt")
    parser.add_argument("--weight-format", default="fp8")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64])
    parser.add_argument("--prefill-graph-segments", type=int, default=EngineConfig.prefill_graph_segments)
    parser.add_argument(
        "--max-chunk-frames", type=int, default=None, help="EngineConfig.vocoder_max_chunk_frames"
    )
    parser.add_argument("--chunk-caps", type=int, nargs="*", help="run each level with these largest chunks")
    parser.add_argument("--frames", type=int, default=256, help="max_new_frames per request")
    parser.add_argument("--seconds", type=float, default=12.0, help="the measured window")
    parser.add_argument("--warmup-seconds", type=float, default=4.0)
    parser.add_argument("--py-spy", default=None, help="py-spy binary: sample this process in the window")
    parser.add_argument("--out", default=".", help="folder for py-spy's files")
    parser.add_argument("--summarize", default=None, help="print the summary of a folder's py-spy files")
    args = parser.parse_args()
    if args.summarize:
        summarize(Path(args.summarize))
    else:
        if not (Path(args.checkpoint) / "config.json").exists():
            from shoal.bench import random_checkpoint

            random_checkpoint.main([args.checkpoint, "--size", "s2-pro"])
        asyncio.run(main(args))
