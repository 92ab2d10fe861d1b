"""Per-family prompt builders: text + reference voices -> the int prompt `[N+1, T]`.

The prompt is a list of *parts*, strings and code blocks, each tokenized separately and
concatenated, exactly as the reference's ContentSequence does: BPE never merges across a part
boundary, so the part split decides the token ids (research/model.md 7.2). A code block `[N, T]`
becomes T columns with row 0 = `semantic_begin_id + codes[0]` and rows 1..N = the codes; text
columns have zeros in rows 1..N.

Templates (`|` separates parts, CODES a code block):

- S2:  `<|im_start|>system\\n` | `convert the provided text to speech reference to the following:
  \\n\\nText:\\n` | `<|speaker:0|>ref0\\n<|speaker:1|>ref1` | `\\n\\nSpeech:\\n` | CODES(all refs) |
  `<|im_end|>\\n` | (`<|im_start|>user\\n` | earlier text | `<|im_end|>\\n` |
  `<|im_start|>assistant\\n<|voice|>` | CODES(earlier audio) | `<|im_end|>\\n`)* |
  `<|im_start|>user\\n` | text | `<|im_end|>\\n` | `<|im_start|>assistant\\n<|voice|>`.
  Without references the system text is `convert the provided text to speech`.
- S1:  `<|interleave|>` | (`<|speaker:0|>` | ref | CODES | `<|im_end|>`)* | `<|speaker:0|>` | text.
- 1.5: `<|im_start|>system\\n` | `Speak out the provided text.` | `<|im_end|>` |
  (`<|im_start|>user\\n` | ref | `<|im_end|>` | `<|im_start|>assistant\\n` | `<|voice|>` | CODES |
  `<|im_end|>`)* | (earlier turns) | `<|im_start|>user\\n` | text | `<|im_end|>` |
  `<|im_start|>assistant\\n` | `<|voice|>`; texts pass through 1.5's `clean_text`.

The leading parts that depend only on the voice (system turn and references) form the voice
prefix: `VoicePrompt` tokenizes it once, and the engine's prefix cache shares its KV pages under
its content key (`voice_prefix_key`).
"""

from __future__ import annotations

import functools
import hashlib
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from shoal.models.tokenizer import Tokenizer


@dataclass(frozen=True)
class RawFrames:
    """Generated frames [N+1, F] copied into the prompt as they are (1.5's history segments)."""

    frames: Tensor


Part = str | Tensor | RawFrames


class PromptConfig(Protocol):
    """What the builders need of a model config (a ModelConfig satisfies it)."""

    family: str
    num_codebooks: int


SPEAKER_TAG = re.compile(r"<\|speaker:\d+\|>")
S2_MAX_TURNS_PER_BATCH = 5
# Fish Speech 1.5's `max_length` for long text (its `generate_long` default): the sliding history
# keeps what fits in max_length - 1024 - voice prefix columns.
V15_MAX_LENGTH = 2048


@dataclass(frozen=True)
class Reference:
    """A reference voice: its transcript and its codec codes, Long [N, T]."""

    text: str
    codes: Tensor


@dataclass(frozen=True)
class Turn:
    """An earlier batch of the same long text and the frames generated for it, int [N+1, F]
    exactly as `reference.generate` returned them (the stopping frame included, if any)."""

    text: str
    frames: Tensor


def codes_for_codec(frames: Tensor) -> Tensor:
    """The codes the reference hands to the codec from generated frames [N+1, F]: rows 1..N
    without the last frame (`y[1:, prompt_len:-1]`), dropped even when generation stopped at
    max_frames rather than at `<|im_end|>` (the reference's "last frame dropped" quirk)."""
    return frames[1:, :-1]


# ---------------------------------------------------------------------------------------------
# Templates


@dataclass
class PromptParts:
    parts: list[Part]
    voice_parts: int  # how many leading parts depend only on the voice


def s2_parts(text: str, references: Sequence[Reference], history: Sequence[Turn] = ()) -> PromptParts:
    parts: list[Part] = ["<|im_start|>system\n"]
    if references:
        tagged = [
            ref.text if SPEAKER_TAG.search(ref.text) else f"<|speaker:{i}|>{ref.text}"
            for i, ref in enumerate(references)
        ]
        parts += [
            "convert the provided text to speech reference to the following:\n\nText:\n",
            "\n".join(tagged),
            "\n\nSpeech:\n",
            torch.cat([ref.codes for ref in references], dim=1),
        ]
    else:
        parts.append("convert the provided text to speech")
    parts.append("<|im_end|>\n")
    voice_parts = len(parts)
    for turn in history:
        parts += ["<|im_start|>user\n", turn.text, "<|im_end|>\n"]
        parts += ["<|im_start|>assistant\n<|voice|>", codes_for_codec(turn.frames), "<|im_end|>\n"]
    parts += ["<|im_start|>user\n", text, "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"]
    return PromptParts(parts, voice_parts)


def s1_parts(text: str, references: Sequence[Reference], history: Sequence[Turn] = ()) -> PromptParts:
    if history:
        raise ValueError("the S1 reference generates the whole text at once: no history turns")
    parts: list[Part] = ["<|interleave|>"]
    for ref in references:
        parts += ["<|speaker:0|>", ref.text, ref.codes, "<|im_end|>"]
    voice_parts = len(parts)
    parts += ["<|speaker:0|>", text]
    return PromptParts(parts, voice_parts)


def v15_parts(text: str, references: Sequence[Reference], history: Sequence[Turn] = ()) -> PromptParts:
    """1.5: earlier turns are appended as the reference's `global_encoded` segments: the user
    turn, then the generated frames as they came out (the `<|im_end|>` frame included)."""
    parts: list[Part] = ["<|im_start|>system\n", "Speak out the provided text.", "<|im_end|>"]
    for ref in references:
        parts += ["<|im_start|>user\n", clean_text(ref.text), "<|im_end|>"]
        parts += ["<|im_start|>assistant\n", "<|voice|>", ref.codes, "<|im_end|>"]
    voice_parts = len(parts)
    for turn in history:
        parts += _v15_user_turn(turn.text)
        parts.append(RawFrames(turn.frames))
    parts += _v15_user_turn(text)
    return PromptParts(parts, voice_parts)


def _v15_user_turn(text: str) -> list[Part]:
    return ["<|im_start|>user\n", clean_text(text), "<|im_end|>", "<|im_start|>assistant\n", "<|voice|>"]


_TEMPLATES = {"s2": s2_parts, "s1": s1_parts, "1.5": v15_parts}


def prompt_parts(
    family: str, text: str, references: Sequence[Reference] = (), history: Sequence[Turn] = ()
) -> PromptParts:
    try:
        template = _TEMPLATES[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}") from None
    return template(text, references, history)


# ---------------------------------------------------------------------------------------------
# Encoding


def encode_parts(tokenizer: Tokenizer, parts: Sequence[Part], num_codebooks: int) -> Tensor:
    """Tokenize each part on its own and lay the result out as Long [N+1, T]."""
    columns: list[Tensor] = []
    for part in parts:
        if isinstance(part, RawFrames):
            block = part.frames.to(torch.long)
            if block.shape[0] != num_codebooks + 1:
                raise ValueError(f"history frames have {block.shape[0]} rows, expected {num_codebooks + 1}")
        elif isinstance(part, Tensor):
            codes = part.to(torch.long)
            if codes.ndim != 2 or codes.shape[0] != num_codebooks:
                raise ValueError(f"reference codes must be [{num_codebooks}, T], got {list(codes.shape)}")
            if codes.numel() and (codes.min() < 0 or codes.max() >= tokenizer.num_semantic_tokens):
                raise ValueError("reference codes out of the tokenizer's semantic range")
            block = torch.cat([codes[:1] + tokenizer.semantic_begin_id, codes], dim=0)
        else:
            ids = torch.tensor(tokenizer.encode(part), dtype=torch.long)
            block = torch.zeros(num_codebooks + 1, len(ids), dtype=torch.long)
            block[0] = ids
        columns.append(block)
    if not columns:
        return torch.zeros(num_codebooks + 1, 0, dtype=torch.long)
    return torch.cat(columns, dim=1)


def voice_prefix_key(prefix: Tensor) -> str:
    """Content key of a voice prefix's columns [N+1, P]: prompts that start with the same voice
    prefix share its KV pages under this key in the engine's prefix cache."""
    columns = prefix.to(torch.int64).cpu().contiguous()
    return hashlib.sha256(columns.numpy().tobytes() + str(tuple(columns.shape)).encode()).hexdigest()


class VoicePrompt:
    """Prompts in one voice: the voice prefix (system turn and references, the same whatever the
    text) is tokenized once here, and every prompt built here starts with those columns."""

    def __init__(
        self, config: PromptConfig, tokenizer: Tokenizer, references: Sequence[Reference] = ()
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.references = tuple(references)
        layout = prompt_parts(config.family, "", self.references)
        self.prefix = encode_parts(tokenizer, layout.parts[: layout.voice_parts], config.num_codebooks)

    @functools.cached_property
    def key(self) -> str:
        """The voice's identity in the engine's prefix cache (`voice_prefix_key` of the prefix)."""
        return voice_prefix_key(self.prefix)

    def build(self, text: str, history: Sequence[Turn] = ()) -> Tensor:
        """The prompt Long [N+1, T] saying `text` after `history` (earlier batches of a long
        text, oldest first): the voice prefix, then the rest tokenized part by part."""
        layout = prompt_parts(self.config.family, text, self.references, history)
        rest = encode_parts(self.tokenizer, layout.parts[layout.voice_parts :], self.config.num_codebooks)
        return torch.cat([self.prefix, rest], dim=1)


def build_prompt(
    config: PromptConfig,
    tokenizer: Tokenizer,
    text: str,
    references: Sequence[Reference] = (),
    history: Sequence[Turn] = (),
) -> Tensor:
    """The prompt Long [N+1, T] for `config.family`. `history`: earlier batches of a long text
    (S2, 1.5), oldest first."""
    return VoicePrompt(config, tokenizer, references).build(text, history)


def voice_prefix_length(
    config: PromptConfig, tokenizer: Tokenizer, references: Sequence[Reference] = ()
) -> int:
    """Leading prompt columns that depend only on the voice (system turn + references): every
    prompt built with these references starts with the same ids there, whatever the text."""
    return VoicePrompt(config, tokenizer, references).prefix.shape[1]


# ---------------------------------------------------------------------------------------------
# Long text


def split_speaker_turns(text: str) -> list[str]:
    """S2: turns that each start with a `<|speaker:i|>` tag, stripped. Text before the first
    tag is dropped, as the reference drops it."""
    pieces = re.split(r"(<\|speaker:\d+\|>)", text)
    turns: list[str] = []
    i = 0
    while i < len(pieces):
        piece = pieces[i].strip()
        if SPEAKER_TAG.match(piece):
            if i + 1 < len(pieces):
                turns.append((piece + pieces[i + 1]).strip())
                i += 2
                continue
            turns.append(piece)
        i += 1
    return turns


def group_turns(turns: Sequence[str], max_turns: int, max_bytes: int) -> list[str]:
    """S2: greedy batches of at most `max_turns` turns and `max_bytes` UTF-8 bytes (a single
    longer turn gets a batch of its own), joined by newlines."""
    batches: list[str] = []
    current: list[str] = []
    current_bytes = 0
    for turn in turns:
        size = len(turn.encode("utf-8"))
        if current and (len(current) >= max_turns or current_bytes + size > max_bytes):
            batches.append("\n".join(current))
            current, current_bytes = [], 0
        current.append(turn)
        current_bytes += size
    if current:
        batches.append("\n".join(current))
    return batches


def split_text(text: str, chunk_length: int, family: str = "s2") -> list[str]:
    """The batches the family's reference generates one after another for a long text.

    S2: speaker turns grouped by `chunk_length` bytes (a text without tags is one batch);
    S1: always one batch; 1.5: sentences and clauses merged up to `chunk_length` bytes."""
    if family == "s2":
        turns = split_speaker_turns(text)
        return group_turns(turns, S2_MAX_TURNS_PER_BATCH, chunk_length) if turns else [text]
    if family == "s1":
        return [text]
    if family == "1.5":
        return split_text_v15(text, chunk_length)
    raise ValueError(f"unknown model family {family!r}")


def v15_user_turn_length(tokenizer: Tokenizer, text: str, num_codebooks: int) -> int:
    """Columns of one 1.5 user turn (`<|im_start|>user\\n` .. `<|voice|>`) for `text`."""
    return encode_parts(tokenizer, _v15_user_turn(text), num_codebooks).shape[1]


def v15_history_window(lengths: Sequence[int], budget: int) -> list[int]:
    """Fish Speech 1.5's sliding history (v1.5.1 `generate_long`): which of the segments
    `lengths` (column counts of user turn 0, generated frames 0, user turn 1, ..., the current
    user turn last) go into the prompt, as indices in order.

    Walking back from the newest segment, the reference stops at the first index i (0 = newest)
    where the running total plus segment i's length again exceeds `budget` (= max_length - 1024
    - voice prefix); an even i > 0 becomes i - 1 so that the kept tail starts at a user turn.
    If that tail leaves out more than the first two segments, the prompt is the first two
    segments (turn 0 and its audio, "to avoid drift") + the last i; otherwise everything.
    Deliberate difference: the reference's i = 0 (the newest segment alone overflows) would take
    `segments[-0:]`, i.e. everything again after the first two; here it keeps the newest one."""
    n = len(lengths)
    if n == 0:
        return []
    count, i = 0, n - 1
    for index, length in enumerate(reversed(lengths)):
        count += length
        if count + length > budget:
            i = index
            break
    if i != 0 and i % 2 == 0:
        i -= 1
    if i < n - 2:
        tail = max(i, 1)
        return [0, 1, *range(n - tail, n)]
    return list(range(n))


class LongTextHistory:
    """The batches of one long text generated so far, and which of them the next batch's prompt
    carries, as the family's `generate_long` does: every one (S2), or for 1.5 the sliding window
    of `v15_history_window` over `max_length - 1024 - voice prefix` columns. Each turn's column
    counts are taken once, when it is appended."""

    def __init__(self, voice: VoicePrompt, max_length: int = V15_MAX_LENGTH) -> None:
        self.voice = voice
        self.turns: list[Turn] = []
        self._sliding = voice.config.family == "1.5"
        self._budget = max_length - 1024 - voice.prefix.shape[1]
        self._segments: list[int] = []  # 1.5: columns of each turn's user turn, then of its frames

    def append(self, turn: Turn) -> None:
        self.turns.append(turn)
        if self._sliding:
            self._segments += [self._user_turn_length(turn.text), turn.frames.shape[1]]

    def context(self, text: str) -> list[Turn]:
        """The earlier turns the prompt of the batch saying `text` carries, oldest first."""
        if not self._sliding or not self.turns:
            return list(self.turns)
        kept = v15_history_window([*self._segments, self._user_turn_length(text)], self._budget)
        # Kept segments come in (user turn, its frames) pairs, plus the current turn last.
        return [self.turns[k // 2] for k in kept[:-1:2]]

    def prompt(self, text: str) -> Tensor:
        """The prompt of the next batch, saying `text`."""
        return self.voice.build(text, self.context(text))

    def _user_turn_length(self, text: str) -> int:
        return v15_user_turn_length(self.voice.tokenizer, text, self.voice.config.num_codebooks)


# ---------------------------------------------------------------------------------------------
# Fish Speech 1.5 text handling (fish_speech/text/clean.py and spliter.py at v1.5.1)

_QUOTE_MAP = {"\u2018": "'", "\u2019": "'"}
_EMOJI = re.compile("[\U0001f600-\U0001f64f\U0001f300-\U0001f5ff\U0001f680-\U0001f6ff\U0001f1e0-\U0001f1ff]+")


def clean_text(text: str) -> str:
    """1.5's normalisation: strip, curly single quotes to ', no emoji, `,,,` -> `,`."""
    text = text.strip()
    text = re.sub("[\u2018\u2019]", lambda m: _QUOTE_MAP[m.group()], text)
    text = _EMOJI.sub("", text)
    return re.sub(r"[,]{2,}", lambda m: m.group()[0], text)


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def _break_at(pieces: list[str], length: int, marks: set[str]) -> list[str]:
    out: list[str] = []
    for piece in pieces:
        if _utf8_len(piece) <= length:
            out.append(piece)
            continue
        current = ""
        for char in piece:
            current += char
            if char in marks:
                out.append(current)
                current = ""
        if current:
            out.append(current)
    return out


def _break_by_length(pieces: list[str], length: int) -> list[str]:
    out: list[str] = []
    for piece in pieces:
        if _utf8_len(piece) <= length:
            out.append(piece)
            continue
        current = ""
        for char in piece:
            current += char
            if _utf8_len(current) >= length:
                out.append(current)
                current = ""
        if current:
            out.append(current)
    return out


def _keep_segment(segment: str, segments: list[str]) -> None:
    segment = segment.strip()
    if segment and not all(c.isspace() or c in string.punctuation for c in segment):
        segments.append(segment)


def split_text_v15(text: str, length: int) -> list[str]:
    """Split at sentence ends (not inside decimals), then commas, spaces, any character, and
    merge the pieces back into segments of at most `length` UTF-8 bytes."""
    text = re.sub(r"(\d+)\.(\d+)", r"<\1_f_\2>", clean_text(text))
    pieces = _break_at([text], length, {".", "!", "?", "\u3002", "\uff01", "\uff1f"})
    pieces = [re.sub(r"<(\d+)_f_(\d+)>", r"\1.\2", p) for p in pieces]
    pieces = _break_at(pieces, length, {",", "\uff0c"})
    pieces = _break_at(pieces, length, {" "})
    pieces = _break_by_length(pieces, length)
    segments: list[str] = []
    current = ""
    for piece in pieces:
        if _utf8_len(current) + _utf8_len(piece) <= length:
            current += piece
        else:
            _keep_segment(current, segments)
            current = piece
    if current:
        _keep_segment(current, segments)
    return segments
