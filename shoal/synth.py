"""`shoal synth "text" --checkpoint DIR -o out.mp3`: one synthesis on this machine, no server.

Text -> prompt -> the reference generator (`shoal.models.reference`, the oracle the engine is
tested against) -> codec decode -> format encoder -> file. Long texts are split into batches
as the reference's `generate_long` does, each batch prompted with the earlier batches' text and
codes; each batch's audio is encoded and written as soon as it is decoded.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from shoal.models.checkpoint import CheckpointError
from shoal.server.audio import (
    FORMATS,
    MP3_BITRATES_KBPS,
    OPUS_AUTO_BITRATE,
    SAMPLE_RATE,
    AudioDecodeError,
    AudioFormatError,
    create_encoder,
    decode_audio,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the text to speak (S2: <|speaker:N|> tags start speaker turns)")
    parser.add_argument("--checkpoint", required=True, help="model directory or Hugging Face repo id")
    parser.add_argument(
        "--codec",
        type=Path,
        help="the codec file (default: codec.pth, or 1.5's Firefly generator, in the checkpoint directory)",
    )
    parser.add_argument("-o", "--output", type=Path, required=True, help="output file")
    parser.add_argument(
        "--format", choices=FORMATS, help="output format (default: from the -o suffix, else wav)"
    )
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
    parser.add_argument(
        "--max-frames", type=int, default=1024, help="frames per text batch (21.5 per second)"
    )
    parser.add_argument("--chunk-length", type=int, default=200, help="S2: UTF-8 bytes per text batch")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def output_format(requested: str | None, output: Path) -> str:
    """The explicit --format, else the output suffix (.ogg/.opus -> opus, .raw -> pcm), else wav."""
    if requested:
        return requested
    suffix = output.suffix.lower().lstrip(".")
    return {"ogg": "opus", "raw": "pcm", "s16": "pcm"}.get(suffix, suffix if suffix in FORMATS else "wav")


def read_reference_clips(clips: list[Path], texts: list[str]) -> list[tuple[np.ndarray, str]]:
    """Each clip decoded (any upload format) to mono at the codec rate, with its transcript;
    done before any model loads, so a bad clip fails at once."""
    if len(clips) != len(texts):
        raise ValueError(f"got {len(clips)} --reference clips but {len(texts)} --reference-text values")
    return [
        (decode_audio(clip.read_bytes(), sample_rate=SAMPLE_RATE), text)
        for clip, text in zip(clips, texts, strict=True)
    ]


class Synthesizer:
    """A loaded model + codec that turns text into audio with the single-request reference
    generator; yields each text batch's audio as soon as the codec has decoded it."""

    def __init__(self, checkpoint: str | Path, codec_path: str | Path | None = None, device: str = "cpu"):
        from shoal.models import load_model
        from shoal.models.checkpoint import resolve_checkpoint_dir
        from shoal.models.codec import codec_file, load_codec

        directory = resolve_checkpoint_dir(checkpoint)  # a Hugging Face repo id is downloaded
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        self.model = load_model(directory, device=device, dtype=dtype)
        self.config = self.model.config
        self.codec = load_codec(codec_path or codec_file(directory), device=device)
        if self.codec.num_codebooks != self.config.num_codebooks:
            raise ValueError(
                f"the codec has {self.codec.num_codebooks} codebooks but the model expects "
                f"{self.config.num_codebooks}"
            )
        if self.codec.sample_rate != SAMPLE_RATE:
            raise ValueError(f"codec sample rate {self.codec.sample_rate} is not {SAMPLE_RATE}")

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    def reference(self, samples: np.ndarray, text: str):
        """A `prompt.Reference` from mono float32 audio at the codec rate (encoded once)."""
        from shoal.models.prompt import Reference

        audio = torch.from_numpy(samples).to(device=self.codec.device)
        return Reference(text, self.codec.encode(audio)[0].long().cpu())

    def generate(
        self,
        text: str,
        references: Sequence = (),
        *,
        seed: int,
        temperature: float = 0.8,
        top_p: float = 0.8,
        top_k: int = 30,
        repetition_penalty: float = 1.1,
        max_frames: int = 1024,
        chunk_length: int = 200,
        progress: bool = False,
    ) -> Iterator[np.ndarray]:
        """Mono float32 audio in [-1, 1] at `sample_rate`, one array per text batch. Batches
        follow the reference's `generate_long` (same split, history and per-batch seeds)."""
        from tqdm import tqdm

        from shoal.models.prompt import split_text
        from shoal.models.reference import iter_generate_long

        total = len(split_text(text, chunk_length, self.config.family))
        batches = iter_generate_long(
            self.model,
            text,
            references,
            chunk_length=chunk_length,
            max_frames=max_frames,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            repetition_penalty=repetition_penalty,
        )
        total_frames = 0
        bar = tqdm(
            batches, total=total, desc="synthesizing", unit="batch", disable=not progress, file=sys.stderr
        )
        for batch in bar:
            total_frames += batch.frames.shape[1]
            bar.set_postfix(frames=total_frames)
            if batch.codes.shape[1]:
                audio = self.codec.decode(batch.codes.to(self.codec.device))[0, 0].float().cpu().numpy()
                yield np.clip(audio, -1.0, 1.0)


def remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):  # e.g. its directory could not be created
        path.unlink(missing_ok=True)


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments themselves (exit status 2), checked before any work."""
    if not args.text.strip():
        return "the text is empty"
    if args.max_frames < 1:
        return f"--max-frames must be at least 1, got {args.max_frames}"
    if args.output.is_dir():
        return f"-o {args.output} is a directory; give a file name"
    return None


def run(args: argparse.Namespace) -> int:
    fmt = output_format(args.format, args.output)
    if args.seed is None:
        args.seed = random.randrange(2**31)
    problem = usage_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
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
    partial = args.output.with_name(args.output.name + ".part")
    samples = 0
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        clips = read_reference_clips(args.reference, args.reference_text)
        synthesizer = Synthesizer(args.checkpoint, args.codec, args.device)
        references = [synthesizer.reference(audio, text) for audio, text in clips]
        chunks = synthesizer.generate(
            args.text,
            references,
            seed=args.seed,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            max_frames=args.max_frames,
            chunk_length=args.chunk_length,
            progress=not args.quiet,
        )
        with partial.open("wb") as file:
            for audio in chunks:
                samples += audio.size
                file.write(encoder.write(audio))
            file.write(encoder.finish())
        partial.replace(args.output)
    except (AudioDecodeError, CheckpointError, ValueError, OSError) as error:
        remove_quietly(partial)
        message = error.message if isinstance(error, AudioDecodeError) else str(error)
        print(f"error: {message}", file=sys.stderr)
        return 1
    except BaseException:  # Ctrl-C, or a failure inside the model: never leave the .part behind
        remove_quietly(partial)
        raise
    seconds = samples / SAMPLE_RATE / args.speed
    elapsed = time.perf_counter() - started
    print(
        f"wrote {args.output} ({fmt}, {encoder.sample_rate} Hz, {seconds:.2f} s of audio, seed {args.seed}) "
        f"in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return 0
