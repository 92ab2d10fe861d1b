"""CTC forced alignment (shoal/server/alignment.py) against hand-built emission matrices whose
best path is known, and the explicit text normalisation to an aligner's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shoal.server.alignment import (
    AlignerError,
    AlignerVocab,
    CtcAligner,
    TokenSpan,
    WordTiming,
    align_text,
    check_aligner_directory,
    forced_align,
    load_aligner,
    spoken_words,
)

BLANK = "<pad>"
# wav2vec2-base-960h's layout: specials, the word delimiter, upper-case letters and the apostrophe.
UPPER_TOKENS = [BLANK, "<s>", "</s>", "<unk>", "|", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ'"]
UPPER = AlignerVocab.from_tokens({token: i for i, token in enumerate(UPPER_TOKENS)}, 0, "|")
FRAME_SECONDS = 0.02


def emissions(vocab: AlignerVocab, frames: list[dict[str, float]]) -> np.ndarray:
    """Log-probabilities [frames, vocab]: each frame's listed tokens get their probability, the
    rest share what is left equally."""
    size = len(vocab.token_ids)
    rows = []
    for frame in frames:
        row = np.full(size, (1.0 - sum(frame.values())) / (size - len(frame)))
        for token, probability in frame.items():
            row[vocab.token_ids[token]] = probability
        rows.append(np.log(row))
    return np.stack(rows)


def sure(*tokens: str) -> list[dict[str, float]]:
    """One frame per token, each 90% that token."""
    return [{token: 0.9} for token in tokens]


def frame_times(frames: int) -> np.ndarray:
    """Where each of `frames` 20 ms frames starts, and the last one's end."""
    return np.arange(frames + 1) * FRAME_SECONDS


def ids(vocab: AlignerVocab, text: str) -> list[int]:
    return [vocab.token_ids[token] for token in text]


def test_the_best_path_gives_each_token_its_frames() -> None:
    log_probs = emissions(UPPER, sure(BLANK, "A", "A", BLANK, "B", "B", "B", BLANK))
    assert forced_align(log_probs, ids(UPPER, "AB"), blank_id=0) == [TokenSpan(1, 3), TokenSpan(4, 7)]


def test_the_text_decides_where_the_frames_disagree() -> None:
    # Frame 1 most likely says C, which the text lacks: its next best choice on a path that spells
    # "AB" is the blank (0.3) over staying on A (0.1) or starting B early (0.05).
    frames = [{"A": 0.9}, {"C": 0.5, BLANK: 0.3, "A": 0.1, "B": 0.05}, {"B": 0.9}]
    spans = forced_align(emissions(UPPER, frames), ids(UPPER, "AB"), blank_id=0)
    assert spans == [TokenSpan(0, 1), TokenSpan(2, 3)]


def test_a_repeated_letter_needs_a_blank_between() -> None:
    # Every frame says L, but "LL" can only be L, blank, L: a path L, L, L spells one L.
    log_probs = emissions(UPPER, sure("L", "L", "L"))
    assert forced_align(log_probs, ids(UPPER, "LL"), blank_id=0) == [TokenSpan(0, 1), TokenSpan(2, 3)]
    # Two frames cannot spell "LL" (a token a frame plus the blank), but can spell "LA".
    assert forced_align(log_probs[:2], ids(UPPER, "LL"), blank_id=0) is None
    assert forced_align(log_probs[:2], ids(UPPER, "LA"), blank_id=0) == [TokenSpan(0, 1), TokenSpan(1, 2)]


def test_the_path_may_end_on_its_last_token_or_the_blank_after_it() -> None:
    on_token = forced_align(emissions(UPPER, sure(BLANK, "O", "K")), ids(UPPER, "OK"), blank_id=0)
    after = forced_align(emissions(UPPER, sure("O", "K", BLANK, BLANK)), ids(UPPER, "OK"), blank_id=0)
    assert on_token == [TokenSpan(1, 2), TokenSpan(2, 3)]
    assert after == [TokenSpan(0, 1), TokenSpan(1, 2)]


def test_tokens_merge_into_words_at_the_delimiter() -> None:
    # "Hi, all": H I | A L (blank) L, then trailing blanks.
    frames = sure(BLANK, "H", "I", "|", "A", "L", BLANK, "L", BLANK, BLANK)
    words = align_text(emissions(UPPER, frames), "Hi, all", UPPER, frame_times(10), duration=0.2)
    assert words == [
        WordTiming("Hi,", pytest.approx(0.02), pytest.approx(0.06)),
        WordTiming("all", pytest.approx(0.08), pytest.approx(0.16)),
    ]


def test_a_word_the_vocabulary_cannot_spell_shares_the_gap_between_its_neighbours() -> None:
    # "I have 3 cats": "3" has no letters here, so the audio between "have" and "cats" is its.
    frames = sure("I", "|", "H", "A", "V", "E", BLANK, BLANK, BLANK, BLANK, "|", "C", "A", "T", "S")
    words = align_text(emissions(UPPER, frames), "I have 3 cats", UPPER, frame_times(15), duration=0.3)
    assert [word.text for word in words] == ["I", "have", "3", "cats"]
    assert words[2].start == pytest.approx(words[1].end) == pytest.approx(0.12)
    assert words[2].end == pytest.approx(words[3].start)
    assert words[3].end == pytest.approx(0.30)
    # Two unspellable words at the end share the rest of the audio equally.
    tail = align_text(emissions(UPPER, sure("O", "K", BLANK, BLANK)), "ok 1 2", UPPER, frame_times(4), 0.1)
    assert [(w.text, round(w.start, 3), round(w.end, 3)) for w in tail] == [
        ("ok", 0.0, 0.04),
        ("1", 0.04, 0.07),
        ("2", 0.07, 0.1),
    ]


def test_a_text_without_spellable_characters_or_audio_long_enough_has_no_words() -> None:
    assert align_text(emissions(UPPER, sure(BLANK, BLANK)), "123 — 456", UPPER, frame_times(2), 0.04) is None
    assert align_text(emissions(UPPER, sure("H", "I")), "hello", UPPER, frame_times(2), 0.04) is None


def test_times_stop_at_the_audio_duration() -> None:
    # 4 frames of 20 ms describe 80 ms, but the audio is 70 ms long.
    words = align_text(emissions(UPPER, sure(BLANK, "O", "O", "K")), "ok", UPPER, frame_times(4), 0.07)
    assert words == [WordTiming("ok", pytest.approx(0.02), pytest.approx(0.07))]


def test_normalisation_cases_letters_like_the_vocabulary() -> None:
    lower = AlignerVocab.from_tokens({token.lower(): i for i, token in enumerate(UPPER_TOKENS)}, 0, "|")
    mixed = AlignerVocab.from_tokens({BLANK: 0, "|": 1, "a": 2, "B": 3}, 0, "|")
    assert (UPPER.case, lower.case, mixed.case) == ("upper", "lower", "mixed")
    assert UPPER.spell("HeLLo") == list("HELLO")
    assert lower.spell("HeLLo") == list("hello")
    assert mixed.spell("aAbB") == ["a", "B"]  # no case folding when the vocabulary has both cases
    assert UPPER.spell("straße") == list("STRASSE")  # upper-casing may lengthen the word


def test_normalisation_maps_or_drops_what_the_vocabulary_lacks() -> None:
    assert UPPER.spell("can’t") == list("CAN'T")  # typographic apostrophe
    assert UPPER.spell("Café") == list("CAFE")  # accent stripped: the vocabulary has no É
    assert UPPER.spell("well-known,") == list("WELLKNOWN")  # punctuation the vocabulary lacks
    assert UPPER.spell("42") == []
    assert UPPER.spell("a|b") == ["A", "B"]  # the delimiter is never spelled from the text
    accented = AlignerVocab.from_tokens({BLANK: 0, "|": 1, "c": 2, "a": 3, "f": 4, "é": 5, "e": 6}, 0, "|")
    assert accented.spell("Café") == list("café")  # kept where the vocabulary has it


def test_markup_nobody_speaks_is_not_aligned() -> None:
    assert spoken_words("<|speaker:0|>Hello [laugh] there,\nfriend") == ["Hello", "there,", "friend"]


def test_the_aligner_directory_is_checked_before_loading(tmp_path) -> None:
    with pytest.raises(AlignerError, match="not a directory"):
        check_aligner_directory(tmp_path / "missing")
    with pytest.raises(AlignerError, match="'facebook/wav2vec2-base-960h' is not a directory"):
        check_aligner_directory("facebook/wav2vec2-base-960h")  # a hub id is never downloaded
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(AlignerError, match="no vocab.json"):
        check_aligner_directory(tmp_path)
    (tmp_path / "vocab.json").write_text("{}")
    assert check_aligner_directory(tmp_path) == tmp_path


def write_tiny_ctc_aligner(directory: Path) -> Path:
    """A random-weight wav2vec2 CTC model in facebook/wav2vec2-base-960h's file layout: upper-case
    letters, `'` and the `|` word delimiter; 8 samples per frame, so short audio has many frames."""
    from transformers import Wav2Vec2Config, Wav2Vec2CTCTokenizer, Wav2Vec2FeatureExtractor, Wav2Vec2ForCTC

    directory.mkdir(parents=True, exist_ok=True)
    tokens = ["<pad>", "<s>", "</s>", "<unk>", "|", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ'"]
    (directory / "vocab.json").write_text(json.dumps({token: i for i, token in enumerate(tokens)}))
    tokenizer = Wav2Vec2CTCTokenizer(
        str(directory / "vocab.json"), pad_token="<pad>", unk_token="<unk>", word_delimiter_token="|"
    )
    features = Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, do_normalize=True)
    config = Wav2Vec2Config(
        vocab_size=len(tokens), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, num_feat_extract_layers=2, conv_dim=(8, 8), conv_stride=(4, 2),
        conv_kernel=(8, 4), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, pad_token_id=0,
    )  # fmt: skip
    Wav2Vec2ForCTC(config).save_pretrained(directory)
    features.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tiny_aligner_dir(tmp_path_factory) -> Path:
    return write_tiny_ctc_aligner(tmp_path_factory.mktemp("aligner"))


def test_a_loaded_aligner_reads_the_vocabulary_and_frame_stride(tiny_aligner_dir: Path) -> None:
    aligner = load_aligner(tiny_aligner_dir)
    assert (aligner.sample_rate, aligner.samples_per_frame, aligner.frame_seconds) == (16000, 8, 0.0005)
    assert (aligner.vocab.case, aligner.vocab.word_delimiter, aligner.vocab.blank_id) == ("upper", "|", 0)
    noise = np.random.default_rng(1).standard_normal(44100).astype(np.float32) * 0.1  # 1 s at 44.1 kHz
    words = aligner.submit(noise, 44100, "<|speaker:0|>Hello there, 42 friends.").result()
    assert [word.text for word in words] == ["Hello", "there,", "42", "friends."]
    assert 0.0 <= words[0].start and words[-1].end <= 1.0
    assert {type(word.start) for word in words} == {float}  # plain floats: msgpack refuses numpy's
    assert all(a.end <= b.start + 1e-9 and b.start <= b.end for a, b in zip(words, words[1:], strict=False))


def test_long_audio_is_seen_in_windows_whose_frames_keep_their_times(tiny_aligner_dir: Path) -> None:
    whole = load_aligner(tiny_aligner_dir)
    windowed = CtcAligner(whole.model, whole.feature_extractor, whole.vocab, 16000, 8, window_seconds=0.5)
    noise = np.random.default_rng(2).standard_normal(21000).astype(np.float32)  # 1.3125 s
    log_probs, times = windowed.log_probs(noise)
    # Windows of 8000 samples: [0, 8000), [8000, 16000), then the 5000-sample tail, over half a window.
    expected = [
        whole.log_probs(noise[start:end]) for start, end in ((0, 8000), (8000, 16000), (16000, 21000))
    ]
    np.testing.assert_allclose(log_probs, np.concatenate([piece for piece, _ in expected]), atol=1e-5)
    first, second = len(expected[0][0]), len(expected[1][0])
    assert times[0] == 0.0 and times[first] == 0.5 and times[first + second] == 1.0
    assert times[-1] == pytest.approx(21000 / 16000) and len(times) == len(log_probs) + 1
    # A tail under half a window joins the window before it: two windows for 1.1 s.
    short, short_times = windowed.log_probs(noise[:17600])
    pieces = [whole.log_probs(noise[start:end])[0] for start, end in ((0, 8000), (8000, 17600))]
    np.testing.assert_allclose(short, np.concatenate(pieces), atol=1e-5)
    assert short_times[len(pieces[0])] == 0.5


def test_an_unloadable_aligner_directory_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "not-a-model"}))
    (tmp_path / "vocab.json").write_text(json.dumps({"<pad>": 0}))
    with pytest.raises(AlignerError, match="cannot load the CTC aligner"):
        load_aligner(tmp_path)
