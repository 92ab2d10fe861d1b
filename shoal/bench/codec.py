"""`shoal bench codec`: streaming codec decode throughput (and the encoder), random weights.

Full-size codec, bf16 by default. For each (streams, chunk) it feeds every stream `chunk` new
frames per step and reports audio seconds produced per wall second for:
  graph  - the batched streaming step replayed as a CUDA graph (what the engine runs),
  eager  - the same step without graphs,
  redecode - the naive baseline: re-decode each stream's whole history every step, keep the tail.
It also checks the bf16 streamed audio against a float32 full decode, and times `encode`.
Needs only torch (+ triton for the fused Snake); runs on a GPU box without the web stack.

`--codec firefly`: Fish Speech 1.5's codec instead (`models/codec_firefly.py`; the same pool and
graphs): every row but the accuracy one (a float32 reference of the modded DAC's).
"""

from __future__ import annotations

import argparse
import time

import torch

from shoal.models.codec import Codec, CodecConfig, random_codec
from shoal.models.codec_firefly import FireflyCodec, random_firefly_codec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--codec", choices=["dac", "firefly"], default="dac",
        help="the modded DAC (S1-mini, S2) or Fish Speech 1.5's Firefly codec",
    )  # fmt: skip
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
    parser.add_argument("--profile", action="store_true", help="kernel-time table of eager steps (64 x 8)")
    parser.add_argument("--diagnose", action="store_true", help="graph vs eager vs fp32 accuracy table")


def run(args: argparse.Namespace) -> int:
    firefly = args.codec == "firefly"
    codec = random_firefly_codec(device=args.device, dtype=getattr(torch, args.dtype)) if firefly else None
    run_codec_bench(
        streams=args.streams, chunks=args.chunks, steps=args.steps, dtype=getattr(torch, args.dtype),
        device=args.device, graphs=not args.no_graphs, redecode=not args.no_redecode,
        encode_seconds=args.encode_seconds, profile=args.profile and not firefly,
        diagnose=args.diagnose and not firefly, codec=codec,
    )  # fmt: skip
    return 0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _wall_seconds(device: torch.device, work) -> float:
    """Wall seconds of `work()`, the device drained before and after."""
    _sync(device)
    start = time.perf_counter()
    work()
    _sync(device)
    return time.perf_counter() - start


def _random_codes(codec: Codec, batch: int, frames: int, gen: torch.Generator) -> torch.Tensor:
    if isinstance(codec, FireflyCodec):
        size = codec.config.codebook_size
        return torch.randint(0, size, (batch, codec.num_codebooks, frames), generator=gen).to(codec.device)
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
    seconds = _wall_seconds(codec.device, lambda: [one_step(i) for i in range(1, steps + 1)])
    return seconds, audio


def _time_redecode(codec: Codec, codes: torch.Tensor, chunk: int, steps: int) -> float:
    """Naive baseline: every step decodes each stream's full history and keeps the new tail."""
    codec.decode(codes[:, :, :chunk])

    def work() -> None:
        for i in range(1, steps + 1):
            audio = codec.decode(codes[:, :, : (i + 1) * chunk])
            audio[..., -chunk * codec.frame_length :].contiguous()

    return _wall_seconds(codec.device, work)


@torch.inference_mode()
def run_codec_bench(
    streams: list[int] = (1, 16, 64), chunks: list[int] = (4, 8), steps: int = 8,
    dtype: torch.dtype = torch.bfloat16, device: str = "cuda", graphs: bool = True, redecode: bool = True,
    encode_seconds: float = 10.0, config: CodecConfig | None = None, profile: bool = False,
    diagnose: bool = False, codec: Codec | None = None,
) -> list[dict]:  # fmt: skip
    """Print and return one row per measurement."""
    device = torch.device(device)
    firefly = isinstance(codec, FireflyCodec)
    graphs = graphs and device.type == "cuda"
    codec = codec or random_codec(config, seed=0, device=device, dtype=dtype)
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
                    "mode": mode, "streams": batch, "chunk": chunk, "ms_per_step": 1e3 * seconds / steps,
                    "audio_s_per_s": audio_seconds / seconds, "frames_per_s": batch * steps * chunk / seconds,
                }  # fmt: skip
                rows.append(row)
                print(f"{mode:<9} {batch:>7} {chunk:>5} {row['ms_per_step']:>8.2f} "
                      f"{row['audio_s_per_s']:>10.0f} {row['frames_per_s']:>9.0f}")  # fmt: skip
    if not firefly:
        rows.append(_accuracy_row(codec, config, chunks[0], graphs, gen))
    if encode_seconds > 0:
        rows.append(_encode_row(codec, encode_seconds, gen))
    if profile:
        _profile_table(codec, gen)
    if diagnose:
        rows.append(_diagnose(codec, config, gen))
    return rows


_REFERENCES: dict = {}


def _fp32_reference(codec: Codec, config: CodecConfig | None, codes: torch.Tensor) -> torch.Tensor:
    """Full decode in true float32: cuDNN's default TF32 convs (10-bit mantissa) switched off."""
    key = (id(config), codes.device)
    if key not in _REFERENCES:
        _REFERENCES[key] = random_codec(config, seed=0, device=codes.device, dtype=torch.float32)
    reference = _REFERENCES[key]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False, deterministic=False):
        return reference.decode(codes)[:, 0]


def _profile_table(codec: Codec, gen, streams: int = 64, chunk: int = 8) -> None:
    """Where the time of an eager 64 x 8 step goes, by kernel name (top 14)."""
    from torch.profiler import ProfilerActivity, profile

    codes = _random_codes(codec, streams, 3 * chunk, gen)
    pool = codec.stream_pool(streams)
    streams_ = [pool.open() for _ in range(streams)]
    pool.step(streams_, [c[:, :chunk] for c in codes])
    _sync(codec.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in (1, 2):
            pool.step(streams_, [c[:, i * chunk : (i + 1) * chunk] for c in codes])
        _sync(codec.device)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.device_time_total for e in events) / 2  # per step, in us
    if not total:
        print("profile: no CUDA kernel events recorded")
        return
    print(f"profile: eager {streams} x {chunk}, GPU kernel time {total / 1e3:.2f} ms/step")
    for e in sorted(events, key=lambda e: -e.device_time_total)[:14]:
        share = e.device_time_total / 2 / total
        print(f"  {e.device_time_total / 2e3:7.2f} ms {100 * share:5.1f}% {e.count // 2:4d}x  {e.key[:90]}")


def _diagnose(codec: Codec, config: CodecConfig | None, gen) -> dict:
    """Graph replay vs eager (same and different shapes) vs bf16 full decode vs true fp32."""
    codes = _random_codes(codec, 4, 24, gen)
    reference = _fp32_reference(codec, config, codes)
    same = [[4] * 6] * 4  # every step 4 rows x 4 frames: eager shapes == the graph's bucket
    mixed = [[4] * 6, [2, 4, 1, 4, 4, 4, 4, 1], [8, 8, 8], [1, 3, 4, 8, 8]]  # pads differently
    graph_pool = codec.stream_pool(8)
    graph_pool.capture_cuda_graphs(batch_sizes=[2, 4], chunk_frames=[4, 8])
    out = {}
    for name, schedule in (("same", same), ("mixed", mixed)):
        out[f"graph_{name}"] = _feed(graph_pool, codes, schedule)
        out[f"eager_{name}"] = _feed(codec.stream_pool(8), codes, schedule)
    out["full_bf16"] = codec.decode(codes)[:, 0].float()
    rms = reference.pow(2).mean().sqrt().item()

    def stats(a, b):
        d = (a - b).abs()
        rel = ((a - b).pow(2).mean().sqrt() / rms).item()
        nonzero = (d > 0).float().mean().item()
        return f"max {d.max().item():.2e} mean {d.mean().item():.2e} rel_rms {rel:.2e} nonzero {nonzero:.3f}"

    print(f"diagnose (reference rms {rms:.3f}):")
    pairs = [("graph_same", "eager_same"), ("graph_mixed", "eager_mixed"), ("eager_same", "eager_mixed"),
             ("eager_same", "full_bf16")]  # fmt: skip
    for a, b in pairs:
        print(f"  {a:>11} vs {b:<11} {stats(out[a], out[b])}")
    for a in out:
        print(f"  {a:>11} vs fp32        {stats(out[a], reference)}")
    return {"mode": "diagnose"}


def _feed(pool, codes: torch.Tensor, schedules: list[list[int]]) -> torch.Tensor:
    """Stream each row of codes through `pool` in its own chunk schedule; [B, samples] float."""
    streams = [pool.open() for _ in schedules]
    offsets, parts = [0] * len(streams), [[] for _ in streams]
    for step in range(max(len(s) for s in schedules)):
        chunks = []
        for i, schedule in enumerate(schedules):
            take = schedule[step] if step < len(schedule) else 0
            chunks.append(codes[i, :, offsets[i] : offsets[i] + take])
            offsets[i] += take
        for i, audio in enumerate(pool.step(streams, chunks)):
            parts[i].append(audio)
    for s in streams:
        s.close()
    return torch.stack([torch.cat(p) for p in parts]).float()


def _accuracy_row(codec: Codec, config: CodecConfig | None, chunk: int, graphs: bool, gen) -> dict:
    """Streamed audio in the bench dtype vs a float32 full decode of the same codes."""
    codes = _random_codes(codec, 2, 8 * chunk, gen)
    _, audio = _time_streaming(codec, codes, chunk, steps=7, graphs=graphs)
    streamed = torch.stack([torch.cat(parts) for parts in audio]).float()
    reference = _fp32_reference(codec, config, codes)
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
        times = [_wall_seconds(codec.device, lambda audio=audio: codec.encode(audio)) for _ in range(3)]
        elapsed = sorted(times)[1]  # median of three
        row[f"audio_s_per_s_b{batch}"] = batch * seconds / elapsed
        print(
            f"encode    {batch:>7} {seconds:>4.0f}s {1e3 * elapsed:>8.2f} {batch * seconds / elapsed:>10.0f}"
        )
    return row
