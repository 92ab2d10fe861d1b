"""`shoal synth "text" --checkpoint DIR -o out.mp3`: one synthesis on this machine, no server.

It runs the engine the server runs (`shoal.engine.load_engine`: continuous batching, the
vocoder, CUDA graphs on a GPU), in this process: text -> `SynthesisRequest` -> streamed audio
chunks -> format encoder -> file. The engine splits long text into batches exactly as it does
for `/v1/tts` (speaker turns kept whole, `--chunk-length` bytes each), each batch prompted with
the earlier batches' text and codes. The output is written to `OUT.part` as the audio arrives
and renamed when complete, so a failed or interrupted run leaves no half file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import numpy as np

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

# Output file suffix -> format; anything else needs --format.
SUFFIX_FORMATS = {"wav": "wav", "mp3": "mp3", "opus": "opus", "ogg": "opus", "pcm": "pcm", "raw": "pcm"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("text", help="the text to speak (S2: <|speaker:N|> tags start speaker turns)")
    parser.add_argument("--checkpoint", required=True, help="model directory or Hugging Face repo id")
    parser.add_argument(
        "--codec",
        type=Path,
        help="the codec file (default: codec.pth, or 1.5's Firefly generator, in the checkpoint directory)",
    )
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        required=True,
        help=f"output file; its suffix sets the format ({', '.join('.' + s for s in SUFFIX_FORMATS)})",
    )
    parser.add_argument("--format", choices=FORMATS, help="output format, whatever the -o suffix")
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
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument(
        "--weight-format", choices=("bf16", "fp8"), help="as for `shoal serve` (default: the checkpoint's)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress line")


def output_format(requested: str | None, output: Path) -> str:
    """The explicit --format, else the format the output suffix names; an unknown or missing
    suffix is an error (never a wav under another name)."""
    if requested:
        return requested
    suffix = output.suffix.lower().lstrip(".")
    if suffix not in SUFFIX_FORMATS:
        known = ", ".join("." + s for s in SUFFIX_FORMATS)
        what = f"suffix .{suffix}" if suffix else "no suffix"
        raise AudioFormatError(f"-o {output} has {what}: use one of {known}, or pass --format")
    return SUFFIX_FORMATS[suffix]


def read_reference_clips(clips: list[Path], texts: list[str]) -> list[tuple[np.ndarray, str]]:
    """Each clip decoded (any upload format) to mono at the codec rate, with its transcript;
    done before any model loads, so a bad clip fails at once."""
    if len(clips) != len(texts):
        raise ValueError(f"got {len(clips)} --reference clips but {len(texts)} --reference-text values")
    return [
        (decode_audio(clip.read_bytes(), sample_rate=SAMPLE_RATE), text)
        for clip, text in zip(clips, texts, strict=True)
    ]


class Progress:
    """One status line on stderr: frames and audio seconds so far, the speed, and an ETA. The
    model decides when it stops, so the ETA is an upper bound: every text batch running to
    `--max-frames`."""

    def __init__(self, max_frames: int, frame_rate: float, enabled: bool) -> None:
        self.max_frames = max_frames
        self.frame_rate = frame_rate
        self.enabled = enabled
        self.started = time.perf_counter()
        self.frames = 0
        self.tty = sys.stderr.isatty()
        self._last_print = 0.0

    def update(self, frames: int) -> None:
        self.frames += frames
        now = time.perf_counter()
        if self.enabled and (now - self._last_print >= (0.2 if self.tty else 5.0)):
            self._last_print = now
            self._print(self.line(now - self.started), final=False)

    def line(self, elapsed: float, done: bool = False) -> str:
        rate = self.frames / elapsed if elapsed > 0 else 0.0
        text = (
            f"{self.frames} frames, {self.frames / self.frame_rate:.1f} s of audio in {elapsed:.1f} s "
            f"({rate:.1f} frames/s, {rate / self.frame_rate:.2f}x real time)"
        )
        if done:
            return text
        left = f"<= {(self.max_frames - self.frames) / rate:.0f} s" if rate > 0 else "?"
        return f"{text}, ETA {left}"

    def close(self) -> None:
        """The final line: the totals."""
        if self.enabled:
            self._print(self.line(time.perf_counter() - self.started, done=True), final=True)

    def _print(self, text: str, final: bool) -> None:
        if self.tty:
            sys.stderr.write("\r\033[K" + text + ("\n" if final else ""))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()


class Synthesizer:
    """The engine loaded for one process's syntheses: `stream` yields each request's audio as
    the vocoder decodes it. Use as `async with Synthesizer(...) as synthesizer:`."""

    def __init__(
        self,
        checkpoint: str | Path,
        codec_path: str | Path | None = None,
        device: str | None = None,
        weight_format: str | None = None,
    ) -> None:
        import torch

        from shoal.engine import load_engine

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        # Warm-up pays compilation and graph replays up front for a server's first clients;
        # on the CPU there is nothing to pay ahead, and one synthesis would only wait longer.
        self.engine = load_engine(
            checkpoint, codec=codec_path, device=device, weight_format=weight_format,
            warmup=device.startswith("cuda"),
        )  # fmt: skip
        self.family = self.engine.core.model.config.family

    @property
    def sample_rate(self) -> int:
        return self.engine.sample_rate

    @property
    def frame_rate(self) -> float:
        return self.engine.frame_rate

    async def __aenter__(self) -> Synthesizer:
        await self.engine.start()
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.engine.stop()

    async def reference(self, samples: np.ndarray, text: str):
        """A voice reference from mono float32 audio at the codec rate (encoded once)."""
        from shoal.engine.api import VoiceReference

        return VoiceReference(text, await self.engine.encode_reference(samples, SAMPLE_RATE))

    def text_batches(self, text: str, chunk_length: int) -> int:
        """How many text batches the engine will run for `text`."""
        from shoal.models.prompt import split_text

        return max(1, len(split_text(text, chunk_length, self.family)))

    async def stream(
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
    ) -> AsyncIterator[np.ndarray]:
        """Mono float32 audio in [-1, 1] at `sample_rate`, chunk by chunk as it is decoded."""
        from shoal.engine.api import FinishReason, SamplingOptions, SynthesisRequest

        request = SynthesisRequest(
            text=text,
            references=tuple(references),
            sampling=SamplingOptions(temperature, top_p, top_k, repetition_penalty, seed),
            max_new_frames=max_frames,
            chunk_length=chunk_length,
        )
        handle = self.engine.submit(request)
        try:
            async for chunk in handle:
                yield np.clip(chunk.samples, -1.0, 1.0)
        finally:
            await handle.aclose()
        if handle.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            cause = f": {self.engine.last_error}" if self.engine.last_error else ""
            raise RuntimeError(f"synthesis ended with {handle.finish_reason}{cause}")


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


async def synthesize_to_file(args: argparse.Namespace, encoder, partial: Path) -> int:
    """Load, synthesize into `partial` as the audio arrives; returns the samples written."""
    from shoal.engine.api import InvalidRequest

    clips = read_reference_clips(args.reference, args.reference_text)
    synthesizer = Synthesizer(args.checkpoint, args.codec, args.device, args.weight_format)
    if synthesizer.sample_rate != SAMPLE_RATE:
        raise ValueError(f"codec sample rate {synthesizer.sample_rate} is not {SAMPLE_RATE}")
    samples = 0
    async with synthesizer:
        try:
            references = [await synthesizer.reference(audio, text) for audio, text in clips]
            batches = synthesizer.text_batches(args.text, args.chunk_length)
            progress = Progress(batches * args.max_frames, synthesizer.frame_rate, not args.quiet)
            frame_length = round(synthesizer.sample_rate / synthesizer.frame_rate)
            chunks = synthesizer.stream(
                args.text,
                references,
                seed=args.seed,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                repetition_penalty=args.repetition_penalty,
                max_frames=args.max_frames,
                chunk_length=args.chunk_length,
            )
            with partial.open("wb") as file:
                async for audio in chunks:
                    samples += audio.size
                    progress.update(audio.size // frame_length)
                    file.write(encoder.write(audio))
                file.write(encoder.finish())
            progress.close()
        except InvalidRequest as error:
            raise ValueError(str(error)) from error
    return samples


def run(args: argparse.Namespace) -> int:
    if args.seed is None:
        args.seed = random.randrange(2**31)
    problem = usage_error(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        fmt = output_format(args.format, args.output)
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
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        samples = asyncio.run(synthesize_to_file(args, encoder, partial))
        partial.replace(args.output)
    except (AudioDecodeError, CheckpointError, ValueError, OSError, RuntimeError) as error:
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
        f"wrote {args.output.resolve()} ({fmt}, {encoder.sample_rate} Hz, {seconds:.2f} s of audio, "
        f"seed {args.seed}) in {elapsed:.1f} s",
        file=sys.stderr,
    )
    return 0
