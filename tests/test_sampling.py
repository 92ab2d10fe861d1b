"""Sampling rules against the reference: golden probabilities, the counter hash, RAS, S1 penalty."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.models.sampling import (
    Sampler,
    SamplingBatch,
    apply_repetition_penalty,
    codebook_slot,
    counter_uniform,
    counter_uniform_columns,
    exponential_race,
    logits_to_probs,
    new_window,
    oldest_window_frame,
    push_frames,
    round_to_bf16,
    rules_for,
)

M32 = 0xFFFFFFFF


# ---- golden sampler data ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden_sampler(golden_dir):
    return torch.load(golden_dir / "s2_tiny" / "golden_prompts.pt", weights_only=True)["sampler"]


def _param_columns(params):
    temperature = torch.tensor([p[0] for p in params])
    top_p = torch.tensor([p[1] for p in params])
    top_k = torch.tensor([p[2] for p in params])
    return temperature, top_p, top_k


def test_golden_probs_with_bf16_parameters(golden_sampler):
    temperature, top_p, top_k = _param_columns(golden_sampler["params"])
    probs = logits_to_probs(golden_sampler["logits"], round_to_bf16(temperature), round_to_bf16(top_p), top_k)
    torch.testing.assert_close(probs, golden_sampler["probs"], rtol=1e-6, atol=1e-7)


def test_unrounded_parameters_do_not_match_golden(golden_sampler):
    """The bf16 rounding is observable in the golden data, so it is not optional."""
    temperature, top_p, top_k = _param_columns(golden_sampler["params"])
    probs = logits_to_probs(golden_sampler["logits"], temperature, top_p, top_k)
    assert (probs - golden_sampler["probs"]).abs().max() > 1e-5


def _reference_probs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """fish-speech's `logits_to_probs` (top-p then temperature) for one row, parameters as given."""
    sorted_logits, order = torch.sort(logits, descending=True)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cumulative > top_p
    remove[0] = False
    remove = remove.scatter(-1, order, remove)
    logits = logits.masked_fill(remove, float("-inf")) / torch.clip(temperature, min=1e-5)
    return torch.softmax(logits, dim=-1)


@pytest.mark.parametrize("family", ["s2", "s1"])
@pytest.mark.parametrize("temperature", [1e-6, 5e-6, 0.0])
def test_tiny_temperature_is_clipped_in_bf16_like_the_reference(family, temperature):
    """S2 / S1 clip their bf16 temperature tensor in bf16: the floor is bf16(1e-5), not 1e-5."""
    logits = torch.tensor([0.0, -1e-5, -2e-5, -5.0])
    params = SamplingBatch.build(rules_for(family), temperature=[temperature], top_p=[1.0], seed=[0])
    assert params.temperature.item() == torch.tensor(1e-5, dtype=torch.bfloat16).item()
    expected = _reference_probs(
        logits,
        torch.tensor(temperature, dtype=torch.bfloat16),
        torch.tensor(1.0, dtype=torch.bfloat16),
    )
    probs = logits_to_probs(logits[None], params.temperature, params.top_p, params.top_k)[0]
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=0)


def test_tiny_temperature_floor_is_fp32_for_v15():
    logits = torch.tensor([0.0, -1e-5, -2e-5, -5.0])
    params = SamplingBatch.build(rules_for("1.5"), temperature=[1e-6], top_p=[1.0], seed=[0])
    expected = torch.softmax(logits / max(1e-6, 1e-5), dim=-1)  # v1.5.1: python max()
    probs = logits_to_probs(logits[None], params.temperature, params.top_p, params.top_k)[0]
    torch.testing.assert_close(probs, expected, rtol=1e-6, atol=0)


def test_sampling_batch_rounds_like_the_reference():
    s2 = SamplingBatch.build(rules_for("s2"), temperature=[0.7], top_p=[0.9], seed=[1])
    assert s2.top_p.item() == 0.8984375 and s2.top_k.item() == 30
    assert s2.repetition_penalty.item() == 1.0  # S2 ignores the penalty
    s1 = SamplingBatch.build(
        rules_for("s1"), temperature=[0.7], top_p=[0.9], seed=[1], repetition_penalty=[1.1]
    )
    assert s1.repetition_penalty.item() == 1.1015625
    v15 = SamplingBatch.build(
        rules_for("1.5"), temperature=[0.7], top_p=[0.9], seed=[1], repetition_penalty=[1.2]
    )
    assert v15.top_p.item() == pytest.approx(
        0.9, abs=1e-7
    ) and v15.repetition_penalty.item() == pytest.approx(1.2)


# ---- counter-based uniforms -------------------------------------------------------------------


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _python_uniform(seed: int, frame: int, slot: int, column: int) -> np.float32:
    seed &= 0xFFFFFFFFFFFFFFFF
    h = _fmix32((seed & M32) ^ 0x243F6A88)
    h = _fmix32(h ^ (seed >> 32))
    h = _fmix32(h ^ (frame & M32))
    h = _fmix32(h ^ slot)
    u = _fmix32(h ^ ((column * 0x9E3779B9) & M32))
    return (np.float32(u >> 8) + np.float32(0.5)) * np.float32(2.0**-24)


def test_counter_uniform_matches_the_specified_hash_bit_for_bit():
    seeds = [0, 1, 42, -1, 2**40 + 7, -(2**63), 2**63 - 1]
    frames = [0, 1, 5, 2**32 + 3, 1000, 17, 2]
    for slot in (0, 1, 5):
        got = counter_uniform(torch.tensor(seeds), torch.tensor(frames), slot, 300)
        for row, (seed, frame) in enumerate(zip(seeds, frames, strict=True)):
            expected = np.array([_python_uniform(seed, frame, slot, c) for c in range(300)], dtype=np.float32)
            assert np.array_equal(got[row].numpy(), expected), (seed, frame, slot)


def test_counter_uniform_columns_equal_full_row_at_those_ids():
    seed, frame = torch.tensor([9, 10]), torch.tensor([3, 4])
    full = counter_uniform(seed, frame, 0, 5000)
    ids = torch.tensor([7, 4097, 4999, 0])
    assert torch.equal(counter_uniform_columns(seed, frame, 0, ids), full[:, ids])


def test_counter_uniform_is_batch_independent_and_deterministic():
    seeds, frames = torch.tensor([5, 123456789, -3]), torch.tensor([0, 9, 44])
    batch = counter_uniform(seeds, frames, 2, 1000)
    for row in range(3):
        alone = counter_uniform(seeds[row : row + 1], frames[row : row + 1], 2, 1000)
        assert torch.equal(alone[0], batch[row])
    assert torch.equal(batch, counter_uniform(seeds, frames, 2, 1000))


def test_counter_uniform_streams_differ_by_seed_frame_slot():
    base = counter_uniform(torch.tensor([1]), torch.tensor([1]), 0, 64)
    for other in (
        counter_uniform(torch.tensor([2]), torch.tensor([1]), 0, 64),
        counter_uniform(torch.tensor([1]), torch.tensor([2]), 0, 64),
        counter_uniform(torch.tensor([1]), torch.tensor([1]), 1, 64),
        counter_uniform(torch.tensor([1 + 2**32]), torch.tensor([1]), 0, 64),
    ):
        assert (other != base).float().mean() > 0.9


def test_counter_uniform_range_and_moments():
    u = counter_uniform(torch.arange(200), torch.zeros(200, dtype=torch.long), 0, 2000).flatten()
    assert u.min() > 0 and u.max() <= 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    histogram = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (histogram - 0.1).abs().max() < 0.005


# ---- the exponential race ---------------------------------------------------------------------


def test_exponential_race_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])
    rows = 20000
    uniforms = counter_uniform(torch.arange(rows), torch.zeros(rows, dtype=torch.long), 0, 4)
    draws = exponential_race(probs.expand(rows, 4), uniforms)
    frequencies = torch.bincount(draws, minlength=4).float() / rows
    assert frequencies[3] == 0
    torch.testing.assert_close(frequencies, probs, atol=0.015, rtol=0)


def test_exponential_race_never_picks_a_u_equal_one_or_zero_probability_column():
    probs = torch.tensor([[0.9, 0.1, 0.0]])
    uniforms = torch.tensor([[1.0, 0.5, 0.5]])  # column 0 would give 0.9 / -0.0
    assert exponential_race(probs, uniforms).item() == 1


# ---- repetition penalty and the S1 window quirk ----------------------------------------------------


def test_repetition_penalty_applies_once_per_id_and_by_sign():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.0]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 0, 1, 1, 1]]), torch.tensor([2.0]))
    assert out.tolist() == [[1.0, -4.0, 1.0, 0.0]]
    same = apply_repetition_penalty(logits, torch.tensor([[0, 1]]), torch.tensor([1.0]))
    assert torch.equal(same, logits)


def test_s1_window_matches_the_reference_indexing():
    """Replay S1's decode_n_tokens buffer (`previous_tokens[:, i-16:i]`, frame 0 outside) and
    compare its `window[:, 0]` and codebook rows with our shifted window."""
    torch.manual_seed(0)
    width, num_codebooks, frames = 16, 4, 40
    generated = torch.randint(1, 1000, (frames, num_codebooks + 1), dtype=torch.int32)
    reference_buffer = torch.zeros(num_codebooks + 1, 100, dtype=torch.int32)
    window = new_window(1, width, num_codebooks)
    for f in range(frames):
        frame_index = torch.tensor([f])
        if f >= 1:
            i = f - 1  # the reference's decode step
            ref_window = reference_buffer[:, :width] if i < width else reference_buffer[:, i - width : i]
            assert torch.equal(oldest_window_frame(window, frame_index)[0], ref_window[:, 0]), f
            for k in range(num_codebooks):  # rows as multisets: order does not matter to the penalty
                assert sorted(window[0, :, k + 1].tolist()) == sorted(ref_window[k + 1].tolist()), (f, k)
            reference_buffer[:, i] = generated[f]
        push_frames(window, generated[f : f + 1], frame_index)


def _s1_sampler() -> Sampler:
    return Sampler("s1", semantic_begin_id=32, semantic_end_id=63, im_end_id=5)


def test_s1_main_token_penalty_uses_the_oldest_frame_and_skips_frame_zero():
    sampler = _s1_sampler()
    params = SamplingBatch.build(
        sampler.rules, temperature=[0.7], top_p=[1e-3], seed=[0], repetition_penalty=[4.0]
    )
    logits = torch.zeros(1, 64)
    logits[0, 40], logits[0, 41] = 3.0, 2.0
    window = new_window(1, 16, 2)
    # Frame 0: no penalty at all, the greedy pick is 40.
    assert sampler.main_token(logits, params, window, torch.tensor([0])).item() == 40
    # Frame 3 with frames 1, 2 in the window: frame 1 = [40, ...] is the oldest, so 40 is penalised.
    push_frames(window, torch.tensor([[40, 8, 9]]), torch.tensor([1]))
    push_frames(window, torch.tensor([[41, 8, 9]]), torch.tensor([2]))
    assert sampler.main_token(logits, params, window, torch.tensor([3])).item() == 41
    # 1.5 penalises every main token in the window: 40 and 41 become 0.75 and 0.5, 40 stays first.
    v15 = Sampler("1.5", 32, 63, 5)
    assert v15.main_token(logits, params, window, torch.tensor([3])).item() == 40


def test_s1_codebook_logits_are_truncated_to_1024():
    sampler = _s1_sampler()
    params = SamplingBatch.build(
        sampler.rules, temperature=[1.0], top_p=[1.0], seed=[0], repetition_penalty=[1.0]
    )
    logits = torch.full((1, 4096), -5.0)
    logits[0, 2000] = 50.0
    logits[0, 17] = 0.0
    code = sampler.codebook(logits, 3, params, new_window(1, 16, 10), torch.tensor([0]))
    assert code.item() < 1024


# ---- S2: constraint and RAS ----------------------------------------------------------------------


def _s2_sampler() -> Sampler:
    return Sampler("s2", semantic_begin_id=16, semantic_end_id=31, im_end_id=7)


def test_s2_main_token_is_constrained_to_semantic_and_im_end():
    sampler = _s2_sampler()
    rows = 64
    params = SamplingBatch.build(
        sampler.rules, temperature=[1.5] * rows, top_p=[1.0] * rows, seed=range(rows)
    )
    logits = torch.randn(rows, 40, generator=torch.Generator().manual_seed(1)) * 0.1
    logits[:, 3] = 10.0  # a favourite text token that must never be drawn
    tokens = sampler.main_token(logits, params, new_window(rows, 10, 2), torch.zeros(rows, dtype=torch.long))
    assert bool(((tokens >= 16) & (tokens <= 31) | (tokens == 7)).all())


def test_ras_resamples_a_repeated_semantic_token():
    sampler = _s2_sampler()
    logits = torch.full((1, 40), -10.0)
    logits[0, 20], logits[0, 21], logits[0, 22], logits[0, 7] = 2.0, 1.8, 1.6, 1.7
    params = SamplingBatch.build(sampler.rules, temperature=[1e-4], top_p=[1.0], seed=[0])  # near-greedy
    frame = torch.tensor([3])
    empty = new_window(1, 10, 2)
    assert sampler.main_token(logits, params, empty, frame).item() == 20
    window = new_window(1, 10, 2)
    push_frames(window, torch.tensor([[20, 4, 4]]), torch.tensor([1]))
    resampled = []
    for seed in range(40):
        params = SamplingBatch.build(sampler.rules, temperature=[1e-4], top_p=[1.0], seed=[seed])
        token = sampler.main_token(logits, params, window, frame).item()
        # The high-temperature draw of slot 1: T=1.0, top-p 0.9 (bf16), same top-k.
        high_probs = logits_to_probs(
            sampler.constrain(logits), torch.tensor([1.0]), round_to_bf16(torch.tensor([0.9])), params.top_k
        )
        expected = exponential_race(high_probs, counter_uniform(params.seed, frame, 1, 40)).item()
        assert token == expected
        resampled.append(token)
    assert len(set(resampled)) > 1  # really a second, random draw
    # No RAS at frame 0, and none when the repeated token is not semantic.
    assert sampler.main_token(logits, params, window, torch.tensor([0])).item() == 20
    logits[0, 7] = 5.0
    push_frames(window, torch.tensor([[7, 0, 0]]), torch.tensor([2]))
    assert sampler.main_token(logits, params, window, frame).item() == 7


def test_codebook_slots_and_row_independence():
    sampler = _s2_sampler()
    assert [codebook_slot(k) for k in (1, 2, 9)] == [2, 3, 10]
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    params = SamplingBatch.build(
        sampler.rules, temperature=[0.8, 1.0, 0.5], top_p=[0.8, 0.9, 0.95], top_k=[30, 30, 5], seed=[1, 2, 3]
    )
    frames = torch.tensor([4, 0, 9])
    window = new_window(3, 10, 4)
    batch = sampler.codebook(logits, 2, params, window, frames)
    for row in range(3):
        single = SamplingBatch(
            *(getattr(params, name)[row : row + 1] for name in params.__dataclass_fields__)
        )
        alone = sampler.codebook(
            logits[row : row + 1], 2, single, window[row : row + 1], frames[row : row + 1]
        )
        assert alone.item() == batch[row].item()
