"""The DualAR transformer: a slow (text/semantic) transformer plus a fast (codebook) transformer.

One frame of speech = one slow step (predicts the main token: a semantic token whose id carries
codebook 0, or `<|im_end|>`) followed by N fast steps over the codebooks. Module and parameter
names are the reference's native ones (`embeddings`, `layers.i.attention.wqkv`, `fast_layers`...),
so a flat `model.pth` loads as is and S2's file keys map onto them one to one
(`checkpoint.py`). Method signatures are fixed by docs/contracts.md.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shoal.models.config import ModelConfig
from shoal.models.kv import ContiguousKVCache, FastKVCache
from shoal.models.layers import (
    AttentionBackend,
    BlockOps,
    ReferenceOps,
    RMSNorm,
    TransformerBlock,
    embedding,
    rope_table,
    run_blocks,
)


class DualARTransformer(nn.Module):
    def __init__(self, config: ModelConfig, tokenizer: Any = None) -> None:
        super().__init__()
        self.config = config
        self.tokenizer = tokenizer
        # Slow transformer.
        self.embeddings = embedding(config.vocab_size, config.dim)
        self.codebook_embeddings = embedding(config.codebook_size * config.num_codebooks, config.dim)
        self.layers = nn.ModuleList(
            TransformerBlock(
                i,
                config.dim,
                config.n_head,
                config.n_local_heads,
                config.head_dim,
                config.intermediate_size,
                config.norm_eps,
                config.attention_qkv_bias,
                config.attention_o_bias,
                config.attention_qk_norm,
            )
            for i in range(config.n_layer)
        )
        self.norm = RMSNorm(config.dim, config.norm_eps)
        if not config.tie_word_embeddings:
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Fast transformer. A projection exists only when the dims differ (no public model).
        if config.fast_dim != config.dim:
            self.fast_project_in: nn.Module = nn.Linear(config.dim, config.fast_dim)
        else:
            self.fast_project_in = nn.Identity()
        self.fast_embeddings = embedding(config.codebook_size, config.fast_dim)
        self.fast_layers = nn.ModuleList(
            TransformerBlock(
                j,
                config.fast_dim,
                config.fast_n_head,
                config.fast_n_local_heads,
                config.fast_head_dim,
                config.fast_intermediate_size,
                config.norm_eps,
                config.fast_attention_qkv_bias,
                config.fast_attention_o_bias,
                config.fast_attention_qk_norm,
            )
            for j in range(config.n_fast_layer)
        )
        self.fast_norm = RMSNorm(config.fast_dim, config.norm_eps)
        self.fast_output = nn.Linear(config.fast_dim, config.codebook_size, bias=False)
        self.build_rope_tables(self.embeddings.weight.device)
        self.register_buffer("codebook_offsets", self._codebook_offsets(), persistent=False)

    def _codebook_offsets(self, device: torch.device | str | None = None) -> Tensor:
        n, size = self.config.num_codebooks, self.config.codebook_size
        # One arange with a step: on the meta device a multiply would import torch._dynamo.
        return torch.arange(0, n * size, size, device=device or self.embeddings.weight.device)

    def build_rope_tables(self, device: torch.device | str) -> None:
        """(Re)compute the non-persistent buffers, e.g. after loading weights onto meta-built modules."""
        c = self.config
        slow = rope_table(c.max_seq_len, c.head_dim, c.rope_base, device)
        fast = rope_table(c.num_codebooks, c.fast_head_dim, c.rope_base, device)  # slow rope_base
        self.register_buffer("rope", slow, persistent=False)
        self.register_buffer("fast_rope", fast, persistent=False)
        if hasattr(self, "codebook_offsets"):
            self.register_buffer("codebook_offsets", self._codebook_offsets(device), persistent=False)

    @property
    def family(self) -> str:
        return self.config.family

    # ---- slow transformer ---------------------------------------------------------------

    def embed(self, tokens: Tensor) -> Tensor:
        """tokens Long[T, N+1] -> [T, dim]: token embedding + the sum of all N codebook
        embeddings at semantic positions (codebook 0 included), scaled by 1/sqrt(N+1) there
        for S1/S2."""
        c = self.config
        token_ids = tokens[:, 0]
        is_semantic = (token_ids >= c.semantic_begin_id) & (token_ids <= c.semantic_end_id)
        codebook_sum = self.codebook_embeddings(tokens[:, 1:] + self.codebook_offsets).sum(dim=1)
        codebook_sum = torch.where(is_semantic[:, None], codebook_sum, torch.zeros_like(codebook_sum))
        x = self.embeddings(token_ids) + codebook_sum
        if c.scale_codebook_embeddings:
            x = torch.where(is_semantic[:, None], x / math.sqrt(c.num_codebooks + 1), x)
        return x

    def forward_slow(self, tokens: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """tokens Long[T, N+1] of several sequences flattened, positions Long[T] -> the last
        layer's output [T, dim] (before the final norm). `attn` knows the sequence boundaries."""
        hidden, _ = self.run_slow(
            self.embed(tokens), ReferenceOps(self.rope[positions], attn), final_norm=False
        )
        return hidden

    def run_slow(self, x: Tensor, ops: BlockOps, final_norm: bool = True) -> tuple[Tensor, Tensor | None]:
        """The slow blocks over embedded rows x [T, dim] -> (last layer's output, its final norm),
        computed by `ops` (the torch reference or the engine's fused kernels)."""
        return run_blocks(self.layers, x, self.norm if final_norm else None, ops)

    def slow_head(self, hidden: Tensor) -> tuple[Tensor, Tensor]:
        """hidden [B, dim] -> (logits [B, vocab], fast_input [B, dim]). fast_input is the
        post-norm hidden for S2, the pre-norm hidden for S1/1.5."""
        normed = self.norm(hidden)
        if self.config.tie_word_embeddings:
            logits = F.linear(normed, self.embeddings.weight)
        else:
            logits = self.output(normed)
        fast_input = normed if self.config.norm_fastlayer_input else hidden
        return logits, fast_input

    @torch.no_grad()
    def prefill_last(self, prompt: Tensor) -> tuple[Tensor, Tensor]:
        """One prompt Long[N+1, T] -> (logits [vocab], fast_input [dim]) at its last position."""
        cache = self.new_slow_cache(prompt.shape[1])
        positions = cache.plan([0], [prompt.shape[1]])
        hidden = self.forward_slow(prompt.t().to(self.rope.device), positions, cache)
        logits, fast_input = self.slow_head(hidden[-1:])
        return logits[0], fast_input[0]

    def prefill_logits(self, prompt: Tensor) -> Tensor:
        """One prompt Long[N+1, T] -> logits [vocab] at its last position."""
        return self.prefill_last(prompt)[0]

    def new_slow_cache(self, max_seq_len: int, num_slots: int = 1) -> ContiguousKVCache:
        c = self.config
        weight = self.embeddings.weight
        return ContiguousKVCache(
            c.n_layer, c.n_local_heads, c.head_dim, max_seq_len, num_slots, weight.dtype, weight.device
        )

    # ---- fast transformer ---------------------------------------------------------------

    def fast_embed(self, codes: Tensor) -> Tensor:
        """codes Long[B] (one codebook's values) -> [B, fast_dim]."""
        return self.fast_embeddings(codes)

    def forward_fast(self, x: Tensor, start_pos: int, cache: FastKVCache) -> Tensor:
        """x [B, S, fast_dim] at fast positions start_pos..start_pos+S-1 -> logits
        [B, S, codebook_size]; logits at position k predict code k."""
        batch, steps, _ = x.shape
        cache.set_window(start_pos, steps)
        rope = self.fast_rope[start_pos : start_pos + steps].repeat(batch, 1, 1)
        _, normed = self.run_fast(x.reshape(batch * steps, -1), ReferenceOps(rope, cache))
        return self.fast_output(normed).view(batch, steps, -1)

    def run_fast(self, x: Tensor, ops: BlockOps) -> tuple[Tensor, Tensor]:
        """The fast blocks over rows x [T, fast_dim] -> (last layer's output, its final norm)."""
        return run_blocks(self.fast_layers, x, self.fast_norm, ops)

    def new_fast_cache(self, batch: int) -> FastKVCache:
        c = self.config
        weight = self.fast_embeddings.weight
        return FastKVCache(
            c.n_fast_layer, batch, c.fast_n_local_heads, c.num_codebooks, c.fast_head_dim, weight.dtype,
            weight.device,
        )  # fmt: skip
