"""The decode step the engine replays as a CUDA graph: slow model, restricted head, sampling,
fast loop over the codebooks and window update, for every row of static buffers at once.

Graph-safe by construction: every constant tensor (the S2 head slice and its vocabulary ids,
fast-transformer positions, slots, lengths and block tables, RAS parameters) is built once in
`__init__`; the step only reads and writes its buffers in place; there is no `.item()`, no
host copy and no Python branch on a tensor value. The fast loop is unrolled over the
codebooks, positions 0 and 1 (slow hidden state and code 0) share one 2-token pass.

Two implementations of the same math, chosen per op:
- kernels (CUDA, or the Triton interpreter in tests): `kernels/norm_rope.py` fused RMSNorm
  with residual add and QK-norm + RoPE + paged KV write, `kernels/attention.py` paged
  attention (the fast transformer's per-frame cache is a page per row), `kernels/sample.py`
  for the S2 main token (restricted row + RAS) and the codebooks, `kernels/window.py` (which
  also writes the next step's tokens), `kernels/step_inputs.py` (the slow pass's embedding, fast
  pass 0's input), `kernels/gather_rows.py` (the later passes' code embeddings) and, at batch 1,
  `kernels/output_head.py`: no plain torch kernel is left in a batch-1 step;
- torch ops (CPU): the model's own modules and a graph-safe copy of `models/sampling.py`'s
  rules over the restricted row (`counter_uniform_columns` draws the full row's numbers).

FP8 (`weight_format="fp8"`): on the kernel path the projections run through
`engine/fp8_weights.Fp8Projections` (`self.fp8`, None for a bf16 model, whose lines are unchanged).

S2's main token can only be a semantic id or `<|im_end|>`, so only those 4,097 rows of the
output head are computed (a gathered weight slice, ids in ascending order so ties break as
in the full row).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from shoal.engine.kv_cache import LayerKV
from shoal.models.sampling import (
    MAIN_SLOT,
    RAS_SLOT,
    apply_repetition_penalty,
    codebook_slot,
    counter_uniform_columns,
    exponential_race,
    oldest_window_frame,
    round_to_bf16,
    rules_for,
)

if TYPE_CHECKING:
    from shoal.kernels.gather_rows import GatheredRows

FAST_PAGE = 16  # one page per row holds a frame's fast positions (num_codebooks <= 16)
# The batches (inclusive) whose fast layers keep two launches (QK-norm/RoPE/KV write, then paged
# attention) instead of `kernels/fast_attention.py`'s one; every other batch fuses them.
TWO_LAUNCH_FAST_BATCHES = (17, 39)
# Small decode batches (at most this many rows) split each RMSNorm row over programs of this many
# 128-column groups (`kernels.norm_rope.rms_norm`'s `slice_groups`; 0: one program per row) and
# let the norm write the next W8A8 projection's input quantized. On the H200 (docs/performance.md
# run 23) that took the FP8 step from 4.42 to 4.30 ms at batch 1 and 5.49 to 5.45 at 16; at
# batch 64 the fused quantization was 2% slower (7.04 against 6.91 ms), so bigger batches keep
# one program per row and the separate quantization launch, as prefill does.
# Rows of 9-16 take programs of 8 groups instead (`shoal bench ab`, run 97: batch 16 0.985x; batch
# 8 1.000x and batch 4 1.006x with 8, so they keep 4).
NORM_SLICE_GROUPS = 4
NORM_SLICE_GROUPS_WIDE = 8
NORM_SLICE_WIDE_FROM_ROWS = 9
NORM_SPLIT_MAX_ROWS = 16
# The largest batch whose output heads run `kernels/output_head.py` (weights loaded before the PDL
# wait, one activation row at a time) instead of cuBLAS; larger batches keep cuBLAS.
HEAD_KERNEL_MAX_ROWS = 1
# The largest batch whose fast qkv GEMM leaves its split-K partials to the fused fast attention
# (which then sums them on 8 warps) instead of reducing them itself: batch-1 step 0.997x, batch 16
# 0.992x, but batch 64 1.044x (docs/performance.md run 178). Batches 17-39 run no fused fast
# attention (TWO_LAUNCH_FAST_BATCHES).
FAST_ATTENTION_PARTIALS_MAX_BATCH = 16


def env_switch(name: str, choices: tuple[str, ...]) -> str:
    """An A/B switch read at engine start: the variable's value, `choices[0]` when unset; anything
    else is refused, so a typo cannot silently measure the default."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return value


def sampling_probs(
    logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, ranks: Tensor
) -> Tensor:
    """`models.sampling.logits_to_probs` without the in-place scalar write (graph-safe):
    identical arithmetic, rank 0 always kept."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cumulative = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove_sorted = (cumulative > top_p[:, None]) | (ranks[None, :] >= top_k[:, None])
    remove_sorted = remove_sorted & (ranks[None, :] > 0)
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    logits = logits.masked_fill(remove, float("-inf"))
    logits = logits / torch.clamp(temperature, min=1e-5)[:, None]
    return torch.softmax(logits, dim=-1)


class DecodeStep:
    """One frame per row of a `DecodeBuffers` (runner.py), in place."""

    def __init__(self, model, kv, max_batch: int, use_kernels: bool, max_top_k: int | None = 32) -> None:
        mc = model.config
        self.model, self.kv, self.config = model, kv, mc
        self.rules = rules_for(mc.family)
        weight = model.embeddings.weight
        device, self.dtype = weight.device, weight.dtype
        self.device = device
        self.use_kernels = use_kernels
        self.max_batch = max_batch
        self.max_top_k = max_top_k if self.rules.use_top_k else None
        self.num_codebooks = mc.num_codebooks
        # Output head: S2 needs only the semantic rows and <|im_end|>.
        head = weight if mc.tie_word_embeddings else model.output.weight
        if self.rules.constrain_to_semantic:
            ids = torch.arange(mc.semantic_begin_id, mc.semantic_end_id + 1)
            ids = torch.unique(torch.cat([ids, torch.tensor([mc.im_end_id])]))  # sorted ascending
            self.column_ids = ids.to(device)
            self.head_weight = head.detach()[self.column_ids].contiguous()
        else:
            self.column_ids = torch.arange(mc.vocab_size, device=device)
            self.head_weight = head.detach()
        # cuBLAS picks a slow kernel for S2's 4,097-row slice (a 39 µs CUTLASS fallback at batch 64
        # on the H200, docs/performance.md run 16): on CUDA that slice (a copy already) gets zero
        # rows up to a multiple of 64 and the step reads only the first `head_rows` logits.
        self.head_rows = self.head_weight.shape[0]
        padded_rows = -(-self.head_rows // 64) * 64
        if self.rules.constrain_to_semantic and device.type == "cuda" and padded_rows != self.head_rows:
            padding = self.head_weight.new_zeros(padded_rows - self.head_rows, self.head_weight.shape[1])
            self.head_weight = torch.cat([self.head_weight, padding])
        self.column_ids32 = self.column_ids.to(torch.int32)
        self.main_ranks = torch.arange(self.column_ids.numel(), device=device)
        limit = self.rules.codebook_logit_limit or mc.codebook_size
        self.codebook_columns = min(limit, mc.codebook_size)
        self.codebook_ranks = torch.arange(self.codebook_columns, device=device)
        high_t = torch.full((max_batch,), self.rules.ras_temperature, device=device)
        high_p = torch.full((max_batch,), self.rules.ras_top_p, device=device)
        if self.rules.bf16_parameters:
            high_t, high_p = round_to_bf16(high_t), round_to_bf16(high_p)
        self.ras_temperature, self.ras_top_p = high_t, high_p
        self.kernel_main = (
            use_kernels and self.rules.constrain_to_semantic and self.rules.main_penalty == "none"
        )
        self.kernel_codebooks = use_kernels and not self.rules.penalize_codebooks
        # Programs per sampled row (`kernels.sample.sample_tokens`' `chunks`; None: its default).
        # The chunked kernel's counters are allocated here, never inside a graph capture.
        self.sample_chunks: int | None = None
        if (self.kernel_main or self.kernel_codebooks) and device.type == "cuda":
            from shoal.kernels.sample import chunk_counters

            chunk_counters(device)
        if use_kernels:
            self._init_fast_pages(max_batch)
        # FP8 projections (`engine/fp8_weights.py`) when the model holds Fp8Linear layers; the
        # torch-ops path runs the layers' own forward instead.
        self.fp8 = None
        # Which kernels write the W8A8 projections' inputs already quantized (a launch fewer each).
        # The attention's is free (its merge program quantizes a head per row, run 13) and stays on.
        # The norm's pays only with rows split over programs (one program quantizing a whole row
        # serially cost 0.18 ms per step in run 13): `NORM_SPLIT_MAX_ROWS` above. Switches for
        # same-run A/B runs: `SHOAL_FUSE_NORM_QUANT=auto|0|1` (1: at every decode batch),
        # `SHOAL_NORM_SLICE_GROUPS` (one size for every split norm; 0: never split rows).
        switch = env_switch("SHOAL_FUSE_NORM_QUANT", ("auto", "0", "1"))
        self.norm_split_max_rows = {"auto": NORM_SPLIT_MAX_ROWS, "0": 0, "1": max_batch * 2}[switch]
        groups = os.environ.get("SHOAL_NORM_SLICE_GROUPS")
        self.norm_slice_groups = None if groups is None else int(groups)  # None: by rows
        # The norms' register limit: None `kernels.norm_rope.NORM_MAX_REGISTERS`, 0 ptxas's choice.
        self.norm_max_registers: int | None = None
        self.fuse_attention_quant = os.environ.get("SHOAL_FUSE_ATTN_QUANT", "1") != "0"
        # FP8 projections leave their split-K partials to the kernel that reads their output
        # (`kernels.fp8_gemm.SplitKPartials`): the GEMM skips its arrival atomic and reduction,
        # the consumer sums the partials while loading (same bits). o and down: the norm after
        # them; qkv: the QK-norm/RoPE/KV-write kernel, and in the fast transformer the fused fast
        # attention up to batch `fast_attention_partials_max_batch` (FAST_ATTENTION_PARTIALS_MAX_BATCH).
        # `SHOAL_SPLITK_CONSUMER=1|norm|0`: all of them, o and down only, none.
        switch = env_switch("SHOAL_SPLITK_CONSUMER", ("1", "norm", "0"))
        self.norm_reduces_partials = switch != "0"
        self.rope_reduces_partials = switch == "1"
        self.fast_attention_partials_max_batch = FAST_ATTENTION_PARTIALS_MAX_BATCH if switch == "1" else 0
        # The fast transformer's QK-norm/RoPE/KV write and attention as one launch per layer
        # (`kernels/fast_attention.py`) except for batches `two_launch_fast_from..to`: on the H200
        # the fused launch took the step from 4.46 to 4.42 ms at batch 1 (run 20), 5.41 to 5.37 at
        # 16 (run 21); by `shoal bench ab` (run 94) 0.986x at 64, 0.965x at 128, 0.973x at 96,
        # 0.989-0.995x at 40-56, but 1.008x at 24 and 1.023x at 32.
        # `SHOAL_FUSED_FAST_ATTENTION=1` / `0`: always / never.
        switch = env_switch("SHOAL_FUSED_FAST_ATTENTION", ("auto", "0", "1"))
        never = (1, 1 << 30)
        ranges = {"auto": TWO_LAUNCH_FAST_BATCHES, "0": never, "1": (1, 0)}
        self.two_launch_fast_from, self.two_launch_fast_to = ranges[switch] if use_kernels else never
        # `SHOAL_HEAD_KERNEL=auto|0|1`: the output heads on `kernels/output_head.py` up to
        # `HEAD_KERNEL_MAX_ROWS` rows, never, always.
        switch = env_switch("SHOAL_HEAD_KERNEL", ("auto", "0", "1"))
        limits = {"auto": HEAD_KERNEL_MAX_ROWS, "0": 0, "1": 2 * max_batch}
        self.head_kernel_max_rows = limits[switch] if use_kernels else 0
        # The head kernel reads a rounded fast head's e4m3 codes (`quant/fp8_head.py`) rather than
        # its bf16 weight, which holds the same values: half the bytes.
        self.fp8_fast_head = True
        # Pinned host ring [R, max_batch, N+1] the step's last kernel writes the frames into while
        # it advances the step's metadata for the next step (`kernels.window.StepAdvance`); set by
        # `ModelRunner.advance_on_device`, None: the metadata comes from the host every step.
        self.advance_ring: Tensor | None = None
        if use_kernels:
            from shoal.engine.fp8_weights import Fp8Projections, has_fp8_layers

            if has_fp8_layers(model):
                self.fp8 = Fp8Projections(model, backend="triton")
        # The projections `prefill` runs: the step's own, or (the runner's choice, when prefill
        # graphs replay on a stream of their own beside the decode) `self.fp8.sibling()`, so that
        # the two never share a GEMM's output buffer or split-K workspace.
        self.prefill_fp8 = self.fp8

    # Constants of the fast transformer's paged per-frame cache (kernel path) -----------------

    def _init_fast_pages(self, max_batch: int) -> None:
        mc, device = self.config, self.device
        if mc.num_codebooks > FAST_PAGE:
            raise ValueError(f"at most {FAST_PAGE} codebooks supported by the fused fast loop")
        shape = (max_batch, FAST_PAGE, mc.fast_n_local_heads, mc.fast_head_dim)
        self.fast_k = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(mc.n_fast_layer)]
        self.fast_v = [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(mc.n_fast_layer)]
        rows = torch.arange(max_batch, device=device)
        self.fast_tables = rows.to(torch.int32)[:, None].contiguous()
        # Pass 0: two tokens per row (positions 0 and 1), flattened row-major.
        self.pass0_positions = torch.tensor([0, 1], device=device).repeat(max_batch)
        self.pass0_slots = (rows[:, None] * FAST_PAGE + torch.arange(2, device=device)).flatten()
        self.pass0_lens = torch.full((max_batch,), 2, dtype=torch.int32, device=device)
        self.pass0_starts = torch.arange(0, 2 * max_batch + 1, 2, dtype=torch.int32, device=device)
        # Pass k >= 2: one token per row at position k.
        self.pass_positions = {
            k: torch.full((max_batch,), k, device=device) for k in range(2, mc.num_codebooks)
        }
        self.pass_slots = {k: rows * FAST_PAGE + k for k in range(2, mc.num_codebooks)}
        self.pass_lens = {
            k: torch.full((max_batch,), k + 1, dtype=torch.int32, device=device)
            for k in range(2, mc.num_codebooks)
        }

    # The step -------------------------------------------------------------------------------

    def __call__(self, buffers, capped: bool = True) -> None:
        """Frames for every row of `buffers` into `buffers.frames`; the window is shifted and
        `buffers.tokens` set to the frames (the next step's input). `capped`: the sampling
        kernels extract only `max_top_k` candidates (every row's top_k must be <= it)."""
        residual, normed = self.slow(buffers)
        self.frames_from_hidden(residual, normed, buffers, capped)
        if self.use_kernels:  # the next step's tokens written by the same launch
            from shoal.kernels.window import StepAdvance, window_shift

            advance = None
            if self.advance_ring is not None:  # and its metadata; the frames into the host ring
                advance = StepAdvance(
                    buffers.positions, buffers.kv_lens, buffers.slots, buffers.block_tables,
                    self.kv.page_size, self.advance_ring,
                )  # fmt: skip
            window_shift(
                buffers.window, buffers.frames, buffers.frame_index, tokens=buffers.tokens, advance=advance
            )
        else:
            keep = (buffers.frame_index >= 1)[:, None, None]
            shifted = torch.cat([buffers.window[:, 1:], buffers.frames[:, None, :]], dim=1)
            buffers.window.copy_(torch.where(keep, shifted, buffers.window))
            buffers.tokens.copy_(buffers.frames)

    def frames_from_hidden(self, residual: Tensor, normed: Tensor, buffers, capped: bool = True) -> None:
        """Head, main-token sampling and the fast loop for slow hidden states (`residual`
        before, `normed` after the final norm) of `buffers`' rows; writes `buffers.frames`."""
        mc, frames = self.config, buffers.frames
        logits = self._head(normed, self.head_weight, self.head_rows)
        self.sample_main(logits, buffers, capped)
        fast_input = normed if mc.norm_fastlayer_input else residual
        if self.use_kernels and isinstance(self.model.fast_project_in, torch.nn.Identity):
            from shoal.kernels.step_inputs import fast_pass0_input

            x = fast_pass0_input(
                frames, fast_input, self.model.fast_embeddings.weight, mc.semantic_begin_id, mc.codebook_size
            )  # code 0 into frames[:, 1], rows (hidden, code 0's embedding) per frame: one launch
            fast_logits = self._fast_kernels(x, 0)
        elif self.use_kernels:
            x = self._pass0_input(fast_input, frames)
            fast_logits = self._fast_kernels(x.reshape(-1, x.shape[-1]), 0)
        else:
            x = self._pass0_input(fast_input, frames)
            cache = self.model.new_fast_cache(x.shape[0])
            fast_logits = self.model.forward_fast(x, 0, cache)[:, 1]
        for k in range(1, mc.num_codebooks):
            if k >= 2:
                if self.use_kernels:  # the pass's first norm gathers the drawn codes' embeddings
                    from shoal.kernels.gather_rows import GatheredRows

                    table = self.model.fast_embeddings.weight
                    rows = table.new_empty(frames.shape[0], table.shape[1])
                    fast_logits = self._fast_kernels(GatheredRows(frames[:, k], table, rows), k)
                else:
                    x = self.model.fast_embed(frames[:, k].long())
                    fast_logits = self.model.forward_fast(x[:, None], k, cache)[:, 0]
            self.sample_codebook(fast_logits, k, buffers, capped)

    def _pass0_input(self, fast_input: Tensor, frames: Tensor) -> Tensor:
        """Fast pass 0's input [B, 2, fast_dim] in torch ops; code 0 into `frames[:, 1]`."""
        mc = self.config
        code0 = torch.clamp(frames[:, 0].long() - mc.semantic_begin_id, 0, mc.codebook_size - 1)
        frames[:, 1].copy_(code0)
        return torch.stack([self.model.fast_project_in(fast_input), self.model.fast_embed(code0)], dim=1)

    # Slow transformer -------------------------------------------------------------------------

    def slow(self, buffers) -> tuple[Tensor, Tensor]:
        """(last layer's output, final-normed hidden) [B, dim] of the rows' next token."""
        model = self.model
        self.kv.set_decode(buffers.slots, buffers.block_tables, buffers.kv_lens)
        if not self.use_kernels:
            hidden = model.forward_slow(buffers.tokens.long(), buffers.positions, self.kv)
            return hidden, model.norm(hidden)
        from shoal.kernels.attention import paged_decode_attention
        from shoal.kernels.step_inputs import embed_tokens

        mc = self.config
        residual = embed_tokens(
            buffers.tokens, model.embeddings.weight, model.codebook_embeddings.weight, mc.codebook_size,
            mc.semantic_begin_id, mc.semantic_end_id, mc.scale_codebook_embeddings,
        )  # fmt: skip
        return self._layers(
            model.layers, residual, model.norm.weight, buffers.positions, model.rope,
            self.kv.layer, buffers.slots,
            lambda q, pools, out_fp8: paged_decode_attention(
                q, pools.k, pools.v, buffers.block_tables, buffers.kv_lens, out_fp8=out_fp8, **pools.scales
            ),
        )  # fmt: skip

    def prefill(self, tokens: Tensor, positions: Tensor, slots: Tensor, meta: tuple) -> tuple[Tensor, Tensor]:
        """Varlen prefill through the fused kernels (far fewer launches than the modules):
        tokens Long[T, N+1], positions/slots Long[T], meta = (block_tables, seq_lens,
        query_start_loc, max_query_len) of `kernels.attention.paged_prefill_attention`.
        Returns (last layer's output, final-normed hidden), [T, dim].

        With FP8 projections the batch runs padded to a multiple of 16 rows (token 0 at position
        0, slot -1: no KV write, no query of any sequence), so that block-scaled `_scaled_mm`
        writes its product in place and takes inputs quantized by the norms and the attention
        (`Fp8Projections.fp8_input`); every kernel treats rows independently, so the pad rows
        touch nothing but themselves, and they are dropped from the result."""
        from shoal.engine.fp8_weights import SCALED_MM_ROWS
        from shoal.kernels.attention import paged_prefill_attention

        model = self.model
        tables, seq_lens, starts, max_query = meta
        count = tokens.shape[0]
        pad = -count % SCALED_MM_ROWS if self.prefill_fp8 is not None else 0
        if pad:
            tokens = torch.cat([tokens, tokens.new_zeros(pad, tokens.shape[1])])
            positions = torch.cat([positions, positions.new_zeros(pad)])
            slots = torch.cat([slots, slots.new_full((pad,), -1)])
        hidden, normed = self._layers(
            model.layers, model.embed(tokens), model.norm.weight, positions, model.rope,
            self.kv.layer, slots,
            lambda q, pools, out_fp8: paged_prefill_attention(
                q, pools.k, pools.v, tables, seq_lens, starts, max_query, out_fp8=out_fp8, **pools.scales
            ),
            fp8=self.prefill_fp8,
        )  # fmt: skip
        return hidden[:count], normed[:count]

    def _layers(
        self, layers, residual, final_weight, positions, rope, pages, slots, attend, rope_attend=None,
        fp8=None, fast_qkv_partials=False,
    ):  # fmt: skip
        """Pre-norm blocks with the fused kernels; returns (residual, final-normed hidden). `residual`
        may be `GatheredRows`, which the first norm gathers into its `out` (the residual stream). With
        `norm_slice_groups` and a decode-sized batch the norms split rows over programs and write
        the residual stream into the other of two buffers (ping-pong), else in place. With FP8
        weights, a norm or attention whose output feeds a W8A8 projection writes it quantized
        (`Fp8Projections.fp8_input`), so no separate quantization launch runs. `pages(i)` gives
        layer i's `LayerKV`; `attend(q, pages, out_fp8)` returns [T, Hq, D], or the `out_fp8` pair
        it filled. `rope_attend(i, qkv, out_fp8)`, when given, replaces QK-norm/RoPE/KV write and
        `attend` by one call (the fast transformer's `kernels/fast_attention.py`), which is handed
        the qkv GEMM's split-K partials with `fast_qkv_partials`. `fp8`: the FP8 projections to
        run (default `self.fp8`)."""
        from shoal.engine.fp8_weights import SMALL_PREFILL_M
        from shoal.kernels.gather_rows import GatheredRows
        from shoal.kernels.norm_rope import NORM_MAX_REGISTERS, qk_norm_rope_kv_write, rms_norm
        from shoal.kernels.quant import GROUP

        first_input = residual
        if isinstance(residual, GatheredRows):
            residual = residual.out  # written by the first norm
        eps = self.config.norm_eps
        tokens = residual.shape[0]
        fp8 = self.fp8 if fp8 is None else fp8
        fuse_quantization = fp8 is not None and self.dtype == torch.bfloat16  # kernels quantize bf16
        split_rows = self.splits_norm_rows(tokens)

        def fp8_target(block, which: str):
            """Prefill-sized batches (block-scaled `_scaled_mm` from `SMALL_PREFILL_M` rows on)
            take their inputs quantized by the norms too; decode-sized ones when their rows split."""
            wanted = self.fuse_attention_quant if which == "out" else split_rows or tokens > SMALL_PREFILL_M
            return fp8.fp8_input(block, which, tokens) if fuse_quantization and wanted else None

        slice_groups = self.norm_slice_groups_for(tokens)
        spare = torch.empty_like(residual) if slice_groups else None
        registers = NORM_MAX_REGISTERS if self.norm_max_registers is None else self.norm_max_registers or None

        def add_and_norm(x, weight, out_fp8):
            """residual += x, then the norm; with a split row the sum goes to `spare` (swapped)."""
            nonlocal residual, spare
            if not slice_groups:
                normed, _ = rms_norm(
                    x, weight, eps, residual=residual, out_fp8=out_fp8, max_registers=registers
                )
                return normed
            normed, summed = rms_norm(
                x, weight, eps, residual=residual, out_fp8=out_fp8, residual_out=spare,
                slice_groups=slice_groups, max_registers=registers,
            )  # fmt: skip
            residual, spare = summed, residual
            return normed

        normed, _ = rms_norm(
            first_input, layers[0].attention_norm.weight, eps, out_fp8=fp8_target(layers[0], "qkv"),
            slice_groups=slice_groups or None, max_registers=registers,
        )  # fmt: skip
        for i, layer in enumerate(layers):
            attn = layer.attention
            if fp8 is None:
                qkv = F.linear(normed, attn.wqkv.weight, attn.wqkv.bias)
            else:  # partials (when unreduced) go to the QK-norm/RoPE kernel or fast attention after
                summed = self.rope_reduces_partials if rope_attend is None else fast_qkv_partials
                qkv = fp8.qkv(layer, normed, unreduced=summed)
            head_dim = qkv.shape[1] // (attn.n_head + 2 * attn.n_local_heads)
            target = fp8_target(layer, "out") if head_dim == GROUP else None  # a head per group
            if rope_attend is not None:
                attended = rope_attend(i, qkv, target)
            else:
                pools = pages(i)
                q = qk_norm_rope_kv_write(
                    qkv, positions, rope, pools.k, pools.v, slots, attn.n_head, attn.n_local_heads,
                    attn.q_norm.weight if attn.qk_norm else None,
                    attn.k_norm.weight if attn.qk_norm else None, attn.q_norm.eps if attn.qk_norm else 1e-6,
                    **pools.scales,
                )  # fmt: skip
                attended = attend(q, pools, target)  # `target` filled, or [T, Hq, D]
            if target is None:
                attended = attended.reshape(tokens, -1)
            if fp8 is None:
                out = F.linear(attended, attn.wo.weight, attn.wo.bias)
            else:  # split-K partials, when unreduced, are summed by the norm right after
                out = fp8.out_proj(layer, attended, unreduced=self.norm_reduces_partials)
            normed = add_and_norm(out, layer.ffn_norm.weight, fp8_target(layer, "gate_up"))
            ff = layer.feed_forward
            if fp8 is None:
                out = F.linear(
                    F.silu(F.linear(normed, ff.w1.weight)) * F.linear(normed, ff.w3.weight), ff.w2.weight
                )
            else:
                out = fp8.mlp(layer, normed, unreduced=self.norm_reduces_partials)
            last = i + 1 == len(layers)
            following = final_weight if last else layers[i + 1].attention_norm.weight
            target = None if last else fp8_target(layers[i + 1], "qkv")
            normed = add_and_norm(out, following, target)
        return residual, normed

    def splits_norm_rows(self, rows: int) -> bool:
        """Whether a batch of `rows` rows is small enough for split norm rows and the norm's fused
        quantization (NORM_SPLIT_MAX_ROWS)."""
        return 0 < rows <= self.norm_split_max_rows

    def norm_slice_groups_for(self, rows: int) -> int:
        """128-column groups per norm program for a batch of `rows` rows; 0: one program per row
        (batches above NORM_SPLIT_MAX_ROWS, or `SHOAL_NORM_SLICE_GROUPS=0`)."""
        if not self.splits_norm_rows(rows):
            return 0
        if self.norm_slice_groups is not None:
            return self.norm_slice_groups
        return NORM_SLICE_GROUPS_WIDE if rows >= NORM_SLICE_WIDE_FROM_ROWS else NORM_SLICE_GROUPS

    @contextlib.contextmanager
    def holding_metadata(self) -> Iterator[None]:
        """Steps (and graphs captured) inside leave the metadata as they found it: benchmarks that
        replay one step on fixed inputs, which `advance_ring` would otherwise walk forward."""
        ring, self.advance_ring = self.advance_ring, None
        try:
            yield
        finally:
            self.advance_ring = ring

    # Fast transformer (kernel path) -------------------------------------------------------------

    def fuses_fast_attention(self, batch: int) -> bool:
        """Whether fast passes of this batch run `kernels/fast_attention.py` (one launch per layer)."""
        return not self.two_launch_fast_from <= batch <= self.two_launch_fast_to

    def _fast_kernels(self, x: Tensor | GatheredRows, k: int) -> Tensor:
        """Fast pass `k` (0: the 2-token pass over positions 0 and 1) -> logits predicting code k
        (k = 1 for pass 0), [B, codebook_size]. `x`: the pass's input rows, or for k >= 2 the
        `GatheredRows` its first norm gathers."""
        from shoal.kernels.attention import paged_decode_attention, paged_prefill_attention
        from shoal.kernels.gather_rows import GatheredRows

        model = self.model
        if k == 0:
            batch = x.shape[0] // 2
            positions, slots = self.pass0_positions[: 2 * batch], self.pass0_slots[: 2 * batch]
            tables, lens, starts = (
                self.fast_tables[:batch],
                self.pass0_lens[:batch],
                self.pass0_starts[: batch + 1],
            )

            def attend(q, pools, out_fp8):
                return paged_prefill_attention(q, pools.k, pools.v, tables, lens, starts, 2, out_fp8=out_fp8)
        else:
            batch = x.ids.shape[0] if isinstance(x, GatheredRows) else x.shape[0]
            positions, slots = self.pass_positions[k][:batch], self.pass_slots[k][:batch]
            tables, lens = self.fast_tables[:batch], self.pass_lens[k][:batch]

            def attend(q, pools, out_fp8):
                return paged_decode_attention(q, pools.k, pools.v, tables, lens, out_fp8=out_fp8)

        rope_attend = None
        if self.fuses_fast_attention(batch):
            from shoal.kernels.fast_attention import fast_rope_attention

            tokens_per_row = 2 if k == 0 else 1

            def rope_attend(i, qkv, out_fp8):
                attn = model.fast_layers[i].attention
                return fast_rope_attention(
                    qkv, positions, model.fast_rope, self.fast_k[i], self.fast_v[i], tokens_per_row,
                    attn.n_head, attn.n_local_heads, attn.q_norm.weight if attn.qk_norm else None,
                    attn.k_norm.weight if attn.qk_norm else None, attn.q_norm.eps if attn.qk_norm else 1e-6,
                    out_fp8=out_fp8,
                )  # fmt: skip

        residual = x if isinstance(x, GatheredRows) else x.contiguous()
        residual, normed = self._layers(
            model.fast_layers, residual, model.fast_norm.weight, positions, model.fast_rope,
            lambda i: LayerKV(self.fast_k[i][:batch], self.fast_v[i][:batch]), slots, attend, rope_attend,
            fast_qkv_partials=self.hands_fast_qkv_partials(batch),
        )  # fmt: skip
        if k == 0:
            normed = normed[1::2]
        return self._fast_head(normed)

    def _fast_head(self, normed: Tensor) -> Tensor:
        """The codebook logits; a rounded head (`quant/fp8_head.py`) is read as its e4m3 codes on
        the head kernel (with `fp8_fast_head`), else as its weight."""
        head = self.model.fast_output
        rounded = self.fp8_fast_head and hasattr(head, "weight_fp8")
        return self._head(normed, head.weight, fp8=(head.weight_fp8, head.weight_scale) if rounded else None)

    def hands_fast_qkv_partials(self, batch: int) -> bool:
        """Whether the fast qkv GEMM of this batch leaves its partials to the fused fast attention:
        up to `fast_attention_partials_max_batch`, and only for fast layers without QK-norm (all
        three model families'), whose launch sums them on 8 warps; with QK-norm it runs on one
        warp, where the sums were never measured."""
        return batch <= self.fast_attention_partials_max_batch and not self.config.fast_attention_qk_norm

    def _head(
        self, normed: Tensor, weight: Tensor, rows: int | None = None, fp8: tuple[Tensor, ...] | None = None
    ) -> Tensor:
        """Logits of an output head (the first `rows` rows of `weight`), on the head kernel for
        batches up to `head_kernel_max_rows` (reading `fp8`'s codes and scales instead of `weight`
        where given: `quant/fp8_head.py`, the same weights), else cuBLAS."""
        if normed.shape[0] <= self.head_kernel_max_rows:
            from shoal.kernels.output_head import output_head

            if fp8 is not None:
                return output_head(normed, fp8[0], rows, scales=fp8[1])
            return output_head(normed, weight, rows)
        logits = F.linear(normed, weight)
        return logits if rows is None else logits[:, :rows]

    # Sampling ---------------------------------------------------------------------------------

    def sample_main(self, logits: Tensor, buffers, capped: bool) -> None:
        """Main token ids (vocabulary ids) into `buffers.frames[:, 0]`."""
        rules, mc = self.rules, self.config
        if self.kernel_main:
            from shoal.kernels.sample import sample_tokens

            sample_tokens(
                logits, buffers.temperature, buffers.top_p, buffers.top_k, buffers.seed,
                buffers.frame_index, MAIN_SLOT, token_ids=self.column_ids32,
                window=buffers.window if rules.use_ras else None,
                semantic_range=(mc.semantic_begin_id, mc.semantic_end_id) if rules.use_ras else None,
                max_top_k=self.max_top_k if capped else None, out=buffers.frames[:, 0],
                chunks=self.sample_chunks if capped else None,
            )  # fmt: skip
            return
        logits = logits.float()
        window, frame_index = buffers.window, buffers.frame_index
        if rules.main_penalty != "none":
            previous = (
                oldest_window_frame(window, frame_index)
                if rules.main_penalty == "oldest_frame"
                else window[:, :, 0]
            )
            logits = apply_repetition_penalty(logits, previous, self._active_penalty(buffers))
        probs = sampling_probs(logits, buffers.temperature, buffers.top_p, buffers.top_k, self.main_ranks)
        uniforms = counter_uniform_columns(buffers.seed, frame_index, MAIN_SLOT, self.column_ids)
        token = self.column_ids[exponential_race(probs, uniforms)]
        if rules.use_ras:
            batch = logits.shape[0]
            high_probs = sampling_probs(
                logits, self.ras_temperature[:batch], self.ras_top_p[:batch], buffers.top_k, self.main_ranks
            )
            uniforms = counter_uniform_columns(buffers.seed, frame_index, RAS_SLOT, self.column_ids)
            high = self.column_ids[exponential_race(high_probs, uniforms)]
            repeated = (window[:, :, 0].long() == token[:, None]).any(dim=1)
            semantic = (token >= mc.semantic_begin_id) & (token <= mc.semantic_end_id)
            token = torch.where(repeated & semantic & (frame_index >= 1), high, token)
        buffers.frames[:, 0].copy_(token)

    def sample_codebook(self, logits: Tensor, k: int, buffers, capped: bool) -> None:
        """Codebook k >= 1 into `buffers.frames[:, k + 1]`."""
        logits = logits[:, : self.codebook_columns]
        if self.kernel_codebooks:
            from shoal.kernels.sample import sample_tokens

            sample_tokens(
                logits, buffers.temperature, buffers.top_p, buffers.top_k, buffers.seed,
                buffers.frame_index, codebook_slot(k), max_top_k=self.max_top_k if capped else None,
                out=buffers.frames[:, k + 1], chunks=self.sample_chunks if capped else None,
            )  # fmt: skip
            return
        logits = logits.float()
        if self.rules.penalize_codebooks:
            previous = buffers.window[:, :, k + 1]
            logits = apply_repetition_penalty(logits, previous, self._active_penalty(buffers))
        probs = sampling_probs(logits, buffers.temperature, buffers.top_p, buffers.top_k, self.codebook_ranks)
        uniforms = counter_uniform_columns(
            buffers.seed, buffers.frame_index, codebook_slot(k), self.codebook_ranks
        )
        buffers.frames[:, k + 1].copy_(exponential_race(probs, uniforms))

    def _active_penalty(self, buffers) -> Tensor:
        penalty = buffers.repetition_penalty
        return torch.where(buffers.frame_index >= 1, penalty, torch.ones_like(penalty))
