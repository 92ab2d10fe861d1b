"""Two prompts through the slow transformer's prefill, by the fused kernels or by the model's
modules, on a paged cache the caller builds (shared by the decode-step and FP8-KV tests)."""

from __future__ import annotations

import torch

SEGMENTS = [(0, 9, 9, [0, 1, 2]), (9, 14, 14, [3, 4, 5, 6])]  # 9 and 14 tokens in pages of 4
POSITIONS = torch.cat([torch.arange(9), torch.arange(14)])


def prefill_tokens(config, seed: int = 5) -> torch.Tensor:
    """Long[23, N+1]: the two prompts' token columns (text ids in row 0, codes below)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 300, (23, config.num_codebooks + 1), generator=g)
    tokens[:, 1:] = torch.randint(0, 64, (23, config.num_codebooks), generator=g)
    return tokens


@torch.no_grad()
def prefill_two_prompts(model, kv, tokens: torch.Tensor, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(last layer's output, final-normed hidden) [23, dim] of `SEGMENTS` written into `kv` (at
    least 7 pages of 4 tokens): the fused-kernel prefill (`DecodeStep.prefill`, the kernels'
    metadata built off CUDA too) or the modules (`model.forward_slow`)."""
    from shoal.engine.decode_step import DecodeStep

    kv.force_kernel_prefill = fused
    step = DecodeStep(model, kv, 4, use_kernels=True)
    kv.set_varlen(SEGMENTS)
    if fused:
        return step.prefill(tokens, POSITIONS, kv._slots, kv._prefill_meta)
    hidden = model.forward_slow(tokens, POSITIONS, kv)
    return hidden, model.norm(hidden)
