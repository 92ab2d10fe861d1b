"""The fast transformer's output head, rounded to FP8 so that batch 1 reads half its bytes.

Every frame runs the fast head (codebook_size x fast_dim, S2: 4,096 x 2,560) nine times, and at
batch 1 the head is a read of its weight: 21 MB in bf16 per pass. An FP8 engine
(`EngineConfig.fp8_fast_head`, on by default) rounds it once when it starts:
- every 128 x 128 block gets a power-of-two scale, the smallest with |w| / scale <= 448
  (`round_to_e4m3_blocks`), and each weight becomes the nearest e4m3 value times that scale;
- the module keeps those rounded values as its (bf16) weight, which every path multiplies with
  (prefill, cuBLAS at larger batches, the reference decode), and beside them the e4m3 codes and
  scales (`weight_fp8`, `weight_scale`) that `kernels/output_head.py` reads at batch 1.
Because the scales are powers of two, code times scale is exact in bf16 and the kernel's scaled
products equal the bf16 weight's: both read the same weights, only the bytes differ.

Why only the fast head: it runs nine times per frame, the slow head once (and S2's slow head is
the tied embedding table, which the embedding lookup must keep exact). The logits are not
quantized: activations and outputs stay bf16. The correctness gate (`shoal gate correctness`)
decodes through this head; docs/quantization.md has the numbers.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shoal.kernels.reference import dequantize_weight, quantize_weight

# The module names rounded by `round_fast_head_`.
FP8_HEAD_MODULES = ("fast_output",)


def round_to_e4m3_blocks(weight: Tensor) -> tuple[Tensor, Tensor]:
    """float [N, K] -> (e4m3 [N, K], fp32 power-of-two scales [ceil(N/128), ceil(K/128)]): per
    128 x 128 block the smallest power of two s >= 2^-100 with amax / s <= 448 (1 for a zero block),
    codes = w / s rounded to nearest even (`reference.quantize_weight`'s power-of-two rule).
    Rounding already rounded weights returns the same codes and scales."""
    return quantize_weight(weight, power_of_two_scales=True)


class Fp8RoundedHead(nn.Linear):
    """A bias-free linear whose weight holds e4m3-rounded values (model dtype), with the codes and
    scales beside it as non-persistent buffers (a checkpoint written from the model keeps the
    weight only)."""

    weight_fp8: Tensor
    weight_scale: Tensor

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear) -> Fp8RoundedHead:
        if linear.bias is not None:
            raise ValueError("an FP8 rounded head has no bias")
        weight = linear.weight
        head = cls(linear.in_features, linear.out_features, bias=False, device="meta")
        codes, scale = round_to_e4m3_blocks(weight)
        exact = dequantize_weight(codes, scale)
        rounded = exact.to(weight.dtype)
        if not torch.equal(rounded.float(), exact):
            raise ValueError(
                f"{weight.dtype} cannot hold the fast head's e4m3-rounded weights exactly: run with"
                " fp8_fast_head=False"
            )
        head.weight = nn.Parameter(rounded, requires_grad=False)
        head.register_buffer("weight_fp8", codes, persistent=False)
        head.register_buffer("weight_scale", scale, persistent=False)
        return head


@torch.no_grad()
def round_fast_head_(model: nn.Module) -> list[str]:
    """Replace the model's fast head (`FP8_HEAD_MODULES`) by its `Fp8RoundedHead`, in place; a head
    already rounded is left as it is. Returns the names replaced."""
    replaced = []
    for name in FP8_HEAD_MODULES:
        linear = getattr(model, name, None)
        if isinstance(linear, nn.Linear) and not isinstance(linear, Fp8RoundedHead):
            setattr(model, name, Fp8RoundedHead.from_linear(linear))
            replaced.append(name)
    return replaced
