"""`BlockOps` on the fused kernels: the steps of `models.layers.run_blocks` for the decode step,
the fast passes and prefill (CUDA, or the Triton interpreter in tests).

What the fusion changes, step by step, against `models.layers.ReferenceOps`:
- the norms add the residual in the same launch (`kernels.norm_rope.rms_norm`); on a small batch
  they split each row over programs and write the residual stream into the other of two buffers
  (ping-pong) instead of in place;
- with FP8 weights a norm or the attention whose output feeds a W8A8 projection writes it
  quantized (`Fp8Projections.fp8_input`), so no separate quantization launch runs, and a split-K
  GEMM may leave its partials to the kernel that reads its output;
- QK-norm, RoPE and the paged KV write are one launch (`qk_norm_rope_kv_write`) before the
  attention, or, for the fast transformer, one launch with the attention (`rope_attend`);
- the first norm of a fast pass may gather its rows from the code embeddings (`GatheredRows`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from shoal.engine.fp8_weights import SMALL_PREFILL_M, Fp8Projections
from shoal.engine.kv_cache import LayerKV
from shoal.kernels import norm_rope  # through the module, so tests can count the launches
from shoal.kernels.gather_rows import GatheredRows
from shoal.kernels.quant import GROUP
from shoal.models.layers import Feeds, RMSNorm, TransformerBlock
from shoal.tuning import Tuning

# attend(q [T, Hq, D], layer's pages, out_fp8) -> [T, Hq, D], or the `out_fp8` pair it filled.
Attend = Callable[[Tensor, LayerKV, "tuple[Tensor, Tensor] | None"], Tensor]
# rope_attend(layer index, qkv, out_fp8): QK-norm, RoPE, KV write and attention in one call.
RopeAttend = Callable[[int, Tensor, "tuple[Tensor, Tensor] | None"], Tensor]


class FusedBlockOps:
    """One forward's worth of fused ops over `tokens` rows; `pages(i)` gives layer i's KV."""

    def __init__(
        self, tuning: Tuning, fp8: Fp8Projections | None, dtype: torch.dtype, positions: Tensor, rope: Tensor,
        pages: Callable[[int], LayerKV], slots: Tensor, attend: Attend, rope_attend: RopeAttend | None = None,
        fast_qkv_partials: bool = False,
    ) -> None:  # fmt: skip
        self.tuning, self.fp8 = tuning, fp8
        self.positions, self.rope, self.pages, self.slots = positions, rope, pages, slots
        self.attend, self.rope_attend, self.fast_qkv_partials = attend, rope_attend, fast_qkv_partials
        self.fuse_quantization = fp8 is not None and dtype == torch.bfloat16  # kernels quantize bf16
        limit = tuning.norm_max_registers
        self.registers = norm_rope.NORM_MAX_REGISTERS if limit is None else limit or None

    def _fp8_target(self, feeds: Feeds) -> tuple[Tensor, Tensor] | None:
        """The quantized input buffer of the projection `feeds` names, when this launch should
        write it: prefill-sized batches (block-scaled `_scaled_mm` from `SMALL_PREFILL_M` rows on)
        always, decode-sized ones when their norm rows split; the attention's output by switch."""
        if feeds is None or not self.fuse_quantization:
            return None
        block, which = feeds
        if which == "out":
            wanted = self.tuning.fuse_attention_quant
        else:
            wanted = self.tuning.splits_norm_rows(self.tokens) or self.tokens > SMALL_PREFILL_M
        return self.fp8.fp8_input(block, which, self.tokens) if wanted else None

    def begin(self, x: Tensor | GatheredRows, norm: RMSNorm, feeds: Feeds) -> Tensor:
        self.residual = x.out if isinstance(x, GatheredRows) else x  # the first norm writes `out`
        self.tokens = self.residual.shape[0]
        self.slice_groups = self.tuning.norm_slice_groups_for(self.tokens)
        self.spare = torch.empty_like(self.residual) if self.slice_groups else None
        normed, _ = norm_rope.rms_norm(
            x, norm.weight, norm.eps, out_fp8=self._fp8_target(feeds),
            slice_groups=self.slice_groups or None, max_registers=self.registers,
        )  # fmt: skip
        return normed

    def attention(self, index: int, block: TransformerBlock, normed: Tensor) -> Tensor:
        attn, fp8 = block.attention, self.fp8
        if fp8 is None:
            qkv = F.linear(normed, attn.wqkv.weight, attn.wqkv.bias)
        else:  # partials (when unreduced) go to the QK-norm/RoPE kernel or the fast attention
            leave = self.tuning.rope_reduces_partials if self.rope_attend is None else self.fast_qkv_partials
            qkv = fp8.qkv(block, normed, unreduced=leave)
        head_dim = qkv.shape[1] // (attn.n_head + 2 * attn.n_local_heads)
        target = self._fp8_target((block, "out")) if head_dim == GROUP else None  # a head per group
        if self.rope_attend is not None:
            attended = self.rope_attend(index, qkv, target)
        else:
            pools = self.pages(index)
            q = norm_rope.qk_norm_rope_kv_write(
                qkv, self.positions, self.rope, pools.k, pools.v, self.slots, attn.n_head,
                attn.n_local_heads, attn.q_norm.weight if attn.qk_norm else None,
                attn.k_norm.weight if attn.qk_norm else None, attn.q_norm.eps if attn.qk_norm else 1e-6,
                **pools.scales,
            )  # fmt: skip
            attended = self.attend(q, pools, target)  # `target` filled, or [T, Hq, D]
        if target is None:
            attended = attended.reshape(self.tokens, -1)
        if fp8 is None:
            return F.linear(attended, attn.wo.weight, attn.wo.bias)
        return fp8.out_proj(block, attended, unreduced=self.tuning.norm_reduces_partials)

    def mlp(self, block: TransformerBlock, normed: Tensor) -> Tensor:
        ff = block.feed_forward
        if self.fp8 is None:
            return F.linear(
                F.silu(F.linear(normed, ff.w1.weight)) * F.linear(normed, ff.w3.weight), ff.w2.weight
            )
        return self.fp8.mlp(block, normed, unreduced=self.tuning.norm_reduces_partials)

    def add_norm(self, out: Tensor, norm: RMSNorm | None, feeds: Feeds) -> Tensor:
        """residual += out and the norm in one launch; with split rows the sum goes to `spare`."""
        if norm is None:
            raise ValueError("the fused blocks always end with their final norm")
        target = self._fp8_target(feeds)
        if not self.slice_groups:
            normed, _ = norm_rope.rms_norm(
                out, norm.weight, norm.eps, residual=self.residual, out_fp8=target,
                max_registers=self.registers,
            )  # fmt: skip
            return normed
        normed, summed = norm_rope.rms_norm(
            out, norm.weight, norm.eps, residual=self.residual, out_fp8=target, residual_out=self.spare,
            slice_groups=self.slice_groups, max_registers=self.registers,
        )  # fmt: skip
        self.residual, self.spare = summed, self.residual
        return normed
