"""Transformer building blocks shared by the slow and the fast DualAR transformers.

Every layer works on flattened tokens `[T, dim]`: which sequence a token belongs to and where its
keys live is the business of the `AttentionBackend`, so the same modules serve a single prompt,
a varlen batch over paged memory, and the fast transformer's dense per-frame cache.

`run_blocks` is the one forward of a stack of blocks. How each of its steps computes is a
`BlockOps` choice: `ReferenceOps` runs the modules below in plain torch (the definition), the
engine's `FusedBlockOps` (`engine/fused_blocks.py`) runs the same steps on the fused kernels.

The arithmetic follows the reference exactly (model.md sections 2 and 12): RMSNorm normalizes in
fp32, casts back, then multiplies by the weight; QK-norm is torch's built-in RMSNorm applied per
head before RoPE; RoPE rotates interleaved pairs in fp32 against bf16-rounded cos/sin tables.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class AttentionBackend(Protocol):
    """Where keys/values live; the seam the engine's paged KV cache plugs into."""

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] for this step's new tokens (QK-norm and RoPE
        already applied). Stores k/v in layer `layer`'s cache at the tokens' positions and
        returns causal attention of each token over its own sequence's cached + new keys,
        [T, Hq, D]. Scale 1/sqrt(D); GQA: kv head j serves q heads j*g .. j*g+g-1."""
        ...


class RMSNorm(nn.Module):
    """The reference's RMSNorm: normalize in fp32, cast back to the input dtype, then scale."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(torch.mean(x32 * x32, dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def embedding(count: int, dim: int) -> nn.Embedding:
    """`nn.Embedding` with its usual init, skipped on the meta device (a checkpoint's weights
    replace it there, and that init imports torch._dynamo into every process that loads a model)."""
    weight = torch.empty(count, dim)
    if weight.device.type != "meta":
        nn.init.normal_(weight)
    return nn.Embedding(count, dim, _weight=weight)


def rope_table(length: int, head_dim: int, base: float, device: torch.device | str | None = None) -> Tensor:
    """cos/sin for positions 0..length-1 as `[length, head_dim // 2, 2]` (cos, sin), computed in
    fp32 and rounded to bf16 as the reference does (an fp32 table drifts from it). On the meta
    device, the shape only: the meta kernels of the arithmetic would import torch._dynamo."""
    if device is not None and torch.device(device).type == "meta":
        return torch.empty(length, head_dim // 2, 2, dtype=torch.bfloat16, device=device)
    exponents = torch.arange(0, head_dim, 2, device=device)[: head_dim // 2].float() / head_dim
    inverse_frequencies = 1.0 / (base**exponents)
    positions = torch.arange(length, device=device)
    angles = torch.outer(positions, inverse_frequencies)
    # torch.polar, not cos/sin, so the fp32 values (and hence their bf16 rounding) follow the
    # reference's kernel on every device.
    unit = torch.polar(torch.ones_like(angles), angles)
    table = torch.stack([unit.real, unit.imag], dim=-1)
    return table.to(torch.bfloat16)


def apply_rope(x: Tensor, table: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) (GPT-J style, not neox halves).

    x [T, H, D]; table [T, D/2, 2] holding the (cos, sin) of each token's position."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos = table[:, None, :, 0]
    sin = table[:, None, :, 1]
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
    return rotated.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Fused-QKV grouped-query attention; the cache and masking live in the backend."""

    def __init__(
        self, layer_index: int, dim: int, n_head: int, n_local_heads: int, head_dim: int, norm_eps: float,
        qkv_bias: bool = False, o_bias: bool = False, qk_norm: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.layer_index = layer_index
        self.n_head = n_head
        self.n_local_heads = n_local_heads
        self.head_dim = head_dim
        self.wqkv = nn.Linear(dim, (n_head + 2 * n_local_heads) * head_dim, bias=qkv_bias)
        self.wo = nn.Linear(n_head * head_dim, dim, bias=o_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = nn.RMSNorm(head_dim, norm_eps)
            self.k_norm = nn.RMSNorm(head_dim, norm_eps)

    def forward(self, x: Tensor, rope: Tensor, backend: AttentionBackend) -> Tensor:
        tokens = x.shape[0]
        q_size = self.n_head * self.head_dim
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(tokens, self.n_head, self.head_dim)
        k = k.view(tokens, self.n_local_heads, self.head_dim)
        v = v.view(tokens, self.n_local_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = apply_rope(q, rope)
        k = apply_rope(k, rope)
        out = backend.attend(self.layer_index, q, k, v)
        return self.wo(out.reshape(tokens, q_size))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, dim: int, intermediate_size: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, intermediate_size, bias=False)
        self.w3 = nn.Linear(dim, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h)), run by `run_blocks`."""

    def __init__(
        self, layer_index: int, dim: int, n_head: int, n_local_heads: int, head_dim: int,
        intermediate_size: int, norm_eps: float, qkv_bias: bool = False, o_bias: bool = False,
        qk_norm: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.attention = Attention(
            layer_index, dim, n_head, n_local_heads, head_dim, norm_eps, qkv_bias, o_bias, qk_norm
        )
        self.feed_forward = FeedForward(dim, intermediate_size)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.attention_norm = RMSNorm(dim, norm_eps)


# The projection a norm's output feeds: (block, "qkv" or "gate_up"); None for the final norm.
Feeds = tuple[TransformerBlock, str] | None


class BlockOps(Protocol):
    """The steps of `run_blocks`; an implementation keeps the residual stream in `residual`."""

    residual: Tensor

    def begin(self, x: Tensor, norm: RMSNorm, feeds: Feeds) -> Tensor:
        """The residual stream starts as `x`; returns norm(x)."""
        ...

    def attention(self, index: int, block: TransformerBlock, normed: Tensor) -> Tensor:
        """Block `index`'s attention output (after wo) for its normed input."""
        ...

    def mlp(self, block: TransformerBlock, normed: Tensor) -> Tensor:
        """The block's SwiGLU output for its normed input."""
        ...

    def add_norm(self, out: Tensor, norm: RMSNorm | None, feeds: Feeds) -> Tensor | None:
        """residual += out; returns norm(residual), None when `norm` is None."""
        ...


def run_blocks(
    blocks: Sequence[TransformerBlock], x: Tensor, final_norm: RMSNorm | None, ops: BlockOps
) -> tuple[Tensor, Tensor | None]:
    """Pre-norm blocks over x [T, dim] -> (last layer's output, final-normed output or None)."""
    normed = ops.begin(x, blocks[0].attention_norm, (blocks[0], "qkv"))
    for i, block in enumerate(blocks):
        normed = ops.add_norm(ops.attention(i, block, normed), block.ffn_norm, (block, "gate_up"))
        if i + 1 < len(blocks):
            following = blocks[i + 1]
            normed = ops.add_norm(ops.mlp(block, normed), following.attention_norm, (following, "qkv"))
        else:
            normed = ops.add_norm(ops.mlp(block, normed), final_norm, None)
    return ops.residual, normed


class ReferenceOps:
    """`BlockOps` in plain torch through the modules, with keys/values in an `AttentionBackend`."""

    def __init__(self, rope: Tensor, backend: AttentionBackend) -> None:
        self.rope, self.backend = rope, backend

    def begin(self, x: Tensor, norm: RMSNorm, feeds: Feeds) -> Tensor:
        self.residual = x
        return norm(x)

    def attention(self, index: int, block: TransformerBlock, normed: Tensor) -> Tensor:
        return block.attention(normed, self.rope, self.backend)

    def mlp(self, block: TransformerBlock, normed: Tensor) -> Tensor:
        return block.feed_forward(normed)

    def add_norm(self, out: Tensor, norm: RMSNorm | None, feeds: Feeds) -> Tensor | None:
        self.residual = self.residual + out
        return None if norm is None else norm(self.residual)
