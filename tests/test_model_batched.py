"""Varlen batching: sequences of different lengths in one forward equal each run alone."""

from __future__ import annotations

import pytest
import torch

from shoal.models import load_model


@pytest.fixture(scope="module")
def model(golden_dir):
    return load_model(golden_dir / "s2_tiny")


def random_prompt(model, length: int, seed: int) -> torch.Tensor:
    """Long[N+1, T]: text tokens, with a run of semantic frames in the middle."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    prompt = torch.zeros(c.num_codebooks + 1, length, dtype=torch.long)
    prompt[0] = torch.randint(0, 266, (length,), generator=g)
    semantic = slice(length // 3, 2 * length // 3)
    codes = torch.randint(0, c.codebook_size, (c.num_codebooks, semantic.stop - semantic.start), generator=g)
    prompt[1:, semantic] = codes
    prompt[0, semantic] = c.semantic_begin_id + codes[0]
    return prompt


@torch.no_grad()
def alone(model, prompt: torch.Tensor) -> torch.Tensor:
    cache = model.new_slow_cache(prompt.shape[1])
    positions = cache.plan([0], [prompt.shape[1]])
    return model.forward_slow(prompt.t(), positions, cache)


@torch.no_grad()
def test_varlen_prefill_equals_each_alone(model):
    prompts = [random_prompt(model, length, seed) for seed, length in enumerate((7, 19, 1, 12))]
    cache = model.new_slow_cache(max_seq_len=32, num_slots=4)
    slots = [2, 0, 3, 1]  # slot order need not follow the batch order
    positions = cache.plan(slots, [p.shape[1] for p in prompts])
    tokens = torch.cat([p.t() for p in prompts])
    hidden = model.forward_slow(tokens, positions, cache)
    offset = 0
    for prompt in prompts:
        length = prompt.shape[1]
        torch.testing.assert_close(
            hidden[offset : offset + length], alone(model, prompt), rtol=1e-5, atol=1e-5
        )
        offset += length


@torch.no_grad()
def test_mixed_decode_and_chunked_prefill_step(model):
    """One step where one sequence decodes a token and another prefills its second chunk."""
    first, second = random_prompt(model, 10, 5), random_prompt(model, 16, 6)
    cache = model.new_slow_cache(max_seq_len=20, num_slots=2)
    # Step 1: sequence 0 prefills 9 tokens, sequence 1 its first 8-token chunk.
    positions = cache.plan([0, 1], [9, 8])
    model.forward_slow(torch.cat([first[:, :9].t(), second[:, :8].t()]), positions, cache)
    # Step 2: sequence 0 decodes its 10th token, sequence 1 prefills the remaining 8.
    positions = cache.plan([0, 1], [1, 8])
    assert positions.tolist() == [9, *range(8, 16)]
    hidden = model.forward_slow(torch.cat([first[:, 9:].t(), second[:, 8:].t()]), positions, cache)
    torch.testing.assert_close(hidden[:1], alone(model, first)[-1:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden[1:], alone(model, second)[8:], rtol=1e-5, atol=1e-5)
    assert cache.lengths == [10, 16]


@torch.no_grad()
def test_fast_batch_rows_are_independent(model):
    c = model.config
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, c.num_codebooks, c.fast_dim, generator=g)
    batched = model.forward_fast(x, 0, model.new_fast_cache(3))
    for row in range(3):
        single = model.forward_fast(x[row : row + 1], 0, model.new_fast_cache(1))
        torch.testing.assert_close(batched[row : row + 1], single, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_slot_reuse_after_reset(model):
    prompt = random_prompt(model, 9, 11)
    cache = model.new_slow_cache(max_seq_len=16, num_slots=1)
    cache.plan([0], [5])
    model.forward_slow(random_prompt(model, 5, 12).t(), torch.arange(5), cache)
    cache.reset(0)
    positions = cache.plan([0], [9])
    torch.testing.assert_close(model.forward_slow(prompt.t(), positions, cache), alone(model, prompt))


@torch.no_grad()
def test_bfloat16_model_runs_close_to_float32(golden_dir, model):
    model_bf16 = load_model(golden_dir / "s2_tiny", dtype=torch.bfloat16)
    assert model_bf16.embeddings.weight.dtype == torch.bfloat16
    assert model_bf16.rope.dtype == torch.bfloat16
    golden = torch.load(golden_dir / "s2_tiny" / "golden.pt", weights_only=True)
    logits, fast_input = model_bf16.prefill_last(golden["prompt"])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    error = (logits.float() - golden["prefill_logits"]).norm() / golden["prefill_logits"].norm()
    assert error < 0.05
    fast_logits = model_bf16.forward_fast(
        torch.cat([fast_input[None], model_bf16.fast_embed(torch.tensor([3]))])[None],
        0,
        model_bf16.new_fast_cache(1),
    )
    assert fast_logits.dtype == torch.bfloat16 and fast_logits.shape == (1, 2, 64)


def test_plan_rejects_overflow(model):
    cache = model.new_slow_cache(max_seq_len=4)
    with pytest.raises(ValueError, match="exceed max_seq_len"):
        cache.plan([0], [5])


@pytest.mark.gpu
@torch.no_grad()
def test_cuda_matches_golden(golden_dir):
    """fp32 on the GPU reproduces the reference logits; bf16 stays close; varlen still holds."""
    golden = torch.load(golden_dir / "s2_tiny" / "golden.pt", weights_only=True)
    expected = golden["prefill_logits"]
    model = load_model(golden_dir / "s2_tiny", device="cuda", dtype=torch.float32)
    logits = model.prefill_logits(golden["prompt"]).cpu()
    assert ((logits - expected).norm() / expected.norm()) < 1e-4
    model_bf16 = load_model(golden_dir / "s2_tiny", device="cuda", dtype=torch.bfloat16)
    logits_bf16 = model_bf16.prefill_logits(golden["prompt"]).float().cpu()
    assert ((logits_bf16 - expected).norm() / expected.norm()) < 0.05
    prompts = [random_prompt(model, length, seed).cuda() for seed, length in enumerate((5, 13))]
    cache = model.new_slow_cache(max_seq_len=16, num_slots=2)
    positions = cache.plan([0, 1], [5, 13])
    hidden = model.forward_slow(torch.cat([p.t() for p in prompts]), positions, cache)
    torch.testing.assert_close(hidden[5:], alone(model, prompts[1]), rtol=1e-4, atol=1e-4)
