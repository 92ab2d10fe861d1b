"""Prompt builders: token-identical to the reference for S2 (golden), S1 (PyPI code), 1.5 template."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from shoal.models.config import read_config
from shoal.models.prompt import (
    Reference,
    Turn,
    build_prompt,
    clean_text,
    codes_for_codec,
    split_text,
    voice_prefix_length,
)
from shoal.models.tokenizer import S1_SPECIAL_TOKENS, load_tokenizer

# ---- S2 against the golden prompts -------------------------------------------------------------


@pytest.fixture(scope="module")
def s2(golden_dir):
    directory = golden_dir / "s2_tiny"
    config = read_config(directory)
    tokenizer = load_tokenizer(directory, "s2")
    cases = torch.load(directory / "golden_prompts.pt", weights_only=True)["cases"]
    return config, tokenizer, {case["name"]: case for case in cases}


def _frames_from_codes(codes: torch.Tensor, semantic_begin_id: int, stop_id: int) -> torch.Tensor:
    """Frames whose codec codes are `codes`: the generated codes plus the dropped last frame."""
    frames = torch.cat([codes[:1] + semantic_begin_id, codes], dim=0)
    stop = torch.zeros(codes.shape[0] + 1, 1, dtype=codes.dtype)
    stop[0, 0] = stop_id
    return torch.cat([frames, stop], dim=1)


@pytest.mark.parametrize("name", ["no_reference", "one_reference", "two_speakers", "long_text_batches"])
def test_s2_prompts_match_golden(s2, name):
    config, tokenizer, cases = s2
    case = cases[name]
    references = [
        Reference(t, c) for t, c in zip(case["reference_texts"], case["reference_codes"], strict=True)
    ]
    batches = split_text(case["text"], case["chunk_length"])
    assert batches == case["batch_texts"]
    history: list[Turn] = []
    for batch_text, expected, generated in zip(
        batches, case["prompts"], case["generated_codes_per_batch"], strict=True
    ):
        prompt = build_prompt(config, tokenizer, batch_text, references, history)
        assert prompt.dtype == torch.long
        assert prompt.shape == expected.shape
        assert torch.equal(prompt, expected)
        frames = _frames_from_codes(generated, config.semantic_begin_id, config.im_end_id)
        assert torch.equal(codes_for_codec(frames), generated)
        history.append(Turn(batch_text, frames))


def test_s2_voice_prefix_is_shared_and_ends_at_the_user_turn(s2):
    config, tokenizer, cases = s2
    case = cases["two_speakers"]
    references = [
        Reference(t, c) for t, c in zip(case["reference_texts"], case["reference_codes"], strict=True)
    ]
    length = voice_prefix_length(config, tokenizer, references)
    a = build_prompt(config, tokenizer, "One text.", references)
    b = build_prompt(config, tokenizer, "<|speaker:1|>Another, longer text entirely.", references)
    assert torch.equal(a[:, :length], b[:, :length])
    assert a[0, length].item() == tokenizer.token_id("<|im_start|>")
    assert not torch.equal(a[:, : length + 8], b[:, : length + 8])  # the text starts right after
    # The prefix holds every reference code column.
    assert (a[0, :length] >= config.semantic_begin_id).sum() == sum(
        c.shape[1] for c in case["reference_codes"]
    )
    assert voice_prefix_length(config, tokenizer) < length


def test_s2_split_rules():
    assert split_text("No tags at all. Still one batch.", 5) == ["No tags at all. Still one batch."]
    assert split_text("dropped <|speaker:0|> a <|speaker:1|>b", 300) == ["<|speaker:0|> a\n<|speaker:1|>b"]
    six = "".join(f"<|speaker:{i}|>x" for i in range(6))
    assert split_text(six, 1000) == ["\n".join(f"<|speaker:{i}|>x" for i in range(5)), "<|speaker:5|>x"]
    # A turn longer than chunk_length gets a batch of its own.
    assert split_text("<|speaker:0|>aaaaaaaaaaaaaaaaaaaa<|speaker:0|>b", 10) == [
        "<|speaker:0|>aaaaaaaaaaaaaaaaaaaa",
        "<|speaker:0|>b",
    ]


# ---- tiny tiktoken tokenizers for S1 and 1.5 -------------------------------------------------------

MERGES = [b"he", b"ll", b"llo", b"the", b" w", b"or", b"ld", b"re"]


def _write_ranks(directory: Path) -> None:
    tokens = [bytes([b]) for b in range(256)] + MERGES
    lines = [f"{base64.b64encode(token).decode()} {rank}" for rank, token in enumerate(tokens)]
    (directory / "tokenizer.tiktoken").write_text("\n".join(lines) + "\n")


@pytest.fixture
def s1_dir(tmp_path):
    _write_ranks(tmp_path)
    specials = [*S1_SPECIAL_TOKENS, *(f"<|semantic:{i}|>" for i in range(64))]
    # The JSON values are deliberately wrong: only the key order counts.
    (tmp_path / "special_tokens.json").write_text(json.dumps({token: 0 for token in specials}))
    return tmp_path


def test_s1_prompt_matches_the_pypi_reference(s1_dir):
    content_sequence = pytest.importorskip("fish_speech.content_sequence")
    fish_tokenizer = pytest.importorskip("fish_speech.tokenizer")
    reference_tokenizer = fish_tokenizer.FishTokenizer.from_pretrained(str(s1_dir))
    tokenizer = load_tokenizer(s1_dir, "s1")
    config = SimpleNamespace(family="s1", num_codebooks=4)
    generator = torch.Generator().manual_seed(0)
    references = [
        Reference("Hello world, the reference.", torch.randint(0, 64, (4, 5), generator=generator)),
        Reference("Second one", torch.randint(0, 64, (4, 3), generator=generator)),
    ]
    text = "the world's <|speaker:0|> hello, 3.14 again!"
    for refs in ([], references[:1], references):
        sequence = content_sequence.ContentSequence(modality="interleave")
        for ref in refs:
            parts = [content_sequence.TextPart(text=ref.text), content_sequence.VQPart(codes=ref.codes)]
            sequence.append(parts, add_end=True, speaker=0)
        sequence.append([content_sequence.TextPart(text=text)], add_end=False, speaker=0)
        expected, _, _ = sequence.encode_for_inference(reference_tokenizer, num_codebooks=4)
        prompt = build_prompt(config, tokenizer, text, refs)
        assert torch.equal(prompt, expected.long())
        prefix = voice_prefix_length(config, tokenizer, refs)
        assert prompt[0, prefix].item() == tokenizer.encode("<|speaker:0|>")[0]


def test_v15_template(tmp_path):
    _write_ranks(tmp_path)
    tokenizer = load_tokenizer(tmp_path, "1.5")
    config = SimpleNamespace(family="1.5", num_codebooks=2)
    special = tokenizer.token_id
    im_start, im_end, voice = special("<|im_start|>"), special("<|im_end|>"), special("<|voice|>")
    codes = torch.tensor([[3, 4], [5, 6]])

    def raw(text: str) -> list[int]:  # one part, tokenized on its own
        return tokenizer.encode(text)

    prompt = build_prompt(config, tokenizer, "  Hi\u2019s  ", [Reference("Ok", codes)])
    expected = (
        [im_start, *raw("system\n"), *raw("Speak out the provided text."), im_end]
        + [im_start, *raw("user\n"), *raw("Ok"), im_end, im_start, *raw("assistant\n"), voice]
        + [tokenizer.semantic_id(3), tokenizer.semantic_id(4), im_end]
        + [im_start, *raw("user\n"), *raw("Hi's"), im_end, im_start, *raw("assistant\n"), voice]
    )
    assert prompt[0].tolist() == expected
    semantic = prompt[0] >= tokenizer.semantic_begin_id
    assert prompt[1:, semantic].tolist() == codes.tolist()
    assert prompt[1:, ~semantic].abs().sum() == 0
    assert (
        voice_prefix_length(config, tokenizer, [Reference("Ok", codes)])
        == expected.index(tokenizer.semantic_id(4)) + 2
    )


def test_v15_history_frames_are_copied_as_generated(tmp_path):
    _write_ranks(tmp_path)
    tokenizer = load_tokenizer(tmp_path, "1.5")
    config = SimpleNamespace(family="1.5", num_codebooks=2)
    frames = torch.tensor([[tokenizer.semantic_id(1), tokenizer.im_end_id], [1, 9], [2, 8]])
    with_history = build_prompt(config, tokenizer, "B", history=[Turn("A", frames)])
    alone_a = build_prompt(config, tokenizer, "A")
    alone_b = build_prompt(config, tokenizer, "B")
    system = voice_prefix_length(config, tokenizer)
    expected = torch.cat([alone_a, frames, alone_b[:, system:]], dim=1)
    assert torch.equal(with_history, expected)


def test_v15_text_cleaning_and_splitting():
    assert clean_text("  a,,, b\u2018c\u2019 \U0001f600 ") == "a, b'c' "  # stripped before the emoji goes
    # The reference's own examples (fish_speech/text/spliter.py at v1.5.1).
    text = "This is a test sentence. This is another test sentence. And a third one."
    assert split_text(text, 50, "1.5") == [
        "This is a test sentence.",
        "This is another test sentence. And a third one.",
    ]
    assert split_text("a,aaaaaa3.14", 10, "1.5") == ["a,", "aaaaaa3.14"]
    assert split_text("   ", 10, "1.5") == []
    assert split_text("a", 10, "1.5") == ["a"]
    text = (
        "This is a test sentence with only commas, and no dots, and no exclamation marks, "
        "and no question marks, and no newlines."
    )
    assert split_text(text, 50, "1.5") == [
        "This is a test sentence with only commas,",
        "and no dots, and no exclamation marks,",
        "and no question marks, and no newlines.",
    ]
    assert split_text("S1 never splits. Even long text.", 5, "s1") == ["S1 never splits. Even long text."]


def test_bad_codes_are_rejected(s2):
    config, tokenizer, _ = s2
    with pytest.raises(ValueError):
        build_prompt(config, tokenizer, "x", [Reference("r", torch.zeros(3, 2, dtype=torch.long))])
    with pytest.raises(ValueError):
        build_prompt(config, tokenizer, "x", [Reference("r", torch.full((4, 2), 64))])
