"""Host time per frame of the delivery path: engine thread (`_deliver`: booking, the request's
sink, `Vocoder.push`) and vocoder thread (`decode` around the codec call). The tiny golden model
and codec on the CPU make the model's own time small, so what is measured is mostly Python.

Usage: python scripts/probe_host_delivery.py [--streams 32] [--frames 128]
Prints µs per frame per piece (each wrapped call timed with perf_counter) and frames/s.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from pathlib import Path

import torch

from shoal.config import EngineConfig
from shoal.engine.api import SamplingOptions, SynthesisRequest
from shoal.engine.engine import LocalEngine
from shoal.models import load_model
from shoal.models.codec import load_codec


def timed(obj, name: str, label: str, spent: collections.Counter) -> None:
    """Replace obj.name by a wrapper adding each call's seconds to spent[label]."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[label] += time.perf_counter() - start

    setattr(obj, name, wrapper)


async def run(engine: LocalEngine, streams: int, frames: int) -> float:
    engine.start_thread()
    try:
        start = time.perf_counter()
        handles = [
            engine.submit(
                SynthesisRequest("hello there", sampling=SamplingOptions(seed=i), max_new_frames=frames)
            )
            for i in range(streams)
        ]

        async def drain(handle) -> None:
            async for _ in handle:
                pass

        await asyncio.gather(*(drain(h) for h in handles))
        return time.perf_counter() - start
    finally:
        engine.stop_thread()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--golden", default=str(Path(__file__).resolve().parents[2] / "shared" / "golden"))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--frames", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    golden = Path(args.golden)
    model = load_model(golden / "s2_tiny", dtype=torch.float32)
    model.config = model.config.replace(max_seq_len=512)
    model.build_rope_tables("cpu")
    config = EngineConfig(
        device="cpu", dtype="float32", num_pages=4096, page_size=16, max_running_requests=args.streams,
        ignore_eos=True,
    )  # fmt: skip
    engine = LocalEngine(model, config, codec=load_codec(golden / "codec_tiny"))
    spent: collections.Counter = collections.Counter()
    timed(engine.core, "_deliver", "engine thread: _deliver (sink, push)", spent)
    timed(engine.vocoder, "push", "  of which Vocoder.push", spent)
    timed(engine.vocoder, "decode", "vocoder thread: decode", spent)
    timed(engine.vocoder.pool, "step", "  of which the codec", spent)
    wall = asyncio.run(run(engine, args.streams, args.frames))
    total = args.streams * args.frames
    print(f"{total} frames in {wall:.2f} s: {total / wall:.0f} frames/s")
    for label, seconds in spent.items():
        print(f"{label:40} {1e6 * seconds / total:7.1f} µs per frame")


if __name__ == "__main__":
    main()
