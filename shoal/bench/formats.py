"""`shoal bench formats`: how much audio the API processes can encode, per format and process count.

Sizes `--api-workers`: mp3 and opus encoding is an API process's heaviest work, and a process's
encoder threads share one GIL, so encoding scales with processes more than with threads. Each of
N processes runs what an API worker runs for its streams: an event loop with `--streams` streams,
each passing chunks of `--chunk-frames` model frames through `synthesis.encode_chunk` (in place for
plain PCM, else on a worker thread) back to back. The result is the encoded audio seconds per wall
second of all N together: past the rate a server's streams need, its delivery falls behind (the
`shoal_audio_delivery_lag_seconds` metric). No GPU and no model: synthetic speech-like audio.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import time

import numpy as np

SAMPLE_RATE = 44100
SAMPLES_PER_FRAME = 2048  # the codec's hop: one model frame of audio


def speech_like(seconds: float, seed: int = 0) -> np.ndarray:
    """A voiced, pitch-gliding, syllable-paced signal: closer to speech for a psychoacoustic
    encoder than a sine or white noise."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    pitch = 120.0 * (1 + 0.2 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
    voiced = sum(np.sin(k * phase) / k for k in range(1, 30)) * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t)) ** 2
    noise = np.random.default_rng(seed).standard_normal(t.size)
    return (0.3 * voiced / np.abs(voiced).max() + 0.01 * noise).astype(np.float32)


async def encode_streams(fmt: str, streams: int, chunk: int, seconds: float) -> float:
    """Encoded audio seconds of `streams` streams encoding back to back for `seconds`."""
    from shoal.server import audio
    from shoal.server.synthesis import encode_chunk

    source = speech_like(8.0)
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
    from shoal.server.audio import FORMATS

    parser.add_argument("--formats", nargs="+", choices=FORMATS, default=["mp3", "opus", "wav"])
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
