"""A prefill graph beside a decode graph on a second stream, against the two one after the other.

Why: the engine runs a step's prefill chunks on the decode's stream, after its decode graph. The
batch-16 and batch-64 decode steps leave SMs idle (latency chains), while prefill is
compute-bound, so the two on separate streams should take less than their sum. This measures how
much less, with graphs outside the engine.

The two graphs share the engine's FP8 split-K workspace here, so their outputs are garbage when
they overlap; only the times count. The engine itself would need separate buffers first.

Usage (GPU): python scripts/probe_prefill_overlap.py [--batch 64 16] [--tokens 256 1024]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from shoal.bench.engine import _synthetic_rows, random_step_core
from shoal.bench.timing import cuda_elapsed_ms, sample_ms

CONTEXT = 332  # keys per decode row, the engine bench's


def median_ms(work) -> float:
    work()
    torch.cuda.synchronize()
    return statistics.median(sample_ms(work, 10, 1, cuda_elapsed_ms))


def serial_and_overlapped(decode, prefill, decode_stream, prefill_stream) -> tuple[float, float]:
    """ms of the two graphs one after the other on this stream, and on the two streams."""
    here = torch.cuda.current_stream()

    def serial() -> None:
        decode.replay()
        prefill.replay()

    def overlapped() -> None:
        decode_stream.wait_stream(here)
        prefill_stream.wait_stream(here)
        with torch.cuda.stream(decode_stream):
            decode.replay()
        with torch.cuda.stream(prefill_stream):
            prefill.replay()
        here.wait_stream(decode_stream)
        here.wait_stream(prefill_stream)

    return median_ms(serial), median_ms(overlapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 16])
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    args = parser.parse_args()
    for batch in args.batch:
        core = random_step_core([batch], CONTEXT)
        runner = core.runner
        _synthetic_rows(core, batch, CONTEXT)
        decode = runner.graphs.graphs[batch]
        for priority in (0, -1):  # the decode stream at normal, then high priority
            streams = torch.cuda.Stream(priority=priority), torch.cuda.Stream()
            for tokens in args.tokens:
                prefill = runner.prefill_graphs.graphs[runner.prefill_graphs.bucket_for(tokens)]
                alone_d, alone_p = median_ms(decode.replay), median_ms(prefill.replay)
                one, two = serial_and_overlapped(decode, prefill, *streams)
                print(
                    f"batch {batch}, prefill {tokens} tokens, decode priority {priority}: decode "
                    f"{alone_d:.3f} prefill {alone_p:.3f} serial {one:.3f} two streams {two:.3f} "
                    f"({two / one:.3f})",
                    flush=True,
                )
        del core, runner, decode
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
