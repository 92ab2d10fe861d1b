"""Word timings for generated speech: CTC forced alignment of the audio to the text it speaks.

The operator provides the aligner: a local wav2vec2-style CTC model directory (config.json,
vocab.json, weights, feature-extractor settings; e.g. `facebook/wav2vec2-base-960h`'s files),
loaded once with `transformers` and never downloaded at run time. The model gives per-frame
log-probabilities over its character vocabulary; `forced_align` finds the most likely path through
the CTC trellis (Viterbi: blanks between tokens, a blank required between two equal tokens) that
spells the known text, and `word_timings` turns the tokens' frame spans into word times.

The text goes through `AlignerVocab.spell`, an explicit normalisation to the vocabulary: control
tags (`<|speaker:0|>`) and bracketed cues (`[laugh]`) are not spoken and are dropped, letters are
cased like the vocabulary, accents are stripped where the vocabulary lacks the accented letter,
typographic apostrophes become `'`, and every other character the vocabulary lacks is dropped. A
word left with nothing to spell (a number, for an English letter vocabulary) shares the gap
between its aligned neighbours.

The algorithm is numpy; only `CtcAligner` and `load_aligner` use torch and `transformers`,
imported when an aligner is configured (the server layer otherwise never touches tensors). The
model sees long audio in 30 s windows; a chunk whose trellis would exceed MAX_TRELLIS_CELLS keeps
its chunk-level timing.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from shoal.server import audio

# Tokens the model speaks no sound for: Fish control tags and bracketed cues such as `[laugh]`.
UNSPOKEN_MARKUP = re.compile(r"<\|[^|>]*\|>|\[[^\]]*\]")
TYPOGRAPHIC_APOSTROPHES = {"\u2019": "'", "\u2018": "'", "\u02bc": "'", "\u0060": "'", "\u00b4": "'"}
NEGATIVE_INFINITY = -np.inf
# The Viterbi keeps one byte per frame and trellis state: beyond this many (about 5000 characters
# over 7 minutes at wav2vec2's 20 ms frames) a chunk keeps its chunk-level timing only.
MAX_TRELLIS_CELLS = 200_000_000
# The model sees long audio in windows of this length (its attention grows with the square of
# the frames); the windows' frames are concatenated. A last piece under half a window joins the
# window before it.
WINDOW_SECONDS = 30.0
MIN_AUDIO_SECONDS = 0.1  # shorter audio is no word (and shorter than the model's receptive field)


class AlignerError(Exception):
    """The aligner directory cannot be used (missing, not a CTC model, unreadable)."""


@dataclass(frozen=True)
class TokenSpan:
    """Frames [start, end) where the best path is on one target token."""

    start: int
    end: int


@dataclass(frozen=True)
class WordTiming:
    """One written word of the text and where it is spoken, in seconds from the audio's start."""

    text: str
    start: float
    end: float


# ------------------------------------------------------------------------------ normalisation


def spoken_words(text: str) -> list[str]:
    """The text's written words (whitespace-separated), without the markup nobody speaks."""
    return UNSPOKEN_MARKUP.sub(" ", text).split()


def strip_accents(character: str) -> str:
    """`é` -> `e`: the base characters of the compatibility decomposition, marks dropped."""
    decomposed = unicodedata.normalize("NFKD", character)
    return "".join(c for c in decomposed if not unicodedata.combining(c))


@dataclass(frozen=True)
class AlignerVocab:
    """A CTC character vocabulary: token -> id, the blank, the word delimiter (wav2vec2's `|`)
    and the case its letters are written in."""

    token_ids: Mapping[str, int]
    blank_id: int
    word_delimiter: str | None
    case: Literal["upper", "lower", "mixed"]

    @classmethod
    def from_tokens(
        cls, token_ids: Mapping[str, int], blank_id: int, word_delimiter: str | None
    ) -> AlignerVocab:
        letters = [
            token
            for token in token_ids
            if len(token) == 1 and token.isalpha() and token.lower() != token.upper()
        ]
        if letters and all(token.isupper() for token in letters):
            case: Literal["upper", "lower", "mixed"] = "upper"
        elif letters and all(token.islower() for token in letters):
            case = "lower"
        else:
            case = "mixed"
        delimiter = word_delimiter if word_delimiter in token_ids else None
        return cls(dict(token_ids), blank_id, delimiter, case)

    def _spellable(self, character: str) -> bool:
        token_id = self.token_ids.get(character)
        return token_id is not None and token_id != self.blank_id and character != self.word_delimiter

    def spell(self, word: str) -> list[str]:
        """The vocabulary's tokens for one written word (possibly none)."""
        if self.case == "upper":
            word = word.upper()
        elif self.case == "lower":
            word = word.lower()
        tokens: list[str] = []
        for character in word:
            character = TYPOGRAPHIC_APOSTROPHES.get(character, character)
            if self._spellable(character):
                tokens.append(character)
                continue
            tokens.extend(base for base in strip_accents(character) if self._spellable(base))
        return tokens


# ----------------------------------------------------------------------------------- viterbi


def forced_align(log_probs: np.ndarray, targets: Sequence[int], blank_id: int) -> list[TokenSpan] | None:
    """The most likely CTC path through `log_probs` [frames, vocab] that spells `targets`: each
    target's frame span, or None when there are too few frames to spell them (each token needs
    a frame, and two equal neighbours a blank frame between them).

    The trellis runs over the targets with a blank before, between and after them (2L+1 states).
    At each frame a state is kept, or entered from the state before it, or from two states
    before when that skips a blank between two different tokens."""
    frames = log_probs.shape[0]
    labels = np.asarray(targets, dtype=np.int64)
    if labels.size == 0:
        return []
    if frames == 0:
        return None
    states = np.full(2 * labels.size + 1, blank_id, dtype=np.int64)
    states[1::2] = labels
    count = states.size
    can_skip = np.zeros(count, dtype=bool)
    can_skip[3::2] = labels[1:] != labels[:-1]
    emissions = np.asarray(log_probs, dtype=np.float64)[:, states]
    score = np.full(count, NEGATIVE_INFINITY)
    score[:2] = emissions[0, :2]  # a path starts on the first blank or the first token
    moves = np.zeros((frames, count), dtype=np.int8)  # 0 stay, 1 from the state before, 2 skip
    columns = np.arange(count)
    for frame in range(1, frames):
        step = np.concatenate(([NEGATIVE_INFINITY], score[:-1]))
        skip = np.concatenate(([NEGATIVE_INFINITY] * 2, score[:-2]))
        skip[~can_skip] = NEGATIVE_INFINITY
        choices = np.stack((score, step, skip))
        best = np.argmax(choices, axis=0)  # ties keep the state: the earliest move wins
        score = choices[best, columns] + emissions[frame]
        moves[frame] = best
    last = count - 1 if score[-1] >= score[-2] else count - 2  # end on the last blank or the last token
    if not np.isfinite(score[last]):
        return None
    path = np.empty(frames, dtype=np.int64)
    state = last
    for frame in range(frames - 1, -1, -1):
        path[frame] = state
        state -= int(moves[frame, state])
    spans = []
    for index in range(labels.size):
        on_token = np.flatnonzero(path == 2 * index + 1)
        spans.append(TokenSpan(int(on_token[0]), int(on_token[-1]) + 1))
    return spans


def word_timings(
    words: Sequence[str],
    spelled: Sequence[Sequence[str]],
    spans: Sequence[TokenSpan],
    frame_times: np.ndarray,
    duration: float,
) -> list[WordTiming]:
    """Word times from the token spans of the spelled words (in order, delimiters excluded from
    `spans`); `frame_times[f]` is where frame f starts, one entry more than frames for the end.
    A word spelled with no token gets an equal share of the gap between its aligned neighbours
    (the audio's start and end at the edges). Times are clipped to `duration`."""
    aligned: list[tuple[float, float] | None] = []
    cursor = 0
    for tokens in spelled:
        if not tokens:
            aligned.append(None)
            continue
        first, last = spans[cursor], spans[cursor + len(tokens) - 1]
        cursor += len(tokens)
        aligned.append(
            (min(float(frame_times[first.start]), duration), min(float(frame_times[last.end]), duration))
        )
    timings: list[WordTiming] = []
    index = 0
    while index < len(words):
        if aligned[index] is not None:
            start, end = aligned[index]  # type: ignore[misc]
            timings.append(WordTiming(words[index], start, end))
            index += 1
            continue
        gap_end = index
        while gap_end < len(words) and aligned[gap_end] is None:
            gap_end += 1
        left = timings[-1].end if timings else 0.0
        right = aligned[gap_end][0] if gap_end < len(words) else duration  # type: ignore[index]
        share = max(right - left, 0.0) / (gap_end - index)
        for position in range(index, gap_end):
            start = left + share * (position - index)
            timings.append(WordTiming(words[position], start, start + share))
        index = gap_end
    return timings


def align_text(
    log_probs: np.ndarray, text: str, vocab: AlignerVocab, frame_times: np.ndarray, duration: float
) -> list[WordTiming] | None:
    """The words of `text` timed by the CTC emissions `log_probs` [frames, vocab] of audio lasting
    `duration` seconds (`frame_times` as for `word_timings`): the spelled words joined by the
    word delimiter (when the vocabulary has one) are force-aligned, then each word spans its
    first token's start to its last one's end. None when no word can be spelled, there are too
    few frames, or the trellis would be too big."""
    words = spoken_words(text)
    spelled = [vocab.spell(word) for word in words]
    targets: list[int] = []
    token_positions: list[int] = []  # where each spelled token sits in `targets`
    for tokens in (tokens for tokens in spelled if tokens):
        if targets and vocab.word_delimiter is not None:
            targets.append(vocab.token_ids[vocab.word_delimiter])
        for token in tokens:
            token_positions.append(len(targets))
            targets.append(vocab.token_ids[token])
    if not targets or log_probs.shape[0] * (2 * len(targets) + 1) > MAX_TRELLIS_CELLS:
        return None
    spans = forced_align(log_probs, targets, vocab.blank_id)
    if spans is None:
        return None
    token_spans = [spans[position] for position in token_positions]
    return word_timings(words, spelled, token_spans, frame_times, duration)


# ------------------------------------------------------------------------------------ model


def check_aligner_directory(path: str | Path) -> Path:
    """The directory, if it looks like a local CTC model (cheap: no weights are read), else an
    AlignerError that says what is wrong. Hub ids are refused: nothing is downloaded at run time."""
    directory = Path(path).expanduser()
    hint = (
        "--aligner needs a local wav2vec2-style CTC model directory (config.json, vocab.json, "
        "weights, preprocessor settings), e.g. `hf download facebook/wav2vec2-base-960h --local-dir DIR`"
    )
    if not directory.is_dir():
        raise AlignerError(f"{hint}; {str(path)!r} is not a directory")
    missing = [name for name in ("config.json", "vocab.json") if not (directory / name).is_file()]
    if missing:
        raise AlignerError(f"{hint}; {directory} has no {' or '.join(missing)}")
    return directory


class CtcAligner:
    """A loaded CTC model and its vocabulary: `align(samples, rate, text)` -> word timings.

    `submit` runs alignments on one worker thread of the aligner's own: one forward at a time
    (concurrent forwards on the CPU only slow each other), never holding the threads the audio
    encoders use, and a queued alignment whose stream has gone can still be cancelled."""

    def __init__(
        self,
        model: Any,
        feature_extractor: Any,
        vocab: AlignerVocab,
        sample_rate: int,
        samples_per_frame: int,
        window_seconds: float = WINDOW_SECONDS,
    ) -> None:
        self.model = model
        self.feature_extractor = feature_extractor
        self.vocab = vocab
        self.sample_rate = sample_rate
        self.samples_per_frame = samples_per_frame
        self.window_seconds = window_seconds
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shoal-aligner")

    @property
    def frame_seconds(self) -> float:
        return self.samples_per_frame / self.sample_rate

    def log_probs(self, samples: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-frame log-probabilities [frames, vocab] of mono float audio at `sample_rate`, and
        where each frame starts (seconds; one entry more for the end). The model sees one window
        of `window_seconds` at a time (the last up to 1.5 times that); a window's frames start at
        its own first sample, since a convolution stack yields slightly fewer frames than
        samples / stride."""
        import torch

        frames_per_window = max(1, int(self.window_seconds * self.sample_rate) // self.samples_per_frame)
        window = self.samples_per_frame * frames_per_window
        starts = list(range(0, len(samples), window))
        if len(starts) > 1 and len(samples) - starts[-1] < window / 2:
            starts.pop()  # the short tail joins the window before it
        ends = [*starts[1:], len(samples)]
        pieces, times = [], []
        for start, end in zip(starts, ends, strict=True):
            features = self.feature_extractor(
                samples[start:end], sampling_rate=self.sample_rate, return_tensors="pt"
            )
            with torch.inference_mode():
                logits = self.model(features.input_values.to(self.model.dtype)).logits[0]
                pieces.append(torch.log_softmax(logits.float(), dim=-1).numpy())
            times.append(start / self.sample_rate + np.arange(len(pieces[-1])) * self.frame_seconds)
        frame_times = np.concatenate([*times, [len(samples) / self.sample_rate]])
        return np.concatenate(pieces), frame_times

    def submit(self, samples: np.ndarray, sample_rate: int, text: str) -> Future[list[WordTiming] | None]:
        """`align` on the aligner's worker thread."""
        return self._worker.submit(self.align, samples, sample_rate, text)

    def align(self, samples: np.ndarray, sample_rate: int, text: str) -> list[WordTiming] | None:
        """The words of `text` timed in `samples` (mono float at `sample_rate`); None when no word
        can be spelled in the vocabulary or the audio is too short for the text."""
        duration = len(samples) / sample_rate
        if duration < MIN_AUDIO_SECONDS or not any(self.vocab.spell(word) for word in spoken_words(text)):
            return None  # nothing to align: skip the forward
        log_probs, frame_times = self.log_probs(resample(samples, sample_rate, self.sample_rate))
        return align_text(log_probs, text, self.vocab, frame_times, duration)


def resample(samples: np.ndarray, rate: int, target_rate: int) -> np.ndarray:
    """Mono float audio at `target_rate` (libswresample, through the server's pcm encoder)."""
    if rate == target_rate:
        return np.asarray(samples, dtype=np.float32)
    pcm = audio.encode_audio(samples, "pcm", input_sample_rate=rate, sample_rate=target_rate)
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def load_aligner(path: str | Path, window_seconds: float = WINDOW_SECONDS) -> CtcAligner:
    """Load the CTC model directory with `transformers`, local files only (AlignerError if it
    cannot be used)."""
    directory = check_aligner_directory(path)
    try:
        from transformers import AutoModelForCTC, AutoProcessor
    except ImportError as error:
        raise AlignerError(
            "--aligner needs the `transformers` package: pip install 'shoal[align]'"
        ) from error
    try:
        processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
        model = AutoModelForCTC.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AlignerError(f"cannot load the CTC aligner from {directory}: {error}") from error
    tokenizer = getattr(processor, "tokenizer", None)
    feature_extractor = getattr(processor, "feature_extractor", None)
    if tokenizer is None or feature_extractor is None:
        raise AlignerError(f"{directory}: the aligner needs a CTC tokenizer and a feature extractor")
    blank_id = model.config.pad_token_id if model.config.pad_token_id is not None else tokenizer.pad_token_id
    if blank_id is None:
        raise AlignerError(f"{directory}: the model config names no pad (CTC blank) token")
    samples_per_frame = getattr(model.config, "inputs_to_logits_ratio", None)
    if samples_per_frame is None:
        samples_per_frame = int(np.prod(getattr(model.config, "conv_stride", [1])))
    vocab = AlignerVocab.from_tokens(
        tokenizer.get_vocab(), int(blank_id), getattr(tokenizer, "word_delimiter_token", None)
    )
    model.eval()
    rate = int(feature_extractor.sampling_rate)
    return CtcAligner(model, feature_extractor, vocab, rate, int(samples_per_frame), window_seconds)
