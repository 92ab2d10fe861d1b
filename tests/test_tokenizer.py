"""Tokenizers: S1 special ids by JSON key order, the 1.5 special order, S2 tokenizer.json."""

from __future__ import annotations

import base64
import json

import pytest
from fish_speech.tokenizer import FishTokenizer

from shoal.models.config import ModelConfig
from shoal.models.tokenizer import (
    S1_SPECIAL_TOKENS,
    TokenizerError,
    load_tokenizer,
    semantic_token,
)
from shoal.models.writer import tiny_config, write_s2_tokenizer, write_tiktoken_ranks


def write_ranks_with_merges(path):
    """Bytes plus a few multi-byte tokens, so the split pattern matters."""
    tokens = [bytes([b]) for b in range(256)] + [b"12", b"he", b"ll", b"hell", b"hello", b" w", b" wo"]
    path.write_text("\n".join(f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(tokens)) + "\n")
    return len(tokens)


def s1_specials(n_semantic: int) -> list[str]:
    return [*S1_SPECIAL_TOKENS, *(semantic_token(i) for i in range(n_semantic))]


def test_s1_ids_follow_key_order_not_values(tmp_path):
    ranks = write_ranks_with_merges(tmp_path / "tokenizer.tiktoken")
    specials = s1_specials(64)
    # Values deliberately wrong: the reference ignores them.
    (tmp_path / "special_tokens.json").write_text(json.dumps({t: 7 for t in specials}))
    tokenizer = load_tokenizer(tmp_path, "s1")
    assert tokenizer.token_id("<|begin_of_text|>") == ranks
    assert tokenizer.im_end_id == ranks + 4
    assert tokenizer.token_id("<|audio|>") == ranks + 14
    assert tokenizer.semantic_begin_id == ranks + 15
    assert tokenizer.semantic_end_id == ranks + 15 + 63
    assert tokenizer.semantic_id(5) == ranks + 20


def test_s1_reordered_keys_move_ids(tmp_path):
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken")
    specials = s1_specials(8)
    specials[3], specials[4] = specials[4], specials[3]  # <|im_end|> before <|im_start|>
    (tmp_path / "special_tokens.json").write_text(json.dumps({t: i for i, t in enumerate(specials)}))
    tokenizer = load_tokenizer(tmp_path, "s1")
    assert tokenizer.im_end_id == 256 + 3
    assert tokenizer.token_id("<|im_start|>") == 256 + 4


def test_s1_default_specials_without_json(tmp_path):
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken")
    tokenizer = load_tokenizer(tmp_path, "s1")
    assert tokenizer.semantic_begin_id == 256 + 15
    assert tokenizer.num_semantic_tokens == 1024


def test_s1_encoding_matches_reference_tokenizer(tmp_path):
    write_ranks_with_merges(tmp_path / "tokenizer.tiktoken")
    specials = s1_specials(16)
    (tmp_path / "special_tokens.json").write_text(json.dumps({t: 0 for t in specials}))
    ours = load_tokenizer(tmp_path, "s1")
    reference = FishTokenizer.from_pretrained(str(tmp_path))
    texts = [
        "hello world 12 345!",
        "<|interleave|><|speaker:0|>hello<|semantic:3|><|im_end|>",
        "It's 1912, hello,\n\n  wo  rld?!",
        "ünïcödé — 漢字 ok",
    ]
    for text in texts:
        assert ours.encode(text) == reference.encode(text)
        assert ours.decode(ours.encode(text)) == text
    # FISH_TIKTOKEN_PATTERN splits digits one by one, so "12" never merges.
    assert ours.encode("12") == [ord("1"), ord("2")]
    # <|speaker:N|> is ordinary text for S1, the listed specials are single tokens.
    assert ours.encode("<|im_end|>") == [ours.im_end_id]
    assert len(ours.encode("<|speaker:0|>")) > 1


def test_v15_special_order(tmp_path):
    write_tiktoken_ranks(tmp_path / "tokenizer.tiktoken")
    tokenizer = load_tokenizer(tmp_path, "1.5")
    assert tokenizer.im_end_id == 256 + 4
    assert tokenizer.token_id("<|placeholder:3|>") == 256 + 8
    assert tokenizer.token_id("<|voice|>") == 256 + 10
    assert tokenizer.semantic_begin_id == 256 + 12
    assert tokenizer.num_semantic_tokens == 1024


def test_s2_written_tokenizer_json(tmp_path):
    config = tiny_config("s2")
    write_s2_tokenizer(tmp_path, config, {"<|pad|>": 500, "<|audio_pad|>": 501})
    tokenizer = load_tokenizer(tmp_path, "s2")
    assert (tokenizer.semantic_begin_id, tokenizer.semantic_end_id) == (400, 463)
    assert tokenizer.im_end_id == 7
    assert tokenizer.token_id("<|pad|>") == 500
    assert tokenizer.semantic_id(63) == 463
    ids = tokenizer.encode("<|im_start|>assistant\n<|voice|><|semantic:2|>hé<|im_end|>")
    assert ids[0] == tokenizer.token_id("<|im_start|>")
    assert 402 in ids and ids[-1] == 7
    assert tokenizer.decode(ids) == "<|im_start|>assistant\n<|voice|><|semantic:2|>hé<|im_end|>"
    with pytest.raises(ValueError):
        tokenizer.semantic_id(64)


def test_s2_golden_tokenizer_ids(golden_dir):
    tokenizer = load_tokenizer(golden_dir / "s2_tiny", "s2")
    assert tokenizer.token_id("<|im_start|>") == 1
    assert tokenizer.token_id("<|voice|>") == 3
    assert tokenizer.im_end_id == 7
    assert (tokenizer.semantic_begin_id, tokenizer.semantic_end_id) == (400, 463)
    ids = tokenizer.encode("a b")
    assert all(10 <= i < 266 for i in ids)  # bytes are ids 10..265
    assert tokenizer.decode(ids) == "a b"


def test_s2_non_contiguous_semantic_ids_rejected(tmp_path):
    config = ModelConfig(
        family="s2", vocab_size=512, dim=8, n_head=1, codebook_size=4, semantic_begin_id=300, im_end_id=2
    )
    write_s2_tokenizer(tmp_path, config, {})
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:
        if entry["content"] == "<|semantic:2|>":
            entry["id"] = 450
    data["model"]["vocab"]["<|semantic:2|>"] = 450
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="semantic:2"):
        load_tokenizer(tmp_path, "s2")


def test_missing_files_are_clear_errors(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        load_tokenizer(tmp_path, "s2")
    with pytest.raises(TokenizerError, match="tokenizer.tiktoken"):
        load_tokenizer(tmp_path, "s1")
