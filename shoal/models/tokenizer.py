"""Tokenizers of the three families, behind one small interface.

- S2: a Hugging Face `tokenizer.json` (Qwen3 BPE plus Fish specials and `<|semantic:i|>`).
- S1-mini: tiktoken `tokenizer.tiktoken` + `special_tokens.json`. The special ids are
  `len(ranks) + position in the JSON's KEY ORDER`; the JSON values are ignored (as the reference).
- Fish Speech 1.5: tiktoken `tokenizer.tiktoken` with a fixed special-token list of its own.

`encode` adds no BOS/EOS, and special-token strings inside the text become special tokens.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

# The reference's split pattern: GPT-4o-like, single punctuation marks and single digits.
# Kept character for character (including its odd `\s+(\?!\S)` branch) for token parity.
FISH_TIKTOKEN_PATTERN = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"\p{P}",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(\?!\S)",
        r"\s+",
    ]
)
# tiktoken refuses very long inputs in one call; the reference encodes in slices of this size.
_TIKTOKEN_SLICE_CHARS = 400_000

_SEMANTIC_PATTERN = re.compile(r"<\|semantic:(\d+)\|>")


def semantic_token(code: int) -> str:
    return f"<|semantic:{code}|>"


# Special-token lists in the order the S1 and 1.5 code assign ids.
S1_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>", "<|phoneme_start|>",
    "<|phoneme_end|>", "<|tool_call_start|>", "<|tool_call_end|>", "<|text|>", "<|voice|>", "<|interleave|>",
    "<|audio_start|>", "<|audio_end|>", "<|audio|>",
]  # fmt: skip
V15_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>",
    *(f"<|placeholder:{i}|>" for i in range(4)), "<|text|>", "<|voice|>", "<|interleave|>",
]  # fmt: skip
# Without special_tokens.json the S1 code (and always the 1.5 code) has 1024 semantic tokens.
DEFAULT_SEMANTIC_TOKENS = 1024


class TokenizerError(ValueError):
    """Tokenizer files missing or inconsistent with what the model family needs."""


class Tokenizer:
    """Common surface: encode/decode, special ids, and the semantic-token id range."""

    def __init__(self, special_ids: dict[str, int]) -> None:
        self.special_ids = special_ids
        semantic = sorted(
            (int(m.group(1)), token_id)
            for token, token_id in special_ids.items()
            if (m := _SEMANTIC_PATTERN.fullmatch(token))
        )
        if not semantic:
            raise TokenizerError("the tokenizer has no <|semantic:i|> tokens")
        self.semantic_begin_id = semantic[0][1]
        self.semantic_end_id = max(token_id for _, token_id in semantic)
        # The model maps code c <-> semantic_begin_id + c, so the ids must be contiguous.
        for code, token_id in semantic:
            if token_id != self.semantic_begin_id + code:
                raise TokenizerError(
                    f"<|semantic:{code}|> has id {token_id}, expected {self.semantic_begin_id + code}"
                )
        self.num_semantic_tokens = len(semantic)
        self.im_end_id = self.token_id("<|im_end|>")

    def token_id(self, special: str) -> int:
        try:
            return self.special_ids[special]
        except KeyError:
            raise KeyError(f"{special!r} is not a special token of this tokenizer") from None

    def semantic_id(self, code: int) -> int:
        if not 0 <= code < self.num_semantic_tokens:
            raise ValueError(f"semantic code {code} out of range 0..{self.num_semantic_tokens - 1}")
        return self.semantic_begin_id + code

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class HFTokenizer(Tokenizer):
    """S2's tokenizer.json through the `tokenizers` library (what AutoTokenizer wraps)."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self._tokenizer = RustTokenizer.from_file(str(path))
        except Exception as error:  # the Rust side raises plain Exception subclasses
            raise TokenizerError(f"cannot read {path}: {error}") from error
        specials = {t.content: i for i, t in self._tokenizer.get_added_tokens_decoder().items()}
        super().__init__(specials)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """`base64(token) rank` per line; the reference skips a `=` token (an empty byte string)."""
    ranks: dict[bytes, int] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line:
            continue
        token, rank = line.split()
        if token == "=":
            continue
        ranks[base64.b64decode(token)] = int(rank)
    return ranks


class TiktokenTokenizer(Tokenizer):
    """S1-mini and 1.5: byte-level BPE ranks plus specials numbered after the last rank."""

    def __init__(self, ranks_path: Path, special_tokens: list[str]) -> None:
        import tiktoken

        try:
            ranks = read_tiktoken_ranks(ranks_path)
        except (OSError, ValueError) as error:
            raise TokenizerError(f"cannot read {ranks_path}: {error}") from error
        first_special = len(ranks)
        special_ids = {token: first_special + i for i, token in enumerate(special_tokens)}
        self._encoding = tiktoken.Encoding(
            name=ranks_path.stem, pat_str=FISH_TIKTOKEN_PATTERN, mergeable_ranks=ranks,
            special_tokens=special_ids,
        )  # fmt: skip
        super().__init__(special_ids)

    def encode(self, text: str) -> list[int]:
        slices = [text[i : i + _TIKTOKEN_SLICE_CHARS] for i in range(0, len(text), _TIKTOKEN_SLICE_CHARS)]
        allowed = self._encoding.special_tokens_set
        ids: list[int] = []
        for piece in slices:
            ids.extend(self._encoding.encode(piece, allowed_special=allowed, disallowed_special=()))
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._encoding.decode(list(ids))


def s1_special_tokens(directory: Path) -> list[str]:
    """S1 specials: the KEYS of special_tokens.json in file order (values ignored), else the
    code's default list with 1024 semantic tokens."""
    path = directory / "special_tokens.json"
    if not path.exists():
        return [*S1_SPECIAL_TOKENS, *(semantic_token(i) for i in range(DEFAULT_SEMANTIC_TOKENS))]
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise TokenizerError(f"{path} is not valid JSON: {error}") from None
    if isinstance(mapping, dict):
        return list(mapping.keys())
    if isinstance(mapping, list):
        return [str(token) for token in mapping]
    raise TokenizerError(f"{path}: expected an object of special tokens")


def v15_special_tokens() -> list[str]:
    return [*V15_SPECIAL_TOKENS, *(semantic_token(i) for i in range(DEFAULT_SEMANTIC_TOKENS))]


def load_tokenizer(directory: str | Path, family: str) -> Tokenizer:
    """The tokenizer an official checkpoint directory of `family` ("s2" | "s1" | "1.5") ships."""
    directory = Path(directory)
    if family == "s2":
        path = directory / "tokenizer.json"
        if not path.exists():
            raise TokenizerError(f"{path} not found (S2 checkpoints ship a HF tokenizer.json)")
        return HFTokenizer(path)
    if family not in ("s1", "1.5"):
        raise TokenizerError(f"unknown model family {family!r}")
    ranks_path = directory / "tokenizer.tiktoken"
    if not ranks_path.exists():
        raise TokenizerError(f"{ranks_path} not found ({family} checkpoints ship tokenizer.tiktoken)")
    specials = s1_special_tokens(directory) if family == "s1" else v15_special_tokens()
    return TiktokenTokenizer(ranks_path, specials)
