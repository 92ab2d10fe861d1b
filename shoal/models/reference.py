"""The oracle: single-request generation in plain PyTorch, following the family's reference loop.

The batched engine must produce exactly these frames for the same prompt, parameters and seed.
`decode_frame` is written batched so the engine can share it; `generate` runs it with B=1 over a
contiguous KV cache. Randomness comes from `sampling.counter_uniform(seed, frame, slot)`, so
the frames depend only on (model, prompt, parameters, seed).

Frame accounting, compared with the reference's `generate`:
- Frame f (f = 0, 1, ...) is `[main id, code 0 .. code N-1]`; frame 0 comes from the prefill.
- Generation stops after the frame whose main token is `<|im_end|>`; that frame IS included
  in the output (as in the reference's `y[:, prompt_len:]`). Unlike the reference, frame 0 is
  checked too (the reference would decode past an `<|im_end|>` from the prefill).
- `max_frames` is clipped to `max_seq_len - prompt_len`, as the reference clips it.
- The codes handed to the codec are `prompt.codes_for_codec(frames)`: rows 1..N without the
  last frame, dropped even when generation stopped at max_frames (the reference's quirk).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from shoal.models.prompt import (
    V15_MAX_LENGTH,
    LongTextHistory,
    Reference,
    Turn,
    VoicePrompt,
    codes_for_codec,
    split_text,
)
from shoal.models.sampling import Sampler, SamplingBatch, new_window, push_frames

if TYPE_CHECKING:
    from shoal.models.dual_ar import DualARTransformer

__all__ = [
    "codes_for_codec",
    "decode_frame",
    "generate",
    "generate_long",
    "iter_generate_long",
    "LongTextBatch",
]


@torch.no_grad()
def decode_frame(
    model: DualARTransformer,
    sampler: Sampler,
    logits: Tensor,
    fast_input: Tensor,
    params: SamplingBatch,
    window: Tensor,
    frame_index: Tensor,
) -> Tensor:
    """One frame for each of B rows: main token from the slow `logits` [B, vocab], then the
    codebooks from the fast model started at `fast_input` [B, dim]. Returns int64 [B, N+1].

    Fast position 0 is the projected slow hidden state (its logits are unused), codebook 0 is
    the main token's semantic index, position k>0 is the embedding of code k-1 and predicts k."""
    config = model.config
    main = sampler.main_token(logits, params, window, frame_index)
    cache = model.new_fast_cache(main.shape[0])
    model.forward_fast(model.fast_project_in(fast_input)[:, None], 0, cache)
    code = sampler.first_code(main, config.codebook_size)
    columns = [main, code]
    for k in range(1, config.num_codebooks):
        fast_logits = model.forward_fast(model.fast_embed(code)[:, None], k, cache)[:, 0]
        code = sampler.codebook(fast_logits, k, params, window, frame_index)
        columns.append(code)
    return torch.stack(columns, dim=1)


@torch.no_grad()
def generate(
    model: DualARTransformer,
    prompt: Tensor,
    *,
    max_frames: int,
    temperature: float,
    top_p: float,
    top_k: int = 30,
    seed: int = 0,
    repetition_penalty: float = 1.1,
) -> Tensor:
    """Frames int32 [N+1, F] continuing `prompt` Long [N+1, T], F <= max_frames.

    `top_k` applies to S2 only, `repetition_penalty` to S1 and 1.5 only (the S2 reference
    ignores it). With S2 and top_k=1 this is the reference's greedy decode."""
    config = model.config
    device = model.embeddings.weight.device
    prompt_len = prompt.shape[1]
    if prompt.shape[0] != config.num_codebooks + 1:
        raise ValueError(f"prompt has {prompt.shape[0]} rows, expected {config.num_codebooks + 1}")
    if prompt_len >= config.max_seq_len:
        raise ValueError(f"prompt length {prompt_len} exceeds max_seq_len {config.max_seq_len}")
    max_frames = min(max_frames, config.max_seq_len - prompt_len)
    if max_frames <= 0:
        return torch.zeros(config.num_codebooks + 1, 0, dtype=torch.int32)

    sampler = Sampler.for_config(config)
    params = SamplingBatch.build(
        sampler.rules,
        temperature=[temperature],
        top_p=[top_p],
        top_k=[top_k],
        repetition_penalty=[repetition_penalty],
        seed=[seed],
        device=device,
    )
    window = new_window(1, sampler.rules.window, config.num_codebooks, device)
    cache = model.new_slow_cache(prompt_len + max_frames)

    positions = cache.plan([0], [prompt_len])
    hidden = model.forward_slow(prompt.t().to(device=device, dtype=torch.long), positions, cache)
    logits, fast_input = model.slow_head(hidden[-1:])

    frames: list[Tensor] = []
    for f in range(max_frames):
        frame_index = torch.tensor([f], dtype=torch.long, device=device)
        frame = decode_frame(model, sampler, logits, fast_input, params, window, frame_index)
        frames.append(frame[0])
        push_frames(window, frame, frame_index)
        if int(frame[0, 0]) == config.im_end_id or f + 1 == max_frames:
            break
        positions = cache.plan([0], [1])
        hidden = model.forward_slow(frame, positions, cache)
        logits, fast_input = model.slow_head(hidden)
    return torch.stack(frames, dim=1).to(torch.int32).cpu()


# ---------------------------------------------------------------------------------------------
# Long text (S2 iterative prompting; S1 generates the whole text in one go)


@dataclass(frozen=True)
class LongTextBatch:
    text: str
    prompt: Tensor  # Long [N+1, T]
    frames: Tensor  # int32 [N+1, F], as `generate` returns them
    codes: Tensor  # [N, F-1], what the reference hands to the codec


def batch_seed(seed: int, batch_index: int) -> int:
    """Seed of batch b of a long text: batch 0 keeps the request's seed, later batches get
    decorrelated streams (their frame counters restart at 0). Signed 64-bit."""
    mixed = (seed + batch_index * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    return mixed - (1 << 64) if mixed >= 1 << 63 else mixed


def generate_long(
    model: DualARTransformer, text: str, references: Sequence[Reference] = (), **options
) -> list[LongTextBatch]:
    """All batches of `iter_generate_long` (same arguments), as the reference returns them."""
    return list(iter_generate_long(model, text, references, **options))


@torch.no_grad()
def iter_generate_long(
    model: DualARTransformer,
    text: str,
    references: Sequence[Reference] = (),
    *,
    chunk_length: int = 300,
    max_frames: int,
    temperature: float,
    top_p: float,
    top_k: int = 30,
    seed: int = 0,
    repetition_penalty: float = 1.1,
    tokenizer=None,
    max_length: int = V15_MAX_LENGTH,
) -> Iterator[LongTextBatch]:
    """The family's reference `generate_long`, one batch at a time as each is generated (so a
    caller can decode and stream a batch while the next one runs): split the text into batches
    (`prompt.split_text`), prompt each batch with the voice plus earlier batches' text and
    generated frames (a fresh prefill per batch), generate batch b with `batch_seed(seed, b)`.

    - S2: batches are speaker turns grouped by `chunk_length` bytes; every earlier batch is in
      the prompt as a user turn + an assistant turn with its codes (no truncation).
    - S1: the whole text is one batch.
    - 1.5: batches are sentences/clauses merged up to `chunk_length` bytes (the reference's
      default is 150); the history slides (`prompt.LongTextHistory`): batch 0 and its audio
      are always kept, then the newest segments that fit in `max_length - 1024 - voice prefix`
      columns (`max_length` is the reference's own argument, default 2048)."""
    config = model.config
    tokenizer = tokenizer if tokenizer is not None else model.tokenizer
    history = LongTextHistory(VoicePrompt(config, tokenizer, references), max_length)
    for index, batch_text in enumerate(split_text(text, chunk_length, config.family)):
        prompt = history.prompt(batch_text)
        frames = generate(
            model,
            prompt,
            max_frames=max_frames,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=batch_seed(seed, index),
            repetition_penalty=repetition_penalty,
        )
        history.append(Turn(batch_text, frames))
        yield LongTextBatch(batch_text, prompt, frames, codes_for_codec(frames))


# `generate_long` takes exactly `iter_generate_long`'s arguments: let `inspect.signature` say so.
functools.update_wrapper(generate_long, iter_generate_long, assigned=(), updated=())
