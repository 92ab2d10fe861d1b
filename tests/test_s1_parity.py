"""S1-mini parity with the reference code (PyPI fish-speech 0.1.0, the S1-era code).

A small random S1-shaped checkpoint (flat config.json + model.pth + tiktoken tokenizer) is
written to disk from the reference's own `DualARTransformer`, loaded into Shoal with
`load_model`, and both generate. Random weights give nearly flat logits, which would make greedy
decoding hinge on float noise: the test scales the two output heads (slow `output`, fast
`fast_output`) by HEAD_SCALE so logits spread over several units, and checks that every greedy
step's top-2 margin is far above the float32 difference between the two implementations.

"Greedy" for S1 (which has no top-k) is top_p tiny: only rank 0 survives, so the reference's
`torch.rand` exponential race cannot change the pick. A second test swaps the reference's race for
our counter-based uniforms (same call order: main token, then codebooks 1..N-1 per frame), so
temperature/top-p/penalty sampling must then agree draw for draw.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest
import torch

llama = pytest.importorskip("fish_speech.models.text2semantic.llama")
fish_tokenizer = pytest.importorskip("fish_speech.tokenizer")

from shoal.models import load_model  # noqa: E402
from shoal.models.prompt import Reference, build_prompt  # noqa: E402
from shoal.models.reference import generate  # noqa: E402
from shoal.models.sampling import codebook_slot, counter_uniform, exponential_race  # noqa: E402
from shoal.models.tokenizer import S1_SPECIAL_TOKENS  # noqa: E402

CODEBOOK_SIZE = 1280  # > 1024, so the reference's [:1024] truncation of fast logits matters
NUM_CODEBOOKS = 4
HEAD_SCALE = 12.0
FRAMES = 33


def _write_tokenizer(directory: Path) -> None:
    merges = [b"he", b"ll", b"llo", b"the", b" w", b"or", b"ld", b"re", b"ing", b"in"]
    tokens = [bytes([b]) for b in range(256)] + merges
    lines = [f"{base64.b64encode(t).decode()} {rank}" for rank, t in enumerate(tokens)]
    (directory / "tokenizer.tiktoken").write_text("\n".join(lines) + "\n")
    specials = [*S1_SPECIAL_TOKENS, *(f"<|semantic:{i}|>" for i in range(CODEBOOK_SIZE))]
    (directory / "special_tokens.json").write_text(json.dumps({t: i for i, t in enumerate(specials)}))


@pytest.fixture(scope="module")
def s1_pair(tmp_path_factory):
    """(reference model, shoal model, tokenizer directory), the same weights in both."""
    directory = tmp_path_factory.mktemp("s1_tiny")
    _write_tokenizer(directory)
    tokenizer = fish_tokenizer.FishTokenizer.from_pretrained(str(directory))
    args = llama.DualARModelArgs(
        model_type="dual_ar",
        vocab_size=tokenizer.semantic_end_id + 1,
        n_layer=2,
        n_head=4,
        n_local_heads=2,
        head_dim=16,
        dim=64,
        intermediate_size=128,
        rope_base=1e6,
        norm_eps=1e-6,
        max_seq_len=256,
        tie_word_embeddings=False,
        attention_qk_norm=True,
        codebook_size=CODEBOOK_SIZE,
        num_codebooks=NUM_CODEBOOKS,
        scale_codebook_embeddings=True,
        initializer_range=0.3,
        n_fast_layer=2,
        fast_dim=64,
        fast_n_head=4,
        fast_n_local_heads=2,
        fast_head_dim=16,
        fast_intermediate_size=96,
        fast_attention_qk_norm=False,
    )
    torch.manual_seed(1234)
    reference = llama.DualARTransformer(args, tokenizer=tokenizer).eval()
    with torch.no_grad():
        reference.output.weight.mul_(HEAD_SCALE)
        reference.fast_output.weight.mul_(HEAD_SCALE)
    args.save(str(directory / "config.json"))
    torch.save(reference.state_dict(), directory / "model.pth")
    ours = load_model(directory)
    assert ours.family == "s1"
    return reference, ours, directory


@pytest.fixture(scope="module")
def prompt(s1_pair):
    _, ours, _ = s1_pair
    codes = torch.randint(0, CODEBOOK_SIZE, (NUM_CODEBOOKS, 12), generator=torch.Generator().manual_seed(5))
    codes[1:] %= 1024
    reference_voice = [Reference("the reference line", codes)]
    return build_prompt(ours.config, ours.tokenizer, "hello world, this is the test.", reference_voice)


def reference_inference():
    """The reference's generation module, imported when a test needs it, not at collection (it
    imports TorchInductor: seconds in every test worker)."""
    return pytest.importorskip("fish_speech.models.text2semantic.inference")


def _reference_generate(reference, prompt, **sampling) -> torch.Tensor:
    inference = reference_inference()
    reference.max_seq_len = -1  # fresh caches
    reference.setup_caches(max_batch_size=1, max_seq_len=reference.config.max_seq_len, dtype=torch.float32)
    with torch.no_grad():
        y = inference.generate(
            model=reference,
            prompt=prompt.clone(),
            max_new_tokens=FRAMES,
            audio_masks=None,
            audio_parts=None,
            **sampling,
        )
    return y[:, prompt.shape[1] :].to(torch.int32)


def test_prefill_logits_match(s1_pair, prompt):
    reference, ours, _ = s1_pair
    reference.max_seq_len = -1
    reference.setup_caches(max_batch_size=1, max_seq_len=reference.config.max_seq_len, dtype=torch.float32)
    with torch.no_grad():
        expected = reference.forward_generate(prompt[None], torch.arange(prompt.shape[1])).logits[0, -1]
    got = ours.prefill_logits(prompt)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    top2 = expected.topk(2).values
    assert top2[0] - top2[1] > 1e-2, "the scaled head should give a clear greedy margin"


def test_greedy_frames_with_repetition_penalty_match(s1_pair, prompt):
    reference, ours, _ = s1_pair
    sampling = dict(temperature=0.7, top_p=1e-4, repetition_penalty=1.6)
    expected = _reference_generate(reference, prompt, **sampling)
    got = generate(ours, prompt, max_frames=FRAMES, seed=0, **sampling)
    assert expected.shape[1] >= 32
    assert torch.equal(got, expected)
    # The penalty really steers these frames (so its indexing is under test).
    unpenalised = generate(
        ours, prompt, max_frames=FRAMES, seed=0, temperature=0.7, top_p=1e-4, repetition_penalty=1.0
    )
    assert not torch.equal(unpenalised, got)
    # Codebooks 1..N-1 come from the first 1024 logits only.
    assert int(got[2:].max()) < 1024


def test_sampled_frames_match_with_shared_uniforms(s1_pair, prompt, monkeypatch):
    reference, ours, _ = s1_pair
    seed = 31
    calls = {"n": 0}

    def counter_race(probs: torch.Tensor) -> torch.Tensor:
        frame, position = divmod(calls["n"], NUM_CODEBOOKS)
        calls["n"] += 1
        slot = 0 if position == 0 else codebook_slot(position)
        uniforms = counter_uniform(torch.tensor([seed]), torch.tensor([frame]), slot, probs.shape[-1])
        return exponential_race(probs[None].float(), uniforms).to(torch.int)

    monkeypatch.setattr(reference_inference(), "multinomial_sample_one_no_sync", counter_race)
    sampling = dict(temperature=0.8, top_p=0.8, repetition_penalty=1.1)
    expected = _reference_generate(reference, prompt, **sampling)
    got = generate(ours, prompt, max_frames=FRAMES, seed=seed, **sampling)
    assert expected.shape[1] >= 32
    assert torch.equal(got, expected)
