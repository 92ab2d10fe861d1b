"""`shoal synth "text" --checkpoint DIR -o out.mp3`: one synthesis on this machine, no server.

Text -> prompt -> the reference generator (`shoal.models.reference`, the oracle the engine is
tested against) -> codec decode -> format encoder -> file. Long texts are split into batches
as the reference's `generate_long` does, each batch prompted with the earlier batches' text and
codes; each batch's audio is encoded and written as soon as it is decoded.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from shoal.server.audio import (
    FORMATS,
    MP3_BITRATES_KBPS,
    OPUS_AUTO_BITRATE,
    AudioDecodeError,
    AudioFormatError,
    create_encoder,
    decode_audio,
)

DEFAULT_CODEC_FILE = "codec.pth"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the text to speak (S2: <|speaker:N|> tags start speaker turns)")
    parser.add_argument("--checkpoint", required=True, help="model directory or Hugging Face repo id")
    parser.add_argument("--codec", type=Path, help="codec.pth (default: codec.pth in the checkpoint directory)")
    parser.add_argument("-o", "--output", type=Path, required=True, help="output file")
    parser.add_argument("--format", choices=FORMATS, help="output format (default: from the -o suffix, else wav)")
    parser.add_argument("--sample-rate", type=int, help="output rate (default 44100; 48000 for opus)")
    parser.add_argument("--mp3-bitrate", type=int, choices=MP3_BITRATES_KBPS, default=128, help="kbps")
    parser.add_argument(
        "--opus-bitrate", type=int, default=OPUS_AUTO_BITRATE, help="kbps or bps; -1000 = auto"
    )
    parser.add_argument("--speed", type=float, default=1.0, help="0.5-2.0, pitch kept")
    parser.add_argument("--volume", type=float, default=0.0, help="gain in dB")
    parser.add_argument(
        "--reference", type=Path, action="append", default=[], help="voice clip (repeat for several speakers)"
    )
    parser.add_argument(
        "--reference-text", action="append", default=[], help="transcript of each --reference, in order"
    )
    parser.add_argument("--seed", type=int, help="sampling seed (default: random, printed)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=30, help="S2 only")
    parser.add_argument("--repetition-penalty", type=float, default=1.1, help="S1 only")
    parser.add_argument("--max-frames", type=int, default=1024, help="frames per text batch (21.5 per second)")
    parser.add_argument("--chunk-length", type=int, default=200, help="S2: UTF-8 bytes per text batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def output_format(requested: str | None, output: Path) -> str:
    """The explicit --format, else the output suffix (.ogg/.opus -> opus, .raw -> pcm), else wav."""
    if requested:
        return requested
    suffix = output.suffix.lower().lstrip(".")
    return {"ogg": "opus", "raw": "pcm", "s16": "pcm"}.get(suffix, suffix if suffix in FORMATS else "wav")


def load_references(codec, clips: list[Path], texts: list[str]) -> list:
    """Each clip decoded (any upload format), resampled to the codec rate and encoded once."""
    from shoal.models.prompt import Reference

    if len(clips) != len(texts):
        raise ValueError(f"got {len(clips)} --reference clips but {len(texts)} --reference-text values")
    references = []
    for clip, text in zip(clips, texts, strict=True):
        samples = decode_audio(clip.read_bytes(), sample_rate=codec.sample_rate)
        audio = torch.from_numpy(samples).to(device=codec.device)
        references.append(Reference(text, codec.encode(audio)[0].long().cpu()))
    return references


def synthesize(args: argparse.Namespace, encoder, write_bytes) -> tuple[int, int]:
    """Generate `args.text` batch by batch, handing each batch's encoded audio to `write_bytes`.
    Returns (frames generated, samples written at the codec rate)."""
    from tqdm import tqdm

    from shoal.models import load_model
    from shoal.models.codec import load_codec
    from shoal.models.prompt import Turn, build_prompt, codes_for_codec, split_text
    from shoal.models.reference import batch_seed, generate

    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = load_model(args.checkpoint, device=args.device, dtype=dtype)
    config = model.config
    if config.family == "1.5":
        raise ValueError("shoal synth supports S2 and S1-mini checkpoints (the 1.5 codec is not implemented)")
    codec_path = args.codec or Path(args.checkpoint) / DEFAULT_CODEC_FILE
    codec = load_codec(codec_path, device=args.device, dtype=torch.float32)
    if codec.num_codebooks != config.num_codebooks:
        raise ValueError(
            f"the codec has {codec.num_codebooks} codebooks but the model expects {config.num_codebooks}"
        )
    if codec.sample_rate != encoder.input_sample_rate:
        raise ValueError(f"codec rate {codec.sample_rate} != encoder input rate {encoder.input_sample_rate}")
    references = load_references(codec, args.reference, args.reference_text)

    batches = split_text(args.text, args.chunk_length, config.family)
    history: list[Turn] = []
    total_frames = total_samples = 0
    progress = tqdm(batches, desc="synthesizing", unit="batch", disable=args.quiet, file=sys.stderr)
    for index, batch_text in enumerate(progress):
        prompt = build_prompt(config, model.tokenizer, batch_text, references, history)
        frames = generate(
            model,
            prompt,
            max_frames=args.max_frames,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=batch_seed(args.seed, index),
            repetition_penalty=args.repetition_penalty,
        )
        history.append(Turn(batch_text, frames))
        codes = codes_for_codec(frames)
        total_frames += frames.shape[1]
        progress.set_postfix(frames=total_frames)
        if codes.shape[1] == 0:
            continue
        audio = codec.decode(codes.to(codec.device))[0, 0].float().cpu().numpy()
        total_samples += audio.size
        write_bytes(encoder.write(np.clip(audio, -1.0, 1.0)))
    write_bytes(encoder.finish())
    return total_frames, total_samples


def run(args: argparse.Namespace) -> int:
    fmt = output_format(args.format, args.output)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    try:
        # Build the encoder first: a bad rate or bitrate fails before the model loads.
        encoder = create_encoder(
            fmt,
            sample_rate=args.sample_rate,
            mp3_bitrate=args.mp3_bitrate,
            opus_bitrate=args.opus_bitrate,
            speed=args.speed,
            volume_db=args.volume,
            streaming=False,  # a file: the wav header carries its real size
        )
    except AudioFormatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    partial = args.output.with_name(args.output.name + ".part")
    try:
        with partial.open("wb") as file:
            frames, samples = synthesize(args, encoder, file.write)
    except (AudioDecodeError, ValueError, OSError) as error:
        partial.unlink(missing_ok=True)
        message = error.message if isinstance(error, AudioDecodeError) else str(error)
        print(f"error: {message}", file=sys.stderr)
        return 1
    partial.replace(args.output)
    seconds = samples / encoder.input_sample_rate / args.speed
    elapsed = time.perf_counter() - started
    print(
        f"wrote {args.output} ({fmt}, {encoder.sample_rate} Hz, {seconds:.2f} s of audio from {frames} "
        f"frames, seed {args.seed}) in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return 0
