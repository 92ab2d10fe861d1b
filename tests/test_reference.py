"""The oracle generator on the tiny S2 checkpoint: greedy frames equal the reference's golden ones."""

from __future__ import annotations

import pytest
import torch

from shoal.models import load_model
from shoal.models.prompt import (
    Reference,
    Turn,
    build_prompt,
    codes_for_codec,
    split_text,
    v15_history_window,
    v15_user_turn_length,
    voice_prefix_length,
)
from shoal.models.reference import decode_frame, generate, generate_long
from shoal.models.sampling import Sampler, SamplingBatch, new_window
from shoal.models.writer import tiny_config, write_checkpoint


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


def test_v15_history_window_follows_the_reference_walk():
    # Walk back from the newest: stop at the first i where the total + segment i again exceeds.
    assert v15_history_window([10, 20, 10, 20, 10, 20, 10], 75) == [0, 1, 4, 5, 6]  # i = 3
    assert v15_history_window([5] * 7, 16) == [0, 1, 6]  # i = 2 is even: back to 1
    assert v15_history_window([10, 20, 10, 20, 10], 55) == [0, 1, 2, 3, 4]  # tail reaches turn 0
    assert v15_history_window([10, 20, 10, 20, 10, 20, 10], 1000) == list(range(7))
    assert v15_history_window([7], 1) == [0]
    # The newest segment alone overflows: keep batch 0 + the newest (the reference's [-0:] bug).
    assert v15_history_window([5, 5, 5, 5, 50], 60) == [0, 1, 4]


def test_generate_long_v15_slides_the_history(tmp_path):
    config = write_checkpoint(tmp_path, tiny_config("1.5"), dtype=torch.float32)
    model = load_model(tmp_path)
    assert model.config.family == "1.5" and config.im_end_id == model.config.im_end_id
    text = "One two. Three four. Five six. Seven eight. Nine ten."
    prefix = voice_prefix_length(model.config, model.tokenizer)
    kwargs = dict(chunk_length=12, max_frames=6, temperature=0.7, top_p=0.8, seed=3, repetition_penalty=1.2)
    # max_length leaves room for about two turns of history besides batch 0.
    results = generate_long(model, text, max_length=1024 + prefix + 150, **kwargs)
    assert [r.text for r in results] == split_text(text, 12, "1.5") and len(results) == 5
    turns = [Turn(r.text, r.frames) for r in results]
    n = model.config.num_codebooks
    truncated = False
    for b, result in enumerate(results):
        lengths = []
        for turn in turns[:b]:
            lengths += [v15_user_turn_length(model.tokenizer, turn.text, n), turn.frames.shape[1]]
        lengths.append(v15_user_turn_length(model.tokenizer, result.text, n))
        kept = v15_history_window(lengths, 150)
        history = [turns[k // 2] for k in kept[:-1:2]]
        truncated |= len(history) < b
        expected = build_prompt(model.config, model.tokenizer, result.text, (), history)
        assert torch.equal(result.prompt, expected)
        # History frames go in as generated, the <|im_end|> frame included.
        assert result.frames.shape[0] == n + 1
    assert truncated, "the budget should have dropped some middle batches"
    # Batch 0 and its audio always lead the history once there is one.
    lead = results[1].prompt.shape[1] - v15_user_turn_length(model.tokenizer, results[1].text, n)
    assert torch.equal(results[-1].prompt[:, :lead], results[1].prompt[:, :lead])
    # A generous max_length keeps every earlier batch.
    full = generate_long(model, text, **kwargs)
    for b, result in enumerate(full):
        history = [Turn(r.text, r.frames) for r in full[:b]]
        assert torch.equal(
            result.prompt, build_prompt(model.config, model.tokenizer, result.text, (), history)
        )
