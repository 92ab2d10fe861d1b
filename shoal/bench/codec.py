"""`shoal bench codec`: streaming codec decode throughput (and the encoder), random weights.

Full-size codec, bf16 by default. For each (streams, chunk) it feeds every stream `chunk` new
frames per step and reports audio seconds produced per wall second for:
  graph  - the batched streaming step replayed as a CUDA graph (what the engine runs),
  eager  - the same step without graphs,
  redecode - the naive baseline: re-decode each stream's whole history every step, keep the tail.
It also checks the bf16 streamed audio against a float32 full decode, and times `encode`.
Needs only torch (+ triton for the fused Snake); runs on a GPU box without the web stack.
"""

from __future__ import annotations

import argparse
import time

import torch

from shoal.models.codec import Codec, CodecConfig, random_codec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument(
        "--chunks", type=int, nargs="+", default=[4, 8], help="new frames per stream per step"
    )
    parser.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph rows")
    parser.add_argument("--no-redecode", action="store_true", help="skip the naive baseline rows")
    parser.add_argument("--encode-seconds", type=float, default=10.0, help="audio length for the encoder row")


def run(args: argparse.Namespace) -> int:
    run_codec_bench(
        streams=args.streams, chunks=args.chunks, steps=args.steps, dtype=getattr(torch, args.dtype),
        device=args.device, graphs=not args.no_graphs, redecode=not args.no_redecode,
        encode_seconds=args.encode_seconds,
    )  # fmt: skip
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _random_codes(codec: Codec, batch: int, frames: int, gen: torch.Generator) -> torch.Tensor:
    cfg = codec.config
    semantic = torch.randint(0, cfg.semantic_codebook_size, (batch, 1, frames), generator=gen)
    residual = torch.randint(0, cfg.codebook_size, (batch, cfg.n_codebooks, frames), generator=gen)
    return torch.cat([semantic, residual], 1).to(codec.device)


def _time_streaming(
    codec: Codec, codes: torch.Tensor, chunk: int, steps: int, graphs: bool
) -> tuple[float, list]:
    """Seconds for `steps` batched steps (after one warm-up step), and the audio produced."""
    pool = codec.stream_pool(codes.shape[0])
    if graphs:
        pool.capture_cuda_graphs([codes.shape[0]], [chunk])
    streams = [pool.open() for _ in range(codes.shape[0])]
    audio: list[list[torch.Tensor]] = [[] for _ in streams]

    def one_step(i: int) -> None:
        new = [codes[b, :, i * chunk : (i + 1) * chunk] for b in range(len(streams))]
        for b, out in enumerate(pool.step(streams, new)):
            audio[b].append(out)

    one_step(0)
    _sync(codec.device)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        one_step(i)
    _sync(codec.device)
    return time.perf_counter() - start, audio


def _time_redecode(codec: Codec, codes: torch.Tensor, chunk: int, steps: int) -> float:
    """Naive baseline: every step decodes each stream's full history and keeps the new tail."""
    codec.decode(codes[:, :, :chunk])
    _sync(codec.device)
    start = time.perf_counter()
    for i in range(1, steps + 1):
        audio = codec.decode(codes[:, :, : (i + 1) * chunk])
        audio[..., -chunk * codec.frame_length :].contiguous()
    _sync(codec.device)
    return time.perf_counter() - start


@torch.inference_mode()
def run_codec_bench(
    streams: list[int] = (1, 16, 64), chunks: list[int] = (4, 8), steps: int = 8,
    dtype: torch.dtype = torch.bfloat16, device: str = "cuda", graphs: bool = True, redecode: bool = True,
    encode_seconds: float = 10.0, config: CodecConfig | None = None,
) -> list[dict]:  # fmt: skip
    """Print and return one row per measurement."""
    device = torch.device(device)
    graphs = graphs and device.type == "cuda"
    codec = random_codec(config, seed=0, device=device, dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    print(f"codec bench: {sum(p.numel() for p in codec.parameters()) / 1e6:.0f}M params, {dtype}, {device}")
    print(f"{'mode':<9} {'streams':>7} {'chunk':>5} {'ms/step':>8} {'audio s/s':>10} {'frames/s':>9}")
    for chunk in chunks:
        for batch in streams:
            codes = _random_codes(codec, batch, (steps + 1) * chunk, gen)
            audio_seconds = batch * steps * chunk * codec.frame_length / codec.sample_rate
            modes = (["graph"] if graphs else []) + ["eager"] + (["redecode"] if redecode else [])
            for mode in modes:
                if mode == "redecode":
                    seconds = _time_redecode(codec, codes, chunk, steps)
                else:
                    seconds, _ = _time_streaming(codec, codes, chunk, steps, graphs=mode == "graph")
                row = {
                    "mode": mode,
                    "streams": batch,
                    "chunk": chunk,
                    "ms_per_step": 1e3 * seconds / steps,
                    "audio_s_per_s": audio_seconds / seconds,
                    "frames_per_s": batch * steps * chunk / seconds,
                }
                rows.append(row)
                print(f"{mode:<9} {batch:>7} {chunk:>5} {row['ms_per_step']:>8.2f} "
                      f"{row['audio_s_per_s']:>10.0f} {row['frames_per_s']:>9.0f}")  # fmt: skip
    rows.append(_accuracy_row(codec, config, chunks[0], graphs, gen))
    rows.append(_encode_row(codec, encode_seconds, gen))
    return rows


def _accuracy_row(codec: Codec, config: CodecConfig | None, chunk: int, graphs: bool, gen) -> dict:
    """Streamed audio in the bench dtype vs a float32 full decode of the same codes."""
    codes = _random_codes(codec, 2, 8 * chunk, gen)
    _, audio = _time_streaming(codec, codes, chunk, steps=7, graphs=graphs)
    streamed = torch.stack([torch.cat(parts) for parts in audio]).float()
    reference = random_codec(config, seed=0, device=codes.device, dtype=torch.float32).decode(codes)[:, 0]
    error = (streamed - reference).abs()
    row = {"mode": "accuracy", "max_abs_err": error.max().item(), "mean_abs_err": error.mean().item(),
           "reference_rms": reference.pow(2).mean().sqrt().item()}  # fmt: skip
    print(f"accuracy vs float32 full decode: max |err| {row['max_abs_err']:.2e}, "
          f"mean |err| {row['mean_abs_err']:.2e}, reference rms {row['reference_rms']:.3f}")  # fmt: skip
    return row


def _encode_row(codec: Codec, seconds: float, gen) -> dict:
    samples = int(seconds * codec.sample_rate)
    row = {"mode": "encode"}
    for batch in (1, 16):
        audio = (0.1 * torch.randn(batch, samples, generator=gen)).to(codec.device)
        codec.encode(audio)
        _sync(codec.device)
        start = time.perf_counter()
        codec.encode(audio)
        _sync(codec.device)
        elapsed = time.perf_counter() - start
        row[f"audio_s_per_s_b{batch}"] = batch * seconds / elapsed
        print(
            f"encode    {batch:>7} {seconds:>4.0f}s {1e3 * elapsed:>8.2f} {batch * seconds / elapsed:>10.0f}"
        )
    return row
