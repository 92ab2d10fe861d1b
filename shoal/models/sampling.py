"""Per-family sampling rules, batched with per-row parameters, and counter-based randomness.

One set of functions serves the single-request oracle (`models/reference.py`, B=1) and the
batching engine (B = running requests). Every row carries its own temperature / top-p / top-k /
repetition penalty / seed, so rows of different requests never influence each other.

Rules per family (research/model.md section 6):

- S2 (fish-speech HEAD): the main token is constrained to the semantic ids + `<|im_end|>`;
  top-p on the *untempered* distribution, then top-k (30 by default), then temperature;
  Repetition-Aware Sampling (RAS): when the normal draw is a semantic token already among the
  main tokens of the window (10 frames), the draw of a second distribution (T=1.0, top-p 0.9)
  is used instead. Codebooks use the same parameters, no mask, no RAS. Parameters are rounded
  to bfloat16 first, as the reference passes them as bf16 tensors (top_p 0.9 -> 0.8984375).
- S1-mini (fish-speech 0.1.0 on PyPI): unconstrained, no top-k, no RAS; repetition penalty over a
  16-frame window. Quirk kept: the main token is penalised with the N+1 values of the *oldest
  frame* in the window (`window[:, 0]`); codebook k with the last 16 values of codebook k.
  Codebook logits are truncated to their first 1024 entries. Parameters rounded to bf16.
- Fish Speech 1.5 (v1.5.1): like S1 but the main token is penalised with the last 16 main
  tokens, no truncation, float32 parameters.

The previous-frames window, int32 `[B, W, N+1]`, oldest frame first, zero-initialised, holds the
last W frames *of index >= 1*: the reference never puts frame 0 (the prefill frame) into its
window. The sampler is told each row's frame index `frame` (0 = the prefill frame): frame 0 gets
neither penalty nor RAS, frame f >= 1 uses the window.

Randomness (`counter_uniform`) is a pure integer hash of (seed, frame, slot, column), so a
request draws the same numbers alone or in any batch, and a Triton kernel can reproduce it bit
for bit. All arithmetic is on unsigned 32-bit values:

    fmix32(h): h ^= h >> 16; h *= 0x85EBCA6B; h ^= h >> 13; h *= 0xC2B2AE35; h ^= h >> 16
    h = fmix32(seed_lo ^ 0x243F6A88); h = fmix32(h ^ seed_hi); h = fmix32(h ^ frame_lo32)
    h = fmix32(h ^ slot)
    u(c) = fmix32(h ^ (c * 0x9E3779B9 mod 2**32))          # column c
    U(c) = float32(float32(u(c) >> 8) + 0.5) * 2**-24       # float32 arithmetic throughout

Slots: 0 the main token, 1 the main token's RAS resample, 1+k codebook k (k = 1..N-1).
The draw is the reference's exponential race `argmax(probs / E)`, `E = -log(U)`. In float32,
`(2**24 - 1) + 0.5` rounds (ties-to-even) to 2**24, so U can be exactly 1.0 (E = -0.0) with
probability 2**-24 per column; such a column, like any zero-probability column, never wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from shoal.models.config import ModelConfig

MASK32 = 0xFFFFFFFF
SEED_SALT = 0x243F6A88
COLUMN_STEP = 0x9E3779B9
MAIN_SLOT = 0
RAS_SLOT = 1
# The reference's `max(temperature, 1e-5)` / `torch.clip(temperature, min=1e-5)`.
TEMPERATURE_FLOOR = 1e-5


def codebook_slot(codebook: int) -> int:
    """Random-stream slot of codebook k >= 1 (codebook 0 comes from the main token)."""
    return 1 + codebook


# ---------------------------------------------------------------------------------------------
# Counter-based uniforms


def _mul32(h: Tensor, constant: int) -> Tensor:
    """(h * constant) mod 2**32 for 0 <= h < 2**32, without overflowing int64."""
    low = h * (constant & 0xFFFF)
    high = ((h * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def fmix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser on int64 tensors holding uint32 values."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def counter_uniform_columns(seed: Tensor, frame: Tensor, slot: int, columns: Tensor) -> Tensor:
    """Uniforms for the given column ids only: float32 [B, len(columns)].

    Lets a caller that holds a compacted row (say S2's semantic ids + `<|im_end|>`) draw exactly
    the numbers the full row would have drawn at those vocabulary ids."""
    seed = seed.to(torch.int64)
    h = fmix32((seed & MASK32) ^ SEED_SALT)
    h = fmix32(h ^ ((seed >> 32) & MASK32))
    h = fmix32(h ^ (frame.to(torch.int64) & MASK32))
    h = fmix32(h ^ (slot & MASK32))
    column_keys = _mul32(columns.to(device=h.device, dtype=torch.int64) & MASK32, COLUMN_STEP)
    bits = fmix32(h[:, None] ^ column_keys[None, :])
    return ((bits >> 8).to(torch.float32) + 0.5) * (2.0**-24)


def counter_uniform(seed: Tensor, frame: Tensor, slot: int, n: int) -> Tensor:
    """float32 [B, n] uniforms in (0, 1] for columns 0..n-1 (see the module docstring)."""
    return counter_uniform_columns(seed, frame, slot, torch.arange(n, device=seed.device))


def exponential_race(probs: Tensor, uniforms: Tensor) -> Tensor:
    """Index drawn from each row of `probs` [B, V]: argmax(probs / -log U), as the reference.

    Zero-probability columns (and the 2**-24-rare U == 1.0 columns) are excluded explicitly so
    that no 0/0 NaN can win the argmax."""
    race = probs / -torch.log(uniforms)
    race = torch.where((probs > 0) & (uniforms < 1.0), race, torch.full_like(race, -1.0))
    return race.argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# Distribution shaping


def round_to_bf16(values: Tensor) -> Tensor:
    """float32 values rounded to the nearest bfloat16, as the reference's bf16 parameter tensors."""
    return values.to(torch.bfloat16).to(torch.float32)


def logits_to_probs(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor) -> Tensor:
    """Reference `logits_to_probs`, batched: float32 [B, V] -> probabilities [B, V].

    Sort descending; drop ranks whose cumulative (untempered) probability exceeds top_p or whose
    rank is >= top_k, always keeping rank 0; then divide by max(temperature, 1e-5); softmax.
    No in-place write and no host value, so a CUDA graph can capture it."""
    logits = logits.float()
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    remove_sorted = (cumulative > top_p[:, None]) | (ranks[None, :] >= top_k[:, None])
    remove_sorted = remove_sorted & (ranks[None, :] > 0)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    logits = logits.masked_fill(remove, float("-inf"))
    logits = logits / torch.clamp(temperature, min=TEMPERATURE_FLOOR)[:, None]
    return torch.softmax(logits, dim=-1)


def draw(
    logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor, frame: Tensor,
    slot: int, columns: Tensor,
) -> Tensor:  # fmt: skip
    """The id `columns[j]` of the column drawn from each row of `logits` [B, V]; the random
    stream is keyed by the ids, so a restricted row draws what the full row would there."""
    probs = logits_to_probs(logits, temperature, top_p, top_k)
    return columns[exponential_race(probs, counter_uniform_columns(seed, frame, slot, columns))]


def repetition_aware(
    token: Tensor, high: Tensor, window: Tensor, frame: Tensor, semantic_range: tuple[int, int]
) -> Tensor:
    """RAS: a semantic normal draw already among the window's main tokens, at frame >= 1, is
    replaced by the draw `high` of the second distribution."""
    repeated = (window[:, :, 0].long() == token[:, None]).any(dim=1)
    semantic = (token >= semantic_range[0]) & (token <= semantic_range[1])
    return torch.where(repeated & semantic & (frame >= 1), high, token)


def active_penalty(penalty: Tensor, frame: Tensor) -> Tensor:
    """Frame 0 (the prefill frame) is never penalised."""
    return torch.where(frame >= 1, penalty, torch.ones_like(penalty))


def apply_repetition_penalty(logits: Tensor, previous: Tensor, penalty: Tensor) -> Tensor:
    """Reference penalty, batched: each id in `previous` [B, W] has its logit multiplied by
    `penalty` if negative, divided if not, once however often it occurs. Returns a new tensor;
    a row with penalty 1.0 is unchanged bit for bit."""
    index = previous.long()
    scores = torch.gather(logits, -1, index)
    rp = penalty[:, None].to(logits.dtype)
    scores = torch.where(scores < 0, scores * rp, scores / rp)
    return logits.scatter(-1, index, scores)


# ---------------------------------------------------------------------------------------------
# Family rules and the batched sampler


@dataclass(frozen=True)
class FamilyRules:
    """What differs between the reference generation loops of the three families."""

    family: str
    window: int  # frames in the previous-frames window W
    constrain_to_semantic: bool
    use_top_k: bool
    use_ras: bool
    # Which window values penalise the main token: "none", "oldest_frame" (S1), "main_row" (1.5).
    main_penalty: str
    penalize_codebooks: bool
    codebook_logit_limit: int | None  # S1 samples codebooks from logits[:1024]
    bf16_parameters: bool
    ras_temperature: float = 1.0
    ras_top_p: float = 0.9

    def ras_parameters(self, rows: int, device: torch.device | str) -> tuple[Tensor, Tensor]:
        """(temperature, top_p) [rows] of RAS's second distribution, rounded as the family's."""
        high_t = torch.full((rows,), self.ras_temperature, device=device)
        high_p = torch.full((rows,), self.ras_top_p, device=device)
        return (round_to_bf16(high_t), round_to_bf16(high_p)) if self.bf16_parameters else (high_t, high_p)


RULES: dict[str, FamilyRules] = {
    "s2": FamilyRules("s2", 10, True, True, True, "none", False, None, True),
    "s1": FamilyRules("s1", 16, False, False, False, "oldest_frame", True, 1024, True),
    "1.5": FamilyRules("1.5", 16, False, False, False, "main_row", True, None, False),
}

DEFAULT_TOP_K = 30


def rules_for(family: str) -> FamilyRules:
    try:
        return RULES[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}") from None


@dataclass
class SamplingBatch:
    """Per-row sampling parameters, already rounded as the family's reference rounds them."""

    temperature: Tensor  # float32 [B]
    top_p: Tensor  # float32 [B]
    top_k: Tensor  # int64 [B]; families without top-k hold a value >= any vocabulary
    repetition_penalty: Tensor  # float32 [B]; 1.0 where the family has no penalty
    seed: Tensor  # int64 [B]

    @classmethod
    def build(
        cls, rules: FamilyRules, *, temperature: Sequence[float], top_p: Sequence[float], seed: Sequence[int],
        top_k: Sequence[int] | None = None, repetition_penalty: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:  # fmt: skip
        rows = len(temperature)
        temperature_t = torch.tensor(list(temperature), dtype=torch.float32, device=device)
        top_p_t = torch.tensor(list(top_p), dtype=torch.float32, device=device)
        if rules.use_top_k:
            top_k_list = list(top_k) if top_k is not None else [DEFAULT_TOP_K] * rows
        else:
            top_k_list = [2**62] * rows
        if rules.main_penalty != "none" and repetition_penalty is not None:
            penalty_t = torch.tensor(list(repetition_penalty), dtype=torch.float32, device=device)
        else:
            penalty_t = torch.ones(rows, dtype=torch.float32, device=device)
        if rules.bf16_parameters:
            temperature_t, top_p_t, penalty_t = map(round_to_bf16, (temperature_t, top_p_t, penalty_t))
            # The reference clips its bf16 temperature tensor (`torch.clip(t, min=1e-5)`) in bf16,
            # so a tiny temperature becomes bf16(1e-5) = 1.00136e-5, not the fp32 1e-5 that
            # `logits_to_probs` would clamp to.
            temperature_t = round_to_bf16(torch.clamp(temperature_t, min=TEMPERATURE_FLOOR))
        return cls(
            temperature=temperature_t, top_p=top_p_t,
            top_k=torch.tensor(top_k_list, dtype=torch.int64, device=device), repetition_penalty=penalty_t,
            seed=torch.tensor(list(seed), dtype=torch.int64, device=device),
        )  # fmt: skip


def new_window(batch: int, window: int, num_codebooks: int, device: torch.device | str = "cpu") -> Tensor:
    """An empty previous-frames window, int32 [B, W, N+1]."""
    return torch.zeros(batch, window, num_codebooks + 1, dtype=torch.int32, device=device)


def push_frames(window: Tensor, frames: Tensor, frame_index: Tensor) -> None:
    """Shift `frames` [B, N+1] into the window in place, except rows whose frame is frame 0
    (the reference keeps the prefill frame out of its window)."""
    keep = (frame_index >= 1)[:, None, None]
    shifted = torch.cat([window[:, 1:], frames.to(window.dtype)[:, None, :]], dim=1)
    window.copy_(torch.where(keep, shifted, window))


def oldest_window_frame(window: Tensor, frame_index: Tensor) -> Tensor:
    """S1's `window[:, 0]`: the values of the oldest *generated* frame in its 16-wide window.

    The reference window is columns [max(0, i-16), i) of a zero buffer indexed by decode step
    i = frame - 1, so for frames 2..17 its first column is frame 1, which sits at position
    W - (frame - 1) of our shifted window; at frame 1 it is all zeros."""
    width = window.shape[1]
    column = torch.clamp(width - (frame_index - 1), 0, width - 1)
    rows = torch.arange(window.shape[0], device=window.device)
    return window[rows, column]


def sample_main_tokens(
    rules: FamilyRules, logits: Tensor, columns: Tensor, params: SamplingBatch, window: Tensor,
    frame: Tensor, semantic_range: tuple[int, int], ras: tuple[Tensor, Tensor] | None = None,
) -> Tensor:  # fmt: skip
    """The family's main-token rule: main token ids int64 [B] from logits [B, V] whose column j
    is vocabulary id `columns[j]` (the whole vocabulary, or S2's restricted row). Penalty (S1:
    the oldest frame's values, 1.5: the window's main tokens), the normal draw, then RAS. `ras`:
    its (temperature, top_p) rows, when already built (`FamilyRules.ras_parameters`)."""
    logits = logits.float()
    if rules.main_penalty != "none":
        oldest = rules.main_penalty == "oldest_frame"
        previous = oldest_window_frame(window, frame) if oldest else window[:, :, 0]
        logits = apply_repetition_penalty(logits, previous, active_penalty(params.repetition_penalty, frame))
    token = draw(
        logits, params.temperature, params.top_p, params.top_k, params.seed, frame, MAIN_SLOT, columns
    )
    if not rules.use_ras:
        return token
    high_t, high_p = rules.ras_parameters(logits.shape[0], logits.device) if ras is None else ras
    high = draw(logits, high_t, high_p, params.top_k, params.seed, frame, RAS_SLOT, columns)
    return repetition_aware(token, high, window, frame, semantic_range)


def sample_codebook_values(
    rules: FamilyRules, logits: Tensor, codebook: int, params: SamplingBatch, window: Tensor, frame: Tensor
) -> Tensor:
    """The family's codebook rule: values of codebook k >= 1, int64 [B], from the fast model's
    logits [B, codebook_size] (S1: the first 1,024 only; S1 and 1.5: penalised by the window)."""
    logits = logits.float()
    if rules.codebook_logit_limit is not None:
        logits = logits[:, : rules.codebook_logit_limit]
    if rules.penalize_codebooks:
        previous = window[:, :, codebook + 1]
        logits = apply_repetition_penalty(logits, previous, active_penalty(params.repetition_penalty, frame))
    columns = torch.arange(logits.shape[-1], device=logits.device)
    return draw(
        logits, params.temperature, params.top_p, params.top_k, params.seed, frame, codebook_slot(codebook),
        columns,
    )  # fmt: skip


class Sampler:
    """Draws main tokens and codebook values for a batch, following one family's rules."""

    def __init__(self, family: str, semantic_begin_id: int, semantic_end_id: int, im_end_id: int):
        self.rules = rules_for(family)
        self.semantic_begin_id = semantic_begin_id
        self.semantic_end_id = semantic_end_id
        self.im_end_id = im_end_id

    @classmethod
    def for_config(cls, config: ModelConfig) -> Sampler:
        return cls(config.family, config.semantic_begin_id, config.semantic_end_id, config.im_end_id)

    def is_semantic(self, tokens: Tensor) -> Tensor:
        return (tokens >= self.semantic_begin_id) & (tokens <= self.semantic_end_id)

    def constrain(self, logits: Tensor) -> Tensor:
        """S2's logit bias: -inf everywhere but the semantic ids and `<|im_end|>`."""
        allowed = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
        allowed[self.semantic_begin_id : self.semantic_end_id + 1] = True
        allowed[self.im_end_id] = True
        return logits.masked_fill(~allowed, float("-inf"))

    def main_token(
        self, logits: Tensor, params: SamplingBatch, window: Tensor, frame_index: Tensor
    ) -> Tensor:
        """Main token ids, int64 [B], from the slow head's logits [B, vocab]."""
        logits = logits.float()
        if self.rules.constrain_to_semantic:
            logits = self.constrain(logits)
        columns = torch.arange(logits.shape[-1], device=logits.device)
        semantic = (self.semantic_begin_id, self.semantic_end_id)
        return sample_main_tokens(self.rules, logits, columns, params, window, frame_index, semantic)

    def first_code(self, main_token: Tensor, codebook_size: int) -> Tensor:
        """Codebook 0 is the main token's semantic index (clamped, as the reference clamps)."""
        return torch.clamp(main_token - self.semantic_begin_id, 0, codebook_size - 1)

    def codebook(
        self, logits: Tensor, codebook: int, params: SamplingBatch, window: Tensor, frame_index: Tensor
    ) -> Tensor:
        """Values of codebook k >= 1, int64 [B], from the fast model's logits [B, codebook_size]."""
        return sample_codebook_values(self.rules, logits, codebook, params, window, frame_index)


def sample_reference(
    logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, seed: Tensor, frame: Tensor, slot: int,
    token_ids: Tensor | None = None, window: Tensor | None = None,
    semantic_range: tuple[int, int] | None = None, ras_temperature: float = 1.0, ras_top_p: float = 0.9,
) -> Tensor:  # fmt: skip
    """Token ids int64 [B] drawn from logits [B, V] by these rules: the definition
    `kernels/sample.py` is tested against.

    `token_ids` [V] maps column j to its vocabulary id (a restricted S2 row: semantic ids then
    `<|im_end|>`); the random stream is keyed by that id, so a restricted row draws what the full
    constrained row would. With `window` [B, W, N+1] and `semantic_range` (inclusive ids), RAS:
    a semantic normal draw already among the window's main tokens at frame >= 1 is replaced by
    the draw at (ras_temperature, ras_top_p) from slot RAS_SLOT; RAS needs slot == MAIN_SLOT."""
    columns = torch.arange(logits.shape[-1], device=logits.device) if token_ids is None else token_ids
    columns = columns.long()
    token = draw(logits, temperature, top_p, top_k, seed, frame, slot, columns)
    if window is None:
        return token
    assert semantic_range is not None and slot == MAIN_SLOT
    high_t = round_to_bf16(torch.full_like(temperature, ras_temperature))
    high_p = round_to_bf16(torch.full_like(top_p, ras_top_p))
    high = draw(logits, high_t, high_p, top_k, seed, frame, RAS_SLOT, columns)
    return repetition_aware(token, high, window, frame, semantic_range)
