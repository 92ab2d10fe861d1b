"""`shoal bench formats`: how much audio the API processes can encode, per format and process count.

Sizes `--api-workers` and the cores a GPU's server needs: mp3 and opus encoding is an API
process's heaviest work, on its worker threads, beside the engine process on the same cores. Each
of N processes runs what an API worker runs for its streams: an event loop with `--streams` streams,
each passing chunks of `--chunk-frames` model frames through `synthesis.encode_chunk` (in place for
plain PCM, else on a worker thread) back to back. The result is the encoded audio seconds per wall
second of all N together: past the rate a server's streams need, its delivery falls behind (the
`shoal_audio_delivery_lag_seconds` metric). No GPU and no model: the open-loop benchmark's
synthetic voice (`open_loop.synthetic_voice_samples`), a pitched buzz under a syllable envelope.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import time

from shoal.bench.open_loop import synthetic_voice_samples
from shoal.server import audio
from shoal.server.synthesis import encode_chunk

SAMPLE_RATE = audio.SAMPLE_RATE  # the codec's
SAMPLES_PER_FRAME = 2048  # the codec's hop: one model frame of audio


async def encode_streams(fmt: str, streams: int, chunk: int, seconds: float) -> float:
    """Encoded audio seconds of `streams` streams encoding back to back for `seconds`."""
    source = synthetic_voice_samples(0, 8.0, SAMPLE_RATE)
    deadline = time.perf_counter() + seconds
    done = 0

    async def one(index: int) -> None:
        nonlocal done
        encoder = audio.create_encoder(fmt, input_sample_rate=SAMPLE_RATE)
        offset = (index * 7919 * SAMPLES_PER_FRAME) % (source.size - chunk)
        while time.perf_counter() < deadline:
            await encode_chunk(encoder, source[offset : offset + chunk])
            done += chunk
            offset = (offset + chunk) % (source.size - chunk)
        encoder.finish()

    await asyncio.gather(*(one(i) for i in range(streams)))
    return done / SAMPLE_RATE


def process_main(fmt: str, streams: int, chunk: int, seconds: float, start_at: float, results) -> None:
    time.sleep(max(0.0, start_at - time.time()))  # all processes start together
    results.put(asyncio.run(encode_streams(fmt, streams, chunk, seconds)))


def measure(fmt: str, processes: int, streams: int, chunk: int, seconds: float) -> float:
    """Audio seconds encoded per wall second by `processes` processes together."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.time() + 2.0 + 0.2 * processes  # after every interpreter has started
    workers = [
        context.Process(target=process_main, args=(fmt, streams, chunk, seconds, start_at, results))
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    total, reported = 0.0, 0
    while reported < len(workers):
        try:
            total += results.get(timeout=1.0)
            reported += 1
        except queue.Empty:
            failed = [worker.exitcode for worker in workers if worker.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"an encoding process exited with {failed[0]} (error above)") from None
    for worker in workers:
        worker.join()
    return total / seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--formats", nargs="+", choices=audio.FORMATS, default=["mp3", "opus", "wav"])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--streams", type=int, default=16, help="streams per process")
    parser.add_argument("--chunk-frames", type=int, default=8, help="model frames per encoded chunk")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured time per row")


def run(args: argparse.Namespace) -> int:
    chunk = args.chunk_frames * SAMPLES_PER_FRAME
    print(f"{args.streams} streams per process, {args.chunk_frames}-frame chunks, {args.seconds:g} s per row")
    print("format  processes  audio-s/s  per process")
    for fmt in args.formats:
        for processes in args.processes:
            rate = measure(fmt, processes, args.streams, chunk, args.seconds)
            print(f"{fmt:6}  {processes:9d}  {rate:9.0f}  {rate / processes:11.0f}", flush=True)
    return 0
