"""FP8 where it is validated: on the weights being served, FP8 greedy frames must equal bf16's.

Block-scaled FP8 doubles the decode rate on Hopper, and a user who never heard of
`--weight-format` should get it, but only where it decodes what bf16 decodes. So a bf16 checkpoint
loaded without an explicit format on a Hopper GPU is checked before it is served: greedy frames of
a fixed prompt from the bf16 model (the reference generator), then the same frames from the
quantized model through the engine's own decode step (fused FP8 kernels, CUDA graph), and the
relative error of the prompt's logits. Equal frames and a small error: serve FP8. Otherwise bf16,
with the reason logged. `shoal gate correctness` runs the same check on a model with planted margins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

log = logging.getLogger("shoal.engine.fp8_validation")

GATE_FRAMES = 5
MAX_LOGIT_ERROR = 0.1
GREEDY = dict(temperature=1.0, top_p=1.0, top_k=1, seed=0)


@dataclass
class CorrectnessResult:
    frames_checked: int
    first_mismatch: int | None  # frame index, None when all equal
    logit_relative_error: float
    top1_margin_nats: float  # bf16's top-1 margin at the prompt's last position
    max_logit_error: float

    @property
    def passed(self) -> bool:
        return self.first_mismatch is None and self.logit_relative_error <= self.max_logit_error

    def report(self) -> str:
        tokens = "equal" if self.first_mismatch is None else f"differ from frame {self.first_mismatch}"
        return (
            f"correctness: {'PASS' if self.passed else 'FAIL'}: "
            f"tokens of {self.frames_checked} frames {tokens}; "
            f"logit relative error {self.logit_relative_error:.4f} (limit {self.max_logit_error}); "
            f"bf16 top-1 margin {self.top1_margin_nats:.2f} nats"
        )


def gate_prompt(config, length: int = 24, seed: int = 0) -> Tensor:
    """A fixed Long[N+1, T] prompt: text-range tokens, then a block of semantic (code) columns."""
    generator = torch.Generator().manual_seed(seed)
    n = config.num_codebooks
    text = torch.randint(0, min(256, config.semantic_begin_id), (length // 2,), generator=generator)
    codes = torch.randint(0, config.codebook_size, (n, length - length // 2), generator=generator)
    prompt = torch.zeros(n + 1, length, dtype=torch.long)
    prompt[0, : text.numel()] = text
    prompt[0, text.numel() :] = config.semantic_begin_id + codes[0]
    prompt[1:, text.numel() :] = codes
    return prompt


def top1_margin(logits: Tensor, begin: int, end: int) -> float:
    """Gap in nats between the best and second-best semantic token: how close greedy is to a tie."""
    top2 = logits[begin : end + 1].float().topk(2).values
    return float(top2[0] - top2[1])


@torch.no_grad()
def engine_greedy(
    model: nn.Module,
    prompt: Tensor,
    frames: int,
    weight_format: str,
    quantize_activations: bool = True,
    kv_cache_dtype: str = "auto",
) -> Tensor:
    """Greedy frames int32 [N+1, F] of one request through the batching engine (`EngineCore`): the
    fused decode step with FP8 kernels and a CUDA graph on a GPU, the reference step on the CPU."""
    from shoal.config import EngineConfig
    from shoal.engine.core import EngineCore
    from shoal.engine.request import SamplingParams

    weight = model.embeddings.weight
    page_size = 16
    config = EngineConfig(
        device=weight.device.type,
        dtype=str(weight.dtype).removeprefix("torch."),
        weight_format=weight_format,
        fp8_quantize_activations=quantize_activations,
        max_running_requests=1,
        page_size=page_size,
        num_pages=-(-(prompt.shape[1] + frames) // page_size) + 2,
        graph_buckets=(1,),
        kv_cache_dtype=kv_cache_dtype,
    )
    core = EngineCore(model, config)
    params = SamplingParams(repetition_penalty=1.0, **GREEDY)
    request = core.new_request(prompt, params, max_new_frames=frames)
    core.add(request)
    while core.has_work:
        core.step()
    return request.frames[: request.num_frames].t().to(torch.int32)


def greedy_reference(model: nn.Module, prompt: Tensor, frames: int) -> Tensor:
    from shoal.models.reference import generate

    return generate(model, prompt, max_frames=frames, **GREEDY)


def compare(
    expected: Tensor,
    actual: Tensor,
    exact_logits: Tensor,
    approx_logits: Tensor,
    config,
    max_logit_error: float,
) -> CorrectnessResult:
    """Frames [N+1, F] and prompt logits of the FP8 side against bf16's."""
    first_mismatch = None
    for f in range(max(expected.shape[1], actual.shape[1])):
        if f >= expected.shape[1] or f >= actual.shape[1] or not torch.equal(expected[:, f], actual[:, f]):
            first_mismatch = f
            break
    exact, approx = exact_logits.float(), approx_logits.float()
    error = float((approx - exact).norm() / exact.norm())
    margin = top1_margin(exact, config.semantic_begin_id, config.semantic_end_id)
    return CorrectnessResult(expected.shape[1], first_mismatch, error, margin, max_logit_error)


@torch.no_grad()
def check_correctness(
    reference_model: nn.Module,
    fp8_model: nn.Module,
    prompt: Tensor,
    frames: int = GATE_FRAMES,
    max_logit_error: float = MAX_LOGIT_ERROR,
    fp8_frames: Callable[[Tensor, int], Tensor] | None = None,
) -> CorrectnessResult:
    """Greedy frames and prompt logits of `fp8_model` against `reference_model`. `fp8_frames(prompt,
    frames)` produces the FP8 side's frames (e.g. `engine_greedy`); default the reference generator."""
    expected = greedy_reference(reference_model, prompt, frames)
    actual = greedy_reference(fp8_model, prompt, frames) if fp8_frames is None else fp8_frames(prompt, frames)
    exact = reference_model.prefill_logits(prompt)
    return compare(
        expected, actual, exact, fp8_model.prefill_logits(prompt), reference_model.config, max_logit_error
    )


@torch.no_grad()
def quantize_if_validated(
    model: nn.Module, frames: int = GATE_FRAMES, max_logit_error: float | None = None
) -> CorrectnessResult:
    """Quantize `model` in place (`fp8_weights.prepare_model`) and check it against its own bf16
    frames and logits, taken first (no second copy of the weights is held). The caller serves FP8
    when the result passed and otherwise reloads the bf16 weights: the quantization is not undone."""
    from shoal.engine.fp8_weights import prepare_model

    prompt = gate_prompt(model.config)
    expected = greedy_reference(model, prompt, frames)
    exact = model.prefill_logits(prompt)
    prepare_model(model)
    actual = engine_greedy(model, prompt, frames, "fp8")
    limit = MAX_LOGIT_ERROR if max_logit_error is None else max_logit_error
    result = compare(expected, actual, exact, model.prefill_logits(prompt), model.config, limit)
    log.info("FP8 on the loaded weights: %s", result.report())
    return result
