"""The decode step the engine replays as a CUDA graph: slow model, restricted head, sampling,
fast loop over the codebooks and window update, for every row of static buffers at once.

Graph-safe by construction: every constant tensor (the S2 head slice and its vocabulary ids,
fast-transformer positions, slots, lengths and block tables, RAS parameters) is built once in
`__init__`; the step only reads and writes its buffers in place; there is no `.item()`, no
host copy and no Python branch on a tensor value. The fast loop is unrolled over the
codebooks, positions 0 and 1 (slow hidden state and code 0) share one 2-token pass.

The transformers run the model's one forward (`models.layers.run_blocks`) with the fused ops
of `engine/fused_blocks.py` (CUDA, or the Triton interpreter in tests), or with the modules'
torch reference ops (CPU). Sampling runs `kernels/sample.py` where the family allows (S2's main
token, every family's codebooks without a penalty), else `models/sampling.py`'s rules, which
are graph-safe. What runs where is `shoal.tuning.Tuning` (`self.tuning`).

S2's main token can only be a semantic id or `<|im_end|>`, so only those 4,097 rows of the
output head are computed (a gathered weight slice, ids in ascending order so ties break as
in the full row).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from shoal.engine.fused_blocks import FusedBlockOps
from shoal.engine.kv_cache import LayerKV
from shoal.kernels.gather_rows import GatheredRows
from shoal.models.layers import ReferenceOps
from shoal.models.sampling import (
    MAIN_SLOT,
    SamplingBatch,
    codebook_slot,
    rules_for,
    sample_codebook_values,
    sample_main_tokens,
)
from shoal.tuning import TUNING, Tuning

FAST_PAGE = 16  # one page per row holds a frame's fast positions (num_codebooks <= 16)


class DecodeStep:
    """One frame per row of a `DecodeBuffers` (runner.py), in place."""

    def __init__(
        self, model, kv, max_batch: int, use_kernels: bool, max_top_k: int | None = 32,
        tuning: Tuning = TUNING,
    ) -> None:  # fmt: skip
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
        # cuBLAS picks a slow fallback kernel for S2's 4,097-row slice: on CUDA that slice (a copy
        # already) gets zero rows up to a multiple of 64 and the step reads only the first
        # `head_rows` logits.
        self.head_rows = self.head_weight.shape[0]
        padded_rows = -(-self.head_rows // 64) * 64
        if self.rules.constrain_to_semantic and device.type == "cuda" and padded_rows != self.head_rows:
            padding = self.head_weight.new_zeros(padded_rows - self.head_rows, self.head_weight.shape[1])
            self.head_weight = torch.cat([self.head_weight, padding])
        self.column_ids32 = self.column_ids.to(torch.int32)
        limit = self.rules.codebook_logit_limit or mc.codebook_size
        self.codebook_columns = min(limit, mc.codebook_size)
        self.ras = self.rules.ras_parameters(max_batch, device)
        self.kernel_main = (
            use_kernels and self.rules.constrain_to_semantic and self.rules.main_penalty == "none"
        )
        self.kernel_codebooks = use_kernels and not self.rules.penalize_codebooks
        if (self.kernel_main or self.kernel_codebooks) and device.type == "cuda":
            from shoal.kernels.sample import chunk_counters

            chunk_counters(device)  # the chunked kernel's counters, never allocated inside a capture
        if use_kernels:
            self._init_fast_pages(max_batch)
        # Pinned host ring [R, max_batch, N+1] the step's last kernel writes the frames into while
        # it advances the step's metadata for the next step (`kernels.window.StepAdvance`); set by
        # `ModelRunner.advance_on_device`, None: the metadata comes from the host every step.
        self.advance_ring: Tensor | None = None
        # FP8 projections (`engine/fp8_weights.py`) on the kernel path when the model holds
        # Fp8Linear layers; the torch-ops path runs the layers' own forward instead.
        self.fp8 = None
        if use_kernels:
            from shoal.engine.fp8_weights import Fp8Projections, has_fp8_layers

            if has_fp8_layers(model):
                self.fp8 = Fp8Projections(model, backend="triton", tuning=tuning)
        # The projections `prefill` runs: the step's own, or (the runner's choice, when prefill
        # graphs replay on a stream of their own beside the decode) `self.fp8.sibling()`, so that
        # the two never share a GEMM's output buffer or split-K workspace.
        self.prefill_fp8 = self.fp8
        self.tuning = tuning

    @property
    def tuning(self) -> Tuning:
        """What the step runs; read at every call, so a new value takes effect at the next capture."""
        return self._tuning

    @tuning.setter
    def tuning(self, tuning: Tuning) -> None:
        self._tuning = tuning
        for projections in (self.fp8, self.prefill_fp8):
            if projections is not None:
                projections.tuning = tuning

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

    def fused_ops(
        self, positions: Tensor, rope: Tensor, pages, slots: Tensor, attend, **fast
    ) -> FusedBlockOps:
        """The fused `BlockOps` for one forward of this step's transformers (`fast`: the fast
        passes' `rope_attend` and `fast_qkv_partials`; `fp8`: other projections than the step's)."""
        fp8 = fast.pop("fp8", self.fp8)
        return FusedBlockOps(self.tuning, fp8, self.dtype, positions, rope, pages, slots, attend, **fast)

    def attention_config(self, batch: int, kv_fp8: bool = False):
        """The decode attention's config at this batch: the kernel's table with `Tuning`'s entries."""
        from shoal.kernels.attention import decode_config

        tuning = self.tuning
        return decode_config(
            batch, kv_fp8, tuning.attention_configs_fp8_kv if kv_fp8 else tuning.attention_configs
        )

    def slow(self, buffers) -> tuple[Tensor, Tensor]:
        """(last layer's output, final-normed hidden) [B, dim] of the rows' next token."""
        model = self.model
        self.kv.set_decode(buffers.slots, buffers.block_tables, buffers.kv_lens)
        if not self.use_kernels:
            ops = ReferenceOps(model.rope[buffers.positions], self.kv)
            return model.run_slow(model.embed(buffers.tokens.long()), ops)
        from shoal.kernels.attention import paged_decode_attention
        from shoal.kernels.step_inputs import embed_tokens

        mc = self.config
        residual = embed_tokens(
            buffers.tokens, model.embeddings.weight, model.codebook_embeddings.weight, mc.codebook_size,
            mc.semantic_begin_id, mc.semantic_end_id, mc.scale_codebook_embeddings,
        )  # fmt: skip

        def attend(q, pools, out_fp8):
            tables, lens = buffers.block_tables, buffers.kv_lens
            config = self.attention_config(q.shape[0], kv_fp8=pools.fp8)
            return paged_decode_attention(
                q, pools.k, pools.v, tables, lens, out_fp8=out_fp8, config=config, **pools.scales
            )

        return model.run_slow(
            residual, self.fused_ops(buffers.positions, model.rope, self.kv.layer, buffers.slots, attend)
        )

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

        def attend(q, pools, out_fp8):
            return paged_prefill_attention(
                q, pools.k, pools.v, tables, seq_lens, starts, max_query, out_fp8=out_fp8, **pools.scales
            )

        ops = self.fused_ops(positions, model.rope, self.kv.layer, slots, attend, fp8=self.prefill_fp8)
        hidden, normed = model.run_slow(model.embed(tokens), ops)
        return hidden[:count], normed[:count]

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
                self.fast_tables[:batch], self.pass0_lens[:batch], self.pass0_starts[: batch + 1],
            )  # fmt: skip

            def attend(q, pools, out_fp8):
                return paged_prefill_attention(q, pools.k, pools.v, tables, lens, starts, 2, out_fp8=out_fp8)
        else:
            batch = x.ids.shape[0] if isinstance(x, GatheredRows) else x.shape[0]
            positions, slots = self.pass_positions[k][:batch], self.pass_slots[k][:batch]
            tables, lens = self.fast_tables[:batch], self.pass_lens[k][:batch]

            def attend(q, pools, out_fp8):
                config = self.attention_config(q.shape[0])
                return paged_decode_attention(
                    q, pools.k, pools.v, tables, lens, out_fp8=out_fp8, config=config
                )

        rope_attend = None
        tuning = self.tuning
        if tuning.fuses_fast_attention(batch):
            from shoal.kernels.fast_attention import fast_rope_attention

            tokens_per_row = 2 if k == 0 else 1

            def rope_attend(i, qkv, out_fp8):
                attn = model.fast_layers[i].attention
                return fast_rope_attention(
                    qkv, positions, model.fast_rope, self.fast_k[i], self.fast_v[i], tokens_per_row,
                    attn.n_head, attn.n_local_heads, attn.q_norm.weight if attn.qk_norm else None,
                    attn.k_norm.weight if attn.qk_norm else None, attn.q_norm.eps if attn.qk_norm else 1e-6,
                    out_fp8=out_fp8, packed_pairs=tuning.packed_pairs, words_min_rows=tuning.words_min_rows,
                )  # fmt: skip

        residual = x if isinstance(x, GatheredRows) else x.contiguous()
        ops = self.fused_ops(
            positions, model.fast_rope, lambda i: LayerKV(self.fast_k[i][:batch], self.fast_v[i][:batch]),
            slots, attend, rope_attend=rope_attend, fast_qkv_partials=self.hands_fast_qkv_partials(batch),
        )  # fmt: skip
        _, normed = model.run_fast(residual, ops)
        if k == 0:
            normed = normed[1::2]
        return self._fast_head(normed)

    def _fast_head(self, normed: Tensor) -> Tensor:
        """The codebook logits; a rounded head (`quant/fp8_head.py`) is read as its e4m3 codes on
        the head kernel (with `Tuning.head_kernel_reads_fp8`), else as its weight."""
        head = self.model.fast_output
        rounded = self.tuning.head_kernel_reads_fp8 and hasattr(head, "weight_fp8")
        return self._head(normed, head.weight, fp8=(head.weight_fp8, head.weight_scale) if rounded else None)

    def hands_fast_qkv_partials(self, batch: int) -> bool:
        """Whether the fast qkv GEMM of this batch leaves its partials to the fused fast attention:
        up to `Tuning.fast_attention_partials_max_batch`, and only for fast layers without QK-norm (all
        three model families'), whose launch sums them on 8 warps; with QK-norm it runs on one
        warp, where the sums were never measured."""
        return (
            batch <= self.tuning.fast_attention_partials_max_batch and not self.config.fast_attention_qk_norm
        )

    def _head(
        self, normed: Tensor, weight: Tensor, rows: int | None = None, fp8: tuple[Tensor, ...] | None = None
    ) -> Tensor:
        """Logits of an output head (the first `rows` rows of `weight`), on the head kernel for
        batches up to `Tuning.head_kernel_max_rows` on the kernel path (reading `fp8`'s codes and
        scales instead of `weight` where given: `quant/fp8_head.py`, the same weights), else cuBLAS."""
        tuning = self.tuning
        if self.use_kernels and normed.shape[0] <= tuning.head_kernel_max_rows:
            from shoal.kernels.output_head import output_head

            if fp8 is not None:
                return output_head(
                    normed, fp8[0], rows, scales=fp8[1],
                    rows_per_program=tuning.fp8_head_rows_per_program, chunk=tuning.fp8_head_chunk,
                )  # fmt: skip
            return output_head(
                normed, weight, rows, rows_per_program=tuning.head_rows_per_program, chunk=tuning.head_chunk
            )
        logits = F.linear(normed, weight)
        return logits if rows is None else logits[:, :rows]

    # Sampling ---------------------------------------------------------------------------------

    def _params(self, buffers) -> SamplingBatch:
        return SamplingBatch(
            buffers.temperature, buffers.top_p, buffers.top_k, buffers.repetition_penalty, buffers.seed
        )

    def sample_main(self, logits: Tensor, buffers, capped: bool) -> None:
        """Main token ids (vocabulary ids) into `buffers.frames[:, 0]`."""
        rules, mc, tuning = self.rules, self.config, self.tuning
        semantic = (mc.semantic_begin_id, mc.semantic_end_id)
        if self.kernel_main:
            from shoal.kernels.sample import sample_tokens

            sample_tokens(
                logits, buffers.temperature, buffers.top_p, buffers.top_k, buffers.seed,
                buffers.frame_index, MAIN_SLOT, token_ids=self.column_ids32,
                window=buffers.window if rules.use_ras else None,
                semantic_range=semantic if rules.use_ras else None,
                max_top_k=self.max_top_k if capped else None, out=buffers.frames[:, 0],
                preferred_chunks=tuning.sample_chunks if capped else None, num_warps=tuning.sample_warps,
            )  # fmt: skip
            return
        batch = logits.shape[0]
        ras = (self.ras[0][:batch], self.ras[1][:batch])
        token = sample_main_tokens(
            rules, logits, self.column_ids, self._params(buffers), buffers.window, buffers.frame_index,
            semantic, ras,
        )  # fmt: skip
        buffers.frames[:, 0].copy_(token)

    def sample_codebook(self, logits: Tensor, k: int, buffers, capped: bool) -> None:
        """Codebook k >= 1 into `buffers.frames[:, k + 1]`."""
        if self.kernel_codebooks:
            from shoal.kernels.sample import sample_tokens

            sample_tokens(
                logits[:, : self.codebook_columns], buffers.temperature, buffers.top_p, buffers.top_k,
                buffers.seed, buffers.frame_index, codebook_slot(k),
                max_top_k=self.max_top_k if capped else None, out=buffers.frames[:, k + 1],
                preferred_chunks=self.tuning.sample_chunks if capped else None,
                num_warps=self.tuning.sample_warps,
            )  # fmt: skip
            return
        values = sample_codebook_values(
            self.rules, logits, k, self._params(buffers), buffers.window, buffers.frame_index
        )
        buffers.frames[:, k + 1].copy_(values)
