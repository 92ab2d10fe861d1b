"""`shoal gate correctness`: FP8 must decode what bf16 decodes.

For a fixed prompt, greedy decoding (top_k=1) with FP8 weights must give the bf16
model's frames (`models.reference.generate`) token for token for the first `--frames` frames, and
the relative error of the prompt's logits must stay under `--max-logit-error`. The FP8 frames come
from the batching engine (`--path engine`, the default: `EngineCore` with `weight_format="fp8"`,
i.e. the fused step, FP8 GEMM kernels and CUDA graphs on a GPU) or from the reference generator on
the quantized model (`--path reference`). The logit error is the FP8 model's own forward
(`Fp8Linear`, same activation mode) on the prompt.

Random weights make poor gate models: their logits are nearly flat, so any perturbation flips ties
and the gate would fail on correct code. Without `--checkpoint` the gate builds a small S2-layout
model with *planted* margins (`planted_margin_model`): embeddings are rescaled so the token path
carries most of the residual stream and the transformer blocks a controlled share (`--block-share`,
0.5 by default), and the fast head is tied to the fast embeddings. Greedy then follows a copy
structure with top-1 margins of several nats, while every projection still shapes the logits, so
a misread scale layout moves them far past the limit. Projection weights get a log-normal
per-input-channel spread, as trained weights have, so block scales differ and a transposed scale
really changes the product.
"""

from __future__ import annotations

import argparse
import contextlib
import copy

import torch
from torch import Tensor, nn

from shoal.engine.fp8_validation import (  # the checks the engine runs on served weights
    GREEDY,
    CorrectnessResult,
    check_correctness,
    engine_greedy,
    gate_prompt,
    top1_margin,
)

__all__ = ["GREEDY", "CorrectnessResult", "check_correctness", "engine_greedy", "gate_prompt"]
PLANTED_MARGIN_NATS = 8.0


@torch.no_grad()
def planted_margin_model(
    block_share: float = 0.5, seed: int = 0, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A small S2-layout model whose greedy decoding has margins of several nats (module docstring)."""
    from shoal.models.checkpoint import build_model, load_state_into
    from shoal.models.writer import random_state_dict, tiny_config

    config = tiny_config("s2").replace(
        dim=256, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=512,
        fast_dim=256, fast_head_dim=64, fast_intermediate_size=384, tie_word_embeddings=False,
    )  # fmt: skip
    state = random_state_dict(config, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in state.items():
        if name.endswith(("wqkv.weight", "wo.weight", "w1.weight", "w2.weight", "w3.weight")):
            spread = torch.exp(0.5 * torch.randn(1, tensor.shape[1], generator=generator))
            state[name] = tensor * spread
    state["codebook_embeddings.weight"] *= 0.1
    model = load_state_into(build_model(config), state, "cpu", torch.float32)
    # Rescale the token embeddings so the blocks contribute `block_share` of the final residual.
    prompt = gate_prompt(config)
    tokens = prompt.t()
    cache = model.new_slow_cache(tokens.shape[0])
    embedded = model.embed(tokens)
    final = model.forward_slow(tokens, cache.plan([0], [tokens.shape[0]]), cache)
    gain = float((final - embedded).norm() / embedded.norm()) * (1 - block_share) / block_share
    model.embeddings.weight *= gain
    model.fast_embeddings.weight *= gain
    # Heads = the unit-normed input embeddings (a copy structure), scaled to a margin of ~8 nats.
    unit = model.embeddings.weight / model.embeddings.weight.norm(dim=1, keepdim=True)
    model.output.weight.copy_(unit)
    margin = top1_margin(model.prefill_logits(prompt), config.semantic_begin_id, config.semantic_end_id)
    model.output.weight.mul_(PLANTED_MARGIN_NATS / margin)
    fast_unit = model.fast_embeddings.weight / model.fast_embeddings.weight.norm(dim=1, keepdim=True)
    model.fast_output.weight.copy_(fast_unit * PLANTED_MARGIN_NATS / margin)
    return model.to(dtype)


def run_correctness(args: argparse.Namespace) -> int:
    from shoal.quant.fp8_linear import quantize_model_, verify_model_layout

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if args.checkpoint:
        from shoal.models import load_model

        reference_model = load_model(args.checkpoint, device=device, dtype=dtype)
    else:
        reference_model = planted_margin_model(args.block_share).to(device=device, dtype=dtype)
    fp8_model = copy.deepcopy(reference_model)
    quantize_model_(fp8_model, args.quantize_activations)
    verify_model_layout(fp8_model)
    fp8_frames = None
    if args.path == "engine":

        def fp8_frames(prompt: Tensor, frames: int) -> Tensor:
            return engine_greedy(
                fp8_model, prompt, frames, "fp8", args.quantize_activations, args.kv_cache_dtype
            )

    from shoal.kernels.fp8_gemm import bf16_partials_everywhere

    with bf16_partials_everywhere() if args.bf16_partials else contextlib.nullcontext():
        result = check_correctness(
            reference_model, fp8_model, gate_prompt(reference_model.config), args.frames,
            args.max_logit_error, fp8_frames,
        )  # fmt: skip
    partials = ", split-K partials in bf16" if args.bf16_partials else ""
    kv = ", FP8 KV cache" if args.kv_cache_dtype == "fp8" and args.path == "engine" else ""
    print(f"FP8 frames through the {args.path} path{partials}{kv}")
    print(result.report())
    return 0 if result.passed else 1
