"""FP8 weights in the engine: preparing a model, and the projections of the fused decode step.

`prepare_model` makes a loaded model the engine's FP8 model: it quantizes every transformer-block
projection (`fp8_linear.QUANTIZED_MODULES`) unless the model came from an FP8 checkpoint, sets the
activation mode, and checks every layer's layout with its probe. Embeddings, norms, the S2 head
slice and the fast head stay in the model dtype: embeddings are gathers (a step reads B rows, not
the matrix), norms are vectors, and the two heads are a small share of the bytes a frame reads
whose logits decide every sampled token directly, so they keep full precision.

`Fp8Projections` runs those projections for `engine/decode_step.py`'s kernel path. Per call the
kernel variant is chosen from the GEMM shape (N, K) and the row count M (`variant_for`):

- `"w8a8"`: activations quantized per token per 128 columns by one `kernels/quant.py` launch (for
  the down projection fused with SwiGLU: `swiglu_quantize`), or by the kernel that produced them
  (`fp8_input`), then the W8A8 GEMM;
- `"w8a8_inline"`: the GEMM quantizes its activation tiles itself (no extra launch);
- `"w8a16"`: bf16 activations, weights dequantized in registers;
- `"bf16"`: cuBLAS on a resident bf16 copy dequantized from the FP8 weights once at load (more
  memory, kept only for shapes whose table entry uses it);
- `"scaled_mm"`: prefill-sized M: activations quantized by one `kernels/quant.py` launch, then
  `torch._scaled_mm` with block-wise scales (cuBLAS; rows padded to a multiple of 16), no bf16
  copy of the weight needed. `Tuning.fp8_prefill` forces one variant for every prefill GEMM.

`VARIANT_TABLE` holds the tuned choices; `default_variant` decides the rest. M buckets are the
GEMM's (1, 2, ..., 128) plus three for prefill: `SMALL_PREFILL_M` (129-256 rows),
`SHORT_PREFILL_M` (257-1,024: one prompt, or a graph's packed chunks) and `LARGE_M` (eager batched
prefill).

CUDA-graph safety: `reserve(ms)` allocates, before capture, the outputs, activation buffers and one
split-K workspace for every M the graphs use; a call with a reserved M allocates nothing. A call with
another M allocates (eager prefill) and is refused while a graph is being captured.

Gate and up projections run as one GEMM over [w1; w3] when the intermediate size is a multiple of
128: then no 128-row weight block straddles the two, so concatenating weights and scales is exact.
Otherwise the two GEMMs write the two halves of one [M, 2I] buffer. Either way SwiGLU is applied
by the down projection's activation load (`swiglu_quantize` or the GEMM's SWIGLU input).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shoal.kernels import reference
from shoal.kernels.tuned import FP8_VARIANTS, keyed_entries, read_table, update_table
from shoal.quant.fp8_linear import (
    DEFAULT_QUANTIZE_INPUT,
    Fp8Linear,
    fp8_layers,
    quantize_model_,
    verify_model_layout,
)
from shoal.tuning import TUNING, Tuning

if TYPE_CHECKING:  # the kernels import Triton (and read TRITON_INTERPRET) only when first called
    from shoal.kernels.fp8_gemm import SplitKPartials

logger = logging.getLogger(__name__)

VARIANTS = ("w8a8", "w8a8_inline", "w8a16", "bf16", "scaled_mm")
SCALED_MM_ROWS = 16  # block-wise `_scaled_mm` gets M padded to a multiple of this
M_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # the buckets of `kernels/fp8_gemm.py`'s tuned tables
# Prefill: M up to SMALL_PREFILL_M and up to SHORT_PREFILL_M (one request's prompt, what time to
# first frame waits for, or a prefill graph's packed chunks) are buckets of their own, every
# larger M (eager batched prefill) LARGE_M's.
SMALL_PREFILL_M = 256
SHORT_PREFILL_M = 1024
LARGE_M = 1 << 30
PREFILL_BUCKETS = (SMALL_PREFILL_M, SHORT_PREFILL_M, LARGE_M)
DEFAULT_QUANTIZE_ACTIVATIONS = DEFAULT_QUANTIZE_INPUT

# (N, K, M bucket) -> variant, from `kernels/tuned/fp8_variants.json` (`shoal bench engine
# --fp8-sweep` against bf16 cuBLAS); other shapes and buckets follow `default_variant`. S2-Pro's
# projections run the FP8 kernel up to 256 rows and `scaled_mm` above, so the engine holds no bf16
# copy of any S2-Pro weight (their memory goes to KV pages).
VARIANT_TABLE: Mapping[tuple[int, int, int], str] = MappingProxyType(
    {(entry["n"], entry["k"], entry["m"]): entry["variant"] for entry in read_table(FP8_VARIANTS)}
)


def write_variant_table(winners: Mapping[tuple[int, int, int], str], directory: Path | None = None) -> Path:
    """Merge sweep winners {(N, K, M bucket): variant} into `kernels/tuned/fp8_variants.json`."""
    fields = {key: {"variant": variant} for key, variant in winners.items()}
    return update_table(FP8_VARIANTS, lambda table: keyed_entries(table, fields, ("n", "k", "m")), directory)


def m_bucket(m: int) -> int:
    for bucket in (*M_BUCKETS, SMALL_PREFILL_M, SHORT_PREFILL_M):
        if m <= bucket:
            return bucket
    return LARGE_M


def default_variant(bucket: int, quantize_activations: bool = DEFAULT_QUANTIZE_ACTIVATIONS) -> str:
    """Shapes the table does not name: the FP8 kernel at decode sizes, bf16 cuBLAS from M = 64,
    where an untuned FP8 tiling loses to it."""
    if bucket >= 64:
        return "bf16"
    return "w8a8" if quantize_activations else "w8a16"


def variant_for(
    n: int, k: int, m: int, quantize_activations: bool = DEFAULT_QUANTIZE_ACTIVATIONS,
    table: Mapping[tuple[int, int, int], str] | None = None, forced_prefill: str | None = None,
) -> str:  # fmt: skip
    """The GEMM variant at this shape; `forced_prefill` (`Tuning.fp8_prefill`) for prefill buckets."""
    bucket = m_bucket(m)
    if forced_prefill is not None and bucket in PREFILL_BUCKETS:
        return forced_prefill
    chosen = (VARIANT_TABLE if table is None else table).get((n, k, bucket))
    return chosen or default_variant(bucket, quantize_activations)


# ---- preparing the model --------------------------------------------------------------------------


def has_fp8_layers(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear) for m in model.modules())


@torch.no_grad()
def prepare_model(model: nn.Module, quantize_activations: bool = DEFAULT_QUANTIZE_ACTIVATIONS) -> int:
    """Make `model` (in place) the engine's FP8 model: quantize its projections unless they already
    are FP8 (a `shoal quantize` checkpoint), set every layer's activation mode, verify the layouts.
    Returns the number of FP8 layers."""
    if not fp8_layers(model):
        names = quantize_model_(model, quantize_activations)
        if not names:
            raise ValueError("the model has no projection that fp8_linear.QUANTIZED_MODULES matches")
        logger.info("quantized %d projections to FP8 at load", len(names))
    for _, layer in fp8_layers(model):
        layer.quantize_input = quantize_activations
    return verify_model_layout(model)


# ---- the projections of the fused step ------------------------------------------------------------


@dataclass
class Fp8Weight:
    """One GEMM's weight: e4m3 [N, K], fp32 block scales, optional bias, optional resident bf16 copy."""

    q: Tensor
    scale: Tensor
    bias: Tensor | None = None
    dense: Tensor | None = None

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    @classmethod
    def of(cls, layer: Fp8Linear) -> Fp8Weight:
        return cls(layer.weight, layer.weight_scale, layer.bias)


@dataclass
class _Block:
    qkv: Fp8Weight
    wo: Fp8Weight
    gate_up: Fp8Weight | None  # [w1; w3] when exact (intermediate % 128 == 0)
    w1: Fp8Weight
    w3: Fp8Weight
    w2: Fp8Weight


def _concatenate_gate_up(w1: Fp8Linear, w3: Fp8Linear) -> Fp8Weight | None:
    """[w1; w3] with its scales, or None when a weight block would straddle the two. The layers'
    buffers become views of the concatenation, so the weights are held once."""
    if w1.out_features % 128 or w1.bias is not None or w3.bias is not None:
        return None
    q = torch.cat([w1.weight, w3.weight])
    scale = torch.cat([w1.weight_scale, w3.weight_scale])
    rows, blocks = w1.out_features, w1.out_features // 128
    w1.weight, w3.weight = q[:rows], q[rows:]
    w1.weight_scale, w3.weight_scale = scale[:blocks], scale[blocks:]
    return Fp8Weight(q, scale)


class Fp8Projections:
    """qkv / o / SwiGLU MLP of every block of a prepared FP8 model, one variant per (N, K, M).

    `backend="triton"` calls the kernels (CUDA, or the Triton interpreter in tests); `"reference"`
    the torch references of the same ops (`kernels/reference.py`), for testing the plan
    (concatenation, halves, buffers, variants) on the CPU. With `emulate_kernels` the reference
    also rounds activations and outputs to bf16 as the kernels do, so it differs from them only in
    fp32 summation order; without, it computes exactly what the Fp8Linear layers compute (no
    rounding in between), which checks the wiring against the model's own modules."""

    def __init__(
        self, model: nn.Module, backend: str = "triton",
        table: Mapping[tuple[int, int, int], str] | None = None, emulate_kernels: bool = True,
        tuning: Tuning = TUNING,
    ) -> None:  # fmt: skip
        self.tuning = tuning
        if backend not in ("triton", "reference"):
            raise ValueError(f"backend must be 'triton' or 'reference', got {backend!r}")
        self.backend = backend
        self.emulate_kernels = emulate_kernels
        self.table = VARIANT_TABLE if table is None else table
        # The kernels' activation dtype is bf16; the reference keeps the model's dtype.
        self.dense_dtype = torch.bfloat16 if backend == "triton" else model.embeddings.weight.dtype
        layers = fp8_layers(model)
        if not layers:
            raise ValueError("the model has no Fp8Linear layers (prepare_model first)")
        self.quantize_activations = all(layer.quantize_input for _, layer in layers)
        self.blocks: dict[int, _Block] = {}
        for block in [*model.layers, *model.fast_layers]:
            attn, ff = block.attention, block.feed_forward
            modules = (attn.wqkv, attn.wo, ff.w1, ff.w3, ff.w2)
            if not all(isinstance(m, Fp8Linear) for m in modules):
                raise ValueError("every block projection must be an Fp8Linear for the FP8 step")
            gate_up = _concatenate_gate_up(ff.w1, ff.w3)
            self.blocks[id(block)] = _Block(
                Fp8Weight.of(attn.wqkv), Fp8Weight.of(attn.wo), gate_up,
                Fp8Weight.of(ff.w1), Fp8Weight.of(ff.w3), Fp8Weight.of(ff.w2),
            )  # fmt: skip
        self._dense_copies()
        self.reserved: set[int] = set()
        self._buffers: dict[tuple, Tensor] = {}
        self.workspace = None

    def sibling(self) -> Fp8Projections:
        """The same weights (and bf16 copies) with buffers and a split-K workspace of its own,
        not yet reserved: for GEMMs that run on another stream at the same time as these (the
        prefill graphs beside the decode step), which must not share outputs or partials."""
        other = copy.copy(self)
        other.reserved, other._buffers, other.workspace = set(), {}, None
        return other

    def _config(self, w: Fp8Weight, m: int):
        """`Tuning.gemm_configs`' replacement of the tuned GEMM config at this shape, else None."""
        from shoal.kernels.fp8_gemm import m_bucket as gemm_bucket

        return self.tuning.gemm_configs.get((w.n, w.k, gemm_bucket(m)))

    def variant(self, n: int, k: int, m: int) -> str:
        return variant_for(n, k, m, self.quantize_activations, self.table, self.tuning.fp8_prefill)

    def weights(self):
        for block in self.blocks.values():
            yield from (block.qkv, block.wo, block.w2)
            yield from ([block.gate_up] if block.gate_up is not None else [block.w1, block.w3])

    def _dense_copies(self) -> None:
        """bf16 copies (dequantized from FP8) for the shapes some bucket runs on cuBLAS."""
        buckets = (*M_BUCKETS, *PREFILL_BUCKETS)
        for w in self.weights():
            if any(self.variant(w.n, w.k, b) == "bf16" for b in buckets):
                w.dense = reference.dequantize_weight(w.q, w.scale).to(self.dense_dtype)

    # Buffers ----------------------------------------------------------------------------------

    def reserve(self, ms) -> None:
        """Allocate every output, activation buffer and the split-K workspace the calls with these
        row counts need (call before CUDA-graph capture). Never reallocated afterwards."""
        if self.reserved:
            raise RuntimeError("Fp8Projections.reserve may be called once (graphs hold its buffers)")
        ms = sorted(set(ms))
        device = next(iter(self.weights())).q.device
        partials, tiles = 0, 0
        for m in ms:
            for w in self.weights():
                self._plan_buffers(w, m)
            for block in self.blocks.values():
                if block.gate_up is None and ("halves", block.w1.n, m) not in self._buffers:
                    self._buffers[("halves", block.w1.n, m)] = self._halves(m, block.w1.n, device)
            if self.backend == "triton":
                p, t = self._workspace_need(m)
                partials, tiles = max(partials, p), max(tiles, t)
        if self.backend == "triton":
            from shoal.kernels.fp8_gemm import SplitKWorkspace

            self.workspace = SplitKWorkspace(partials, tiles, device)
        self.reserved = set(ms)

    def _workspace_need(self, m: int) -> tuple[int, int]:
        from shoal.kernels.fp8_gemm import SplitKWorkspace, pick_config

        partials, tiles = 0, 0
        for w in self.weights():  # every FP8 variant, so that the table may change after reserve
            for fp8_activations in (True, False):
                config = pick_config(w.n, w.k, m, w.q.device, fp8_activations=fp8_activations)
                p, t = SplitKWorkspace.required(m, w.n, config)
                partials, tiles = max(partials, p), max(tiles, t)
        return partials, tiles

    def _plan_buffers(self, w: Fp8Weight, m: int) -> None:
        device = w.q.device
        self._buffer(("out", w.n, w.k, m), lambda: torch.empty(m, w.n, dtype=torch.bfloat16, device=device))
        self._act_buffers(m, w.k, device)  # small (M x K bytes); lets the table change after reserve

    def _buffer(self, key: tuple, make) -> Tensor:
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = make()
        return buffer

    def _act_buffers(self, m: int, k: int, device) -> tuple[Tensor, Tensor]:
        from shoal.kernels.quant import new_activation_scales

        q = self._buffer(("act", k, m), lambda: torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device))
        scales = self._buffer(("scale", k, m), lambda: new_activation_scales(m, k, device))
        return q, scales

    def _static(self, m: int) -> bool:
        """Whether this M runs on reserved buffers; other M values allocate (never in a capture)."""
        if m in self.reserved:
            return True
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if self.backend == "triton" and capturing:
            raise RuntimeError(f"FP8 projections: M = {m} was not reserved before CUDA-graph capture")
        return False

    def _takes_quantized(self, variant: str, m: int) -> bool:
        """Whether a projection of this variant at this M takes an input quantized by its producer
        (the pairs `fp8_input` hands out)."""
        if self.backend != "triton":
            return False
        if variant == "w8a8":
            return self._static(m)
        return variant == "scaled_mm" and m % SCALED_MM_ROWS == 0

    def _out(self, w: Fp8Weight, m: int, device, static: bool) -> Tensor:
        if static:
            return self._buffers[("out", w.n, w.k, m)]
        return torch.empty(m, w.n, dtype=torch.bfloat16, device=device)

    # Inputs quantized by the kernel that produces them ----------------------------------------------

    def fp8_input(self, block: nn.Module, which: str, m: int) -> tuple[Tensor, Tensor] | None:
        """The (e4m3 [m, K], scales) buffers into which the kernel producing the input of `block`'s
        projection `which` ("qkv", "out" or "gate_up") should write it already quantized, or None
        when that projection does not take a quantized input at this M (then the producer writes
        bf16 as usual): W8A8 from reserved buffers, or block-scaled `_scaled_mm` (prefill) on M a
        multiple of its 16-row groups (reserved buffers, or fresh ones off the graphs). Pass the
        pair itself to the projection afterwards: it runs the GEMM on it directly, one
        quantization launch fewer."""
        if self.backend != "triton":
            return None
        static = self._static(m)
        b = self.blocks[id(block)]
        weights = {"qkv": (b.qkv,), "out": (b.wo,), "gate_up": (b.gate_up,) if b.gate_up else (b.w1, b.w3)}
        chosen = weights[which]
        variants = {self.variant(w.n, w.k, m) for w in chosen}
        k, device = chosen[0].k, chosen[0].q.device
        variant = variants.pop() if len(variants) == 1 else None
        if variant is None or not self._takes_quantized(variant, m):
            return None
        if variant == "scaled_mm" and device.type != "cuda":  # the W8A8 kernel runs it off CUDA
            return None
        if static:
            return self._act_buffers(m, k, device)
        from shoal.kernels.quant import new_activation_scales

        codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=device)
        return codes, new_activation_scales(m, k, device)

    # The projections --------------------------------------------------------------------------

    def qkv(self, block: nn.Module, x: Tensor | tuple[Tensor, Tensor], unreduced: bool = False):
        """The qkv projection; `unreduced`: see `_linear`."""
        return self._linear(self.blocks[id(block)].qkv, x, unreduced=unreduced)

    def out_proj(self, block: nn.Module, x: Tensor | tuple[Tensor, Tensor], unreduced: bool = False):
        """The o projection; `unreduced`: see `_linear`."""
        return self._linear(self.blocks[id(block)].wo, x, unreduced=unreduced)

    def mlp(self, block: nn.Module, x: Tensor | tuple[Tensor, Tensor], unreduced: bool = False):
        """w2(silu(w1 x) * w3 x) with SwiGLU fused into the down projection's activation load;
        `unreduced` applies to the down projection (see `_linear`)."""
        b = self.blocks[id(block)]
        out_dtype = torch.bfloat16 if isinstance(x, tuple) else x.dtype
        m, device = x[0].shape[0] if isinstance(x, tuple) else x.shape[0], b.w2.q.device
        if b.gate_up is not None:
            gate_up = self._linear(b.gate_up, x, keep_bf16=True)
        else:
            inter = b.w1.n
            if self.backend == "reference" and not self.emulate_kernels:
                gate_up = torch.empty(m, 2 * inter, dtype=out_dtype, device=device)  # unrounded
            elif self._static(m):
                gate_up = self._buffers[("halves", inter, m)]
            else:
                gate_up = self._halves(m, inter, device)
            self._linear(b.w1, x, keep_bf16=True, out=gate_up[:, :inter])
            self._linear(b.w3, x, keep_bf16=True, out=gate_up[:, inter:])
        return self._linear(b.w2, gate_up, swiglu=True, out_dtype=out_dtype, unreduced=unreduced)

    @staticmethod
    def _halves(m: int, inter: int, device) -> Tensor:
        return torch.empty(m, 2 * inter, dtype=torch.bfloat16, device=device)

    def _linear(
        self, w: Fp8Weight, x: Tensor | tuple[Tensor, Tensor], *, swiglu: bool = False,
        keep_bf16: bool = False, out: Tensor | None = None, out_dtype: torch.dtype | None = None,
        unreduced: bool = False,
    ) -> Tensor | SplitKPartials:  # fmt: skip
        """x [M, K] (gate | up [M, 2K] with `swiglu`) -> [M, N]: bf16 with `keep_bf16` (an
        intermediate), else the input's dtype (`out_dtype` when given). x may be an already
        quantized (e4m3, scales) pair from `fp8_input` (then the variant is W8A8 or `scaled_mm`).

        `unreduced`: where our split-K kernel runs (bias-free, bf16 result), return its
        `kernels.fp8_gemm.SplitKPartials` for the kernel reading the output (`rms_norm` or
        `qk_norm_rope_kv_write` of `kernels/norm_rope.py`) to sum; it must be the next kernel to
        run. Other variants return the tensor as usual."""
        quantized = x if isinstance(x, tuple) else None  # (e4m3, scales) from `fp8_input`
        lead = x[0] if quantized is not None else x
        m = lead.shape[0]
        out_dtype = out_dtype or (torch.bfloat16 if quantized is not None else x.dtype)
        variant = self.variant(w.n, w.k, m)
        if variant == "scaled_mm" and not lead.is_cuda:  # no block-wise _scaled_mm on the CPU
            variant = "w8a8"  # the same arithmetic (the interpreter's kernels, in tests)
        if quantized is not None and not self._takes_quantized(variant, m):
            raise RuntimeError("pre-quantized input outside a projection that takes one (see fp8_input)")
        if self.backend == "reference":
            if self.emulate_kernels:
                y = self._reference(w, x.to(torch.bfloat16), variant, swiglu).to(torch.bfloat16)
                y = y if keep_bf16 else y.to(out_dtype)
            else:
                y = self._reference(w, x, variant, swiglu).to(x.dtype)
            if out is not None:
                out.copy_(y)
                return out
            return y
        static = self._static(m)
        if out is None and (static or variant != "scaled_mm"):  # eager scaled_mm: its own padded buffer
            out = self._out(w, m, lead.device, static)
        workspace = self.workspace if static else None
        unreduced = unreduced and w.bias is None and (keep_bf16 or out_dtype == torch.bfloat16)
        result = out  # or our kernel's SplitKPartials, when unreduced
        if variant == "w8a8":
            from shoal.kernels.fp8_gemm import fp8_gemm
            from shoal.kernels.quant import quantize_activations, swiglu_quantize

            if quantized is None:  # else (e4m3, scales) written by the producer (`fp8_input`)
                q_out, scales = self._act_buffers(m, w.k, x.device) if static else (None, None)
                quantize = swiglu_quantize if swiglu else quantize_activations
                quantized = quantize(x.to(torch.bfloat16), out=q_out, scales=scales)
            result = fp8_gemm(
                *quantized, w.q, w.scale, out=out, workspace=workspace, config=self._config(w, m),
                unreduced=unreduced,
            )  # fmt: skip
        elif variant == "bf16":
            a = x.to(torch.bfloat16)
            if swiglu:  # as the bf16 model computes it: silu and product in bf16
                a = F.silu(a[:, : w.k]) * a[:, w.k :]
            torch.mm(a, w.dense.t(), out=out)
        elif variant == "scaled_mm":
            out = result = self._scaled_mm(w, x, swiglu, out)  # x may be the quantized pair
        else:
            from shoal.kernels.fp8_gemm import fp8_linear

            a = x.to(torch.bfloat16)
            quantize_inline = variant == "w8a8_inline"
            config = self._config(w, m) if quantize_inline else None  # the FP8-activation table's
            result = fp8_linear(
                a, w.q, w.scale, quantize_inline, swiglu, out=out, workspace=workspace, config=config,
                unreduced=unreduced,
            )  # fmt: skip
        if result is not out:  # partials: no bias and a bf16 result, so nothing is left to apply
            return result
        if w.bias is not None:
            out.add_(w.bias.to(out.dtype))
        if keep_bf16 or out_dtype == torch.bfloat16:
            return out
        return out.to(out_dtype)

    @staticmethod
    def _scaled_mm(
        w: Fp8Weight, x: Tensor | tuple[Tensor, Tensor], swiglu: bool, out: Tensor | None
    ) -> Tensor:
        """Block-scaled cuBLAS FP8 GEMM: the same arithmetic as "w8a8" (activation groups of 1 x
        128, weight blocks of 128 x 128, fp32 sums), another summation order. cuBLAS's block-wise
        kernels want whole 16-row groups: the quantization pads the rows with zeros itself, and
        the product lands in `out` when it has those rows, else (no `out`) in a padded buffer
        whose first M rows are returned as a view (copying padded inputs and outputs would cost
        a noticeable share of an eager prefill chunk)."""
        from shoal.kernels.quant import quantize_activations, swiglu_quantize

        if isinstance(x, tuple):  # quantized by the kernel that produced it (`fp8_input`): M % 16 == 0
            q, scales = x
            m = rows = q.shape[0]
        else:
            m = x.shape[0]
            rows = -(-m // SCALED_MM_ROWS) * SCALED_MM_ROWS
            quantize = swiglu_quantize if swiglu else quantize_activations
            q, scales = quantize(x.to(torch.bfloat16), pad_rows_to=SCALED_MM_ROWS)
        device = q.device
        direct = out is not None and rows == m and out.is_contiguous()
        y = out if direct else torch.empty(rows, w.n, dtype=torch.bfloat16, device=device)
        torch._scaled_mm(q, w.q.t(), scales, w.scale.t(), out_dtype=torch.bfloat16, out=y)
        if direct:
            return out
        if out is None:
            return y[:m]
        out.copy_(y[:m])
        return out

    def _reference(self, w: Fp8Weight, x: Tensor, variant: str, swiglu: bool) -> Tensor:
        """The same variant with `kernels/reference.py`, fp32 arithmetic, unrounded output."""
        if variant == "bf16":
            a = x.to(w.dense.dtype)
            a = F.silu(a[:, : w.k]) * a[:, w.k :] if swiglu else a
            y = (a @ w.dense.t()).float()
        else:
            y = reference.fp8_linear(
                x, w.q, w.scale, variant in ("w8a8", "w8a8_inline", "scaled_mm"), swiglu,
                out_dtype=torch.float32,
            )  # fmt: skip
        return y + w.bias.float() if w.bias is not None else y


def graph_row_counts(buckets) -> set[int]:
    """The M values the decode step's GEMMs see for these batch buckets: B rows in the slow model
    and in fast passes 2.., 2B in the 2-token first fast pass."""
    return {m for b in buckets for m in (b, 2 * b)}
