"""Where a request's first audio goes, in process (no HTTP): submit -> first frame -> the frame
the codec's first chunk waits for -> the codec call -> the chunk at the caller.

Usage (GPU): python scripts/probe_first_audio.py [--checkpoint /tmp/ckpt] [--weight-format fp8]
Writes a random S2-Pro-size checkpoint first when the directory has none. Prints one row per
request (ms after submit) and the medians; `shoal bench serve` minus these is the transport.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

from shoal.bench.probes import record_codec_calls
from shoal.config import EngineConfig
from shoal.engine.api import SynthesisRequest
from shoal.engine.load import load_engine

TEXT = "Shoal streams speech while it is generated, one frame at a time."


def instrument(engine) -> tuple[dict, list]:
    """Record each delivered frame's time per request id and each codec call's start and end."""
    frames: dict[str, list[float]] = {}
    core = engine.core
    deliver = core._deliver

    def timed_deliver(request, frame):
        frames.setdefault(request.request_id, []).append(time.perf_counter())
        return deliver(request, frame)

    core._deliver = timed_deliver
    return frames, record_codec_calls(engine.vocoder)


async def one(engine, frames: dict, calls: list, index: int) -> dict:
    request_id = f"probe-{index}"
    calls.clear()
    submit = time.perf_counter()
    handle = engine.submit(SynthesisRequest(text=TEXT, request_id=request_id, max_new_frames=64))
    first_chunk = None
    async for _chunk in handle:
        if first_chunk is None:
            first_chunk = time.perf_counter()
    batch_frames = next(v for k, v in frames.items() if k.startswith(request_id))
    # The previous request's last codec call may be noted after `calls.clear()` (its end reaches
    # the caller before the recorder appends it): this request's calls start after its submit.
    first_call = next(call for call in calls if call[0] >= submit)
    ms = lambda t: 1000 * (t - submit)  # noqa: E731
    need = min(engine.vocoder.first_chunk_frames, len(batch_frames))  # a short request's last
    return {
        "first frame": ms(batch_frames[0]),
        f"frame {need}": ms(batch_frames[need - 1]),
        "codec start": ms(first_call[0]),
        "codec end": ms(first_call[1]),
        "chunk at caller": ms(first_chunk),
    }


async def main(args) -> None:
    config = EngineConfig(max_running_requests=8)
    engine = load_engine(args.checkpoint, weight_format=args.weight_format, config=config)
    frames, calls = instrument(engine)
    await engine.start()
    try:
        rows = [await one(engine, frames, calls, i) for i in range(args.requests)]
    finally:
        await engine.stop()
    names = list(rows[0])
    print("ms after submit: " + " | ".join(names))
    for row in rows:
        print("  " + " | ".join(f"{row[n]:7.1f}" for n in names))
    print("median: " + " | ".join(f"{statistics.median(r[n] for r in rows):7.1f}" for n in names))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="/tmp/ckpt")
    parser.add_argument("--weight-format", default="fp8")
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args()
    if not (Path(args.checkpoint) / "config.json").exists():
        from shoal.bench import random_checkpoint

        random_checkpoint.main([args.checkpoint, "--size", "s2-pro"])
    asyncio.run(main(args))
