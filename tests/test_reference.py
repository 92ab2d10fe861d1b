"""The oracle generator on the tiny S2 checkpoint: greedy frames equal the reference's golden ones."""

from __future__ import annotations

import pytest
import torch

from shoal.models import load_model
from shoal.models.prompt import Reference, Turn, build_prompt, codes_for_codec
from shoal.models.reference import decode_frame, generate, generate_long
from shoal.models.sampling import Sampler, SamplingBatch, new_window


@pytest.fixture(scope="module")
def s2_model(golden_dir):
    return load_model(golden_dir / "s2_tiny")


@pytest.fixture(scope="module")
def golden(golden_dir):
    return torch.load(golden_dir / "s2_tiny" / "golden.pt", weights_only=True)


def test_greedy_frames_match_golden(s2_model, golden):
    frames = generate(s2_model, golden["prompt"], max_frames=8, temperature=0.7, top_p=0.8, top_k=1, seed=11)
    assert frames.dtype == torch.int32
    assert torch.equal(frames, golden["greedy_frames"])


def test_sampled_generation_is_seed_deterministic(s2_model, golden):
    kwargs = dict(max_frames=12, temperature=1.0, top_p=0.9, top_k=30)
    a = generate(s2_model, golden["prompt"], seed=5, **kwargs)
    b = generate(s2_model, golden["prompt"], seed=5, **kwargs)
    c = generate(s2_model, golden["prompt"], seed=6, **kwargs)
    assert torch.equal(a, b)
    assert not torch.equal(a[:, : min(a.shape[1], c.shape[1])], c[:, : min(a.shape[1], c.shape[1])])
    config = s2_model.config
    main = a[0].long()
    assert bool((((main >= config.semantic_begin_id) & (main <= config.semantic_end_id)) | (main == 7)).all())
    assert bool((a[1:] >= 0).all() and (a[1:] < config.codebook_size).all())
    assert torch.equal(a[1], (main - config.semantic_begin_id).clamp(0, config.codebook_size - 1).int())


def test_stops_after_im_end_and_includes_it(s2_model, golden):
    config = s2_model.config
    for seed in range(40):
        frames = generate(
            s2_model, golden["prompt"], max_frames=40, temperature=1.0, top_p=0.9, top_k=30, seed=seed
        )
        if frames.shape[1] < 40:
            break
    else:
        pytest.fail("no seed reached <|im_end|> within 40 frames")
    assert frames[0, -1].item() == config.im_end_id
    assert (frames[0, :-1] != config.im_end_id).all()
    assert codes_for_codec(frames).shape == (config.num_codebooks, frames.shape[1] - 1)


def test_max_frames_and_context_limit(s2_model, golden):
    frames = generate(s2_model, golden["prompt"], max_frames=3, temperature=0.7, top_p=0.8, top_k=1, seed=0)
    assert frames.shape == (5, 3)
    long_prompt = golden["prompt"].repeat(1, 5)  # 120 of the tiny model's 128 positions
    room = s2_model.config.max_seq_len - long_prompt.shape[1]
    frames = generate(s2_model, long_prompt, max_frames=10_000, temperature=0.7, top_p=0.8, top_k=1, seed=0)
    assert 1 <= frames.shape[1] <= room
    with pytest.raises(ValueError):
        generate(s2_model, golden["prompt"].repeat(1, 6), max_frames=1, temperature=0.7, top_p=0.8, seed=0)


def test_decode_frame_rows_do_not_depend_on_the_batch(s2_model, golden):
    """The engine batches decode_frame: a row's frame must equal the frame computed alone."""
    model = s2_model
    sampler = Sampler.for_config(model.config)
    logits, fast_input = model.prefill_last(golden["prompt"])
    other_prompt = golden["prompt"][:, :15]
    other_logits, other_fast_input = model.prefill_last(other_prompt)
    params = SamplingBatch.build(
        sampler.rules, temperature=[0.9, 0.6], top_p=[0.85, 0.7], top_k=[30, 10], seed=[77, 3]
    )
    window = new_window(2, sampler.rules.window, model.config.num_codebooks)
    frame_index = torch.tensor([2, 0])
    batch = decode_frame(
        model,
        sampler,
        torch.stack([logits, other_logits]),
        torch.stack([fast_input, other_fast_input]),
        params,
        window,
        frame_index,
    )
    alone_params = SamplingBatch.build(sampler.rules, temperature=[0.9], top_p=[0.85], top_k=[30], seed=[77])
    alone = decode_frame(
        model, sampler, logits[None], fast_input[None], alone_params, window[:1], frame_index[:1]
    )
    assert torch.equal(batch[0], alone[0])


def test_generate_long_prompts_each_batch_with_the_earlier_audio(golden_dir):
    case = torch.load(golden_dir / "s2_tiny" / "golden_prompts.pt", weights_only=True)["cases"][3]
    # The golden long-text prompts outgrow the tiny model's 128 positions: widen its RoPE table.
    s2_model = load_model(golden_dir / "s2_tiny")
    s2_model.config = s2_model.config.replace(max_seq_len=512)
    s2_model.build_rope_tables("cpu")
    references = [
        Reference(t, c) for t, c in zip(case["reference_texts"], case["reference_codes"], strict=True)
    ]
    results = generate_long(
        s2_model,
        case["text"],
        references,
        chunk_length=case["chunk_length"],
        max_frames=3,
        temperature=0.7,
        top_p=0.8,
        top_k=1,
        seed=1,
    )
    assert [r.text for r in results] == case["batch_texts"]
    assert torch.equal(results[0].prompt, case["prompts"][0])
    history = []
    for result in results:
        expected = build_prompt(s2_model.config, s2_model.tokenizer, result.text, references, history)
        assert torch.equal(result.prompt, expected)
        assert torch.equal(result.codes, codes_for_codec(result.frames))
        history.append(Turn(result.text, result.frames))
    assert results[-1].prompt.shape[1] > results[0].prompt.shape[1] + 3 * 2
