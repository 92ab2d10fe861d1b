"""The S2 model against the reference's own outputs on the tiny golden checkpoint (fp32)."""

from __future__ import annotations

import pytest
import torch

from shoal.models import load_model


@pytest.fixture(scope="module")
def model(golden_dir):
    return load_model(golden_dir / "s2_tiny")


@pytest.fixture(scope="module")
def golden(golden_dir):
    return torch.load(golden_dir / "s2_tiny" / "golden.pt", weights_only=True)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def test_loaded_config_and_ids(model):
    c = model.config
    assert model.family == "s2"
    assert (c.semantic_begin_id, c.semantic_end_id, c.im_end_id) == (400, 463, 7)
    assert c.scale_codebook_embeddings and c.norm_fastlayer_input and c.tie_word_embeddings
    assert not hasattr(model, "output")


def test_prefill_logits(model, golden):
    logits = model.prefill_logits(golden["prompt"])
    assert logits.shape == (512,)
    assert relative_error(logits, golden["prefill_logits"]) < 1e-4


def test_prefill_hidden_for_fast_is_post_norm(model, golden):
    _, fast_input = model.prefill_last(golden["prompt"])
    assert relative_error(fast_input, golden["prefill_hidden_for_fast"]) < 1e-4
    # The pre-norm hidden state must differ clearly: S2 feeds the normed one.
    cache = model.new_slow_cache(golden["prompt"].shape[1])
    positions = cache.plan([0], [golden["prompt"].shape[1]])
    hidden = model.forward_slow(golden["prompt"].t(), positions, cache)[-1]
    assert relative_error(hidden, golden["prefill_hidden_for_fast"]) > 1e-2


def _fast_inputs(model, golden):
    codes = golden["teacher_forced_codes"]
    first = model.fast_project_in(golden["prefill_hidden_for_fast"][None])
    rest = model.fast_embed(codes[:-1])
    return torch.cat([first, rest])[None]  # [1, N, fast_dim]


@torch.no_grad()
def test_fast_logits_in_one_pass(model, golden):
    logits = model.forward_fast(_fast_inputs(model, golden), 0, model.new_fast_cache(1))
    assert logits.shape == (1, 4, 64)
    assert relative_error(logits[0, 1:], golden["fast_logits"]) < 1e-4


@torch.no_grad()
def test_fast_logits_step_by_step_with_combined_first_pass(model, golden):
    x = _fast_inputs(model, golden)
    cache = model.new_fast_cache(1)
    steps = [model.forward_fast(x[:, :2], 0, cache)[:, 1]]  # positions 0 and 1 together
    for k in range(2, 4):
        steps.append(model.forward_fast(x[:, k : k + 1], k, cache)[:, 0])
    assert relative_error(torch.stack(steps, dim=1)[0], golden["fast_logits"]) < 1e-4


@torch.no_grad()
def test_greedy_frames(model, golden):
    """Greedy decoding with the semantic constraint reproduces the reference's frames exactly."""
    c = model.config
    prompt = golden["prompt"]
    expected = golden["greedy_frames"]
    n = c.num_codebooks
    cache = model.new_slow_cache(prompt.shape[1] + expected.shape[1])
    allowed = torch.full((c.vocab_size,), float("-inf"))
    allowed[c.semantic_begin_id : c.semantic_end_id + 1] = 0
    allowed[c.im_end_id] = 0
    step_tokens = prompt.t()
    frames = []
    for _ in range(expected.shape[1]):
        positions = cache.plan([0], [step_tokens.shape[0]])
        hidden = model.forward_slow(step_tokens, positions, cache)[-1:]
        logits, fast_input = model.slow_head(hidden)
        main = int(torch.argmax(logits[0] + allowed))
        code = min(max(main - c.semantic_begin_id, 0), c.codebook_size - 1)
        codes = [code]
        fast_cache = model.new_fast_cache(1)
        x = torch.cat([model.fast_project_in(fast_input), model.fast_embed(torch.tensor([code]))])[None]
        fast_logits = model.forward_fast(x, 0, fast_cache)[:, 1]
        for k in range(1, n):
            codes.append(int(torch.argmax(fast_logits[0])))
            if k < n - 1:
                fast_logits = model.forward_fast(
                    model.fast_embed(torch.tensor([codes[-1]]))[None], k + 1, fast_cache
                )[:, 0]
        frame = torch.tensor([main, *codes])
        frames.append(frame)
        step_tokens = frame[None]
    assert torch.equal(torch.stack(frames, dim=1).to(torch.int32), expected)
