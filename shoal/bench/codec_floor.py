"""The floor of the codec's batched streaming decode: FLOPs and bytes per call, and the time they allow.

Why: the streaming decode (`codec_stream.decode_step`, batched by `CodecStreamPool`) is what the
engine's vocoder runs, and speeding it up needs to know how far today's call is from what its
arithmetic and memory traffic allow, layer by layer. Counting by hand drifts from the code;
this module counts a real call instead.

How: one real `CodecStreamPool` call (gather states, `decode_step`, scatter states) of B streams x
C frames runs on the meta device (no memory, a second for the full-size codec) or on the CPU,
under a `TorchDispatchMode` that sees every aten op, while every module's methods are wrapped so
each op is charged to the innermost module running it. Per layer (a module):
- FLOPs: tensor-core work of matmuls, convolutions (transposed included) and attention,
  counted from the op shapes as executed; `recompute_flops` is the part the streaming step
  throws away (a transposed conv's outputs for its carried input, masked attention scores).
  Elementwise work (Snake, norms, GELU, residual adds, ...) counts one FLOP per element per op,
  separately (`vector_flops`): it runs on CUDA cores, not tensor cores.
- Bytes, the minimum in bf16: each layer reads its input once and writes its output once (a
  conv reads only its new rows; its carried context is state), weights once per call (shared by
  the streams of a batched call), and the carried state read once and written once. Glue ops
  inside composite modules (residual adds, RoPE, gating) are counted op by op, unfused.
- Launches: the kernels today's implementation runs (non-view aten ops; a Snake is one fused
  Triton kernel), and the bytes of its state copies (gather, cat, scatter), which the floor
  leaves out.
The floor of a layer is max(compute time, memory time) at the given rates; the call's floor is
their sum (layer by layer kernels), and max(total compute, total memory) the bound with
everything fused and overlapped.

    python -m shoal.bench.codec_floor [--size s2-pro|demo] [--batch 64] [--chunk 8] [--layers N]

On a CUDA machine, `--measure` also times graph replays and `pool.step` per shape and profiles
one call by stage and kernel kind (the eager profile cannot place some cuDNN kernels in their
stage: they land under "outside"; the by-kernel-name rows are exact); `--probe` times each conv
shape as today's cuDNN call, split into dilation phases, and as a bf16 / FP8 GEMM of the same
FLOPs; `--dump-kernels FILE` writes the graph replay's kernels in order.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from shoal.models.codec import Codec, CodecConfig, VectorQuantize
from shoal.models.codec_modules import (
    Attention,
    CausalConv1d,
    CausalConvTranspose1d,
    LayerScale,
    RMSNorm,
    Snake1d,
    StepContext,
)
from shoal.models.codec_stream import CodecStreamPool

BF16_BYTES = 2
# Methods through which the streaming decode enters a module; each is wrapped while tracing.
TRACED_METHODS = ("forward", "step", "qkv", "out", "finish", "embed", "decode", "decode_step")
# Aten ops that launch no kernel: they only allocate or make views.
NO_KERNEL_OPS = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}
# Ops that move data without arithmetic.
COPY_OPS = {
    "copy_", "cat", "stack", "gather", "index_select", "index_copy_", "index_add_", "clone", "to",
    "type_as", "contiguous", "embedding", "zeros", "zeros_like", "ones_like", "full", "arange",
    "zero_", "fill_", "_to_copy", "reshape", "polar",
}  # fmt: skip
SDPA_OPS = {
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_attention_math",
}  # fmt: skip
STATE_LAYER = "stream state gather/scatter"


@dataclass(frozen=True)
class Hardware:
    """Rates the floor is computed at; defaults are the H200 as measured here."""

    tensor_flops: float = 790e12  # dense bf16 matmul, FLOP/s
    vector_flops: float = 67e12  # fp32 CUDA-core elementwise, FLOP/s
    bandwidth: float = 4.0e12  # achievable copy bandwidth, bytes/s


@dataclass
class LayerCost:
    """What one layer (a module, or the glue ops of a composite module) costs in one call."""

    name: str
    stage: str
    kind: str
    flops: int = 0
    vector_flops: int = 0
    recompute_flops: int = 0
    weight_bytes: int = 0
    act_read_bytes: int = 0
    act_write_bytes: int = 0
    state_bytes: int = 0
    launches: int = 0
    copy_bytes: int = 0
    call: dict = field(default_factory=dict, compare=False)  # a conv's or linear's shapes (GEMM probe)

    @property
    def floor_bytes(self) -> int:
        return self.weight_bytes + self.act_read_bytes + self.act_write_bytes + self.state_bytes

    def compute_seconds(self, hardware: Hardware) -> float:
        return self.flops / hardware.tensor_flops + self.vector_flops / hardware.vector_flops

    def memory_seconds(self, hardware: Hardware) -> float:
        return self.floor_bytes / hardware.bandwidth

    def floor_seconds(self, hardware: Hardware) -> float:
        return max(self.compute_seconds(hardware), self.memory_seconds(hardware))


COUNTED_FIELDS = (
    "flops", "vector_flops", "recompute_flops", "weight_bytes", "act_read_bytes", "act_write_bytes",
    "state_bytes", "launches", "copy_bytes",
)  # fmt: skip


@dataclass
class CallCost:
    """All layers of one batched streaming call of `batch` streams x `chunk` frames."""

    config: CodecConfig
    batch: int
    chunk: int
    layers: list[LayerCost] = field(default_factory=list)

    @property
    def audio_seconds(self) -> float:
        return self.batch * self.chunk * self.config.frame_length / self.config.sample_rate

    def total(self, name: str) -> int:
        return sum(getattr(layer, name) for layer in self.layers)

    def stages(self) -> dict[str, LayerCost]:
        """Layers summed per stage, in decode order."""
        out: dict[str, LayerCost] = {}
        for layer in self.layers:
            into = out.setdefault(layer.stage, LayerCost(layer.stage, layer.stage, "stage"))
            for name in COUNTED_FIELDS:
                setattr(into, name, getattr(into, name) + getattr(layer, name))
        return out

    def floor_seconds(self, hardware: Hardware) -> float:
        """Layer by layer: each layer at its own roofline."""
        return sum(layer.floor_seconds(hardware) for layer in self.layers)

    def fused_seconds(self, hardware: Hardware) -> float:
        """Everything overlapped: the larger of total compute and total memory time."""
        compute = sum(layer.compute_seconds(hardware) for layer in self.layers)
        return max(compute, self.total("floor_bytes") / hardware.bandwidth)

    def by_name(self) -> dict[str, LayerCost]:
        return {layer.name: layer for layer in self.layers}


def _floating(t: object) -> bool:
    return isinstance(t, Tensor) and t.is_floating_point()


def _tensors(tree: object) -> list[Tensor]:
    if isinstance(tree, Tensor):
        return [tree]
    if isinstance(tree, list | tuple):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


def _bf16_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the floating tensors among `tensors`, at 2 bytes per element (bf16)."""
    return sum(t.numel() * BF16_BYTES for t in tensors if _floating(t))


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def tensor_flops(op: str, args: tuple, kwargs: dict, out: object) -> int:
    """Multiply-add FLOPs (2 per MAC) of a matmul, convolution or attention op; 0 for others."""
    if op == "linear":
        x, weight = args[0], args[1]
        return 2 * (x.numel() // weight.shape[1]) * weight.numel()
    if op in ("mm", "bmm", "matmul", "addmm", "baddbmm"):
        a = args[1] if op in ("addmm", "baddbmm") else args[0]
        return 2 * out.numel() * a.shape[-1]
    if op.startswith(("conv", "_convolution", "convolution")):
        x, weight = args[0], args[1]
        transposed = "transpose" in op or (
            op in ("convolution", "_convolution") and bool(args[6] if len(args) > 6 else False)
        )
        groups_inner = weight.shape[1] * math.prod(weight.shape[2:])
        # Each output (or, transposed, each input) element takes weight.shape[1] x kernel MACs.
        return 2 * (x.numel() if transposed else out.numel()) * groups_inner
    if op in SDPA_OPS:
        q, k, v = args[0], args[1], args[2]
        per_score = q.shape[-1] + v.shape[-1]
        return 2 * math.prod(q.shape[:-1]) * k.shape[-2] * per_score
    return 0


class _Frame:
    def __init__(self, layer: LayerCost, leaf: bool, state: bool = False):
        self.layer, self.leaf, self.state = layer, leaf, state


class _Tracer(TorchDispatchMode):
    """Charges every aten op to the innermost traced module (its `LayerCost`)."""

    def __init__(self, codec: Codec, parameters: set[int]):
        super().__init__()
        self.codec, self.parameters = codec, parameters
        self.layers: dict[str, LayerCost] = {}
        self.frames: list[_Frame] = []
        self.keep: list[Tensor] = []  # outputs stay alive, so a storage id is never reused
        self.window = codec.config.window_size

    def layer(self, name: str, kind: str) -> LayerCost:
        if name not in self.layers:
            self.layers[name] = LayerCost(name, stage_of(name, self.codec.config), kind)
        return self.layers[name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.frames:
            return out
        frame = self.frames[-1]
        op = func.overloadpacket.__name__
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        self.keep += outputs
        flops = tensor_flops(op, args, kwargs, out)
        layer = frame.layer
        layer.flops += flops
        if op in SDPA_OPS:
            self._attention(layer, args, flops)
        in_place = op.endswith("_")
        aliases = {_storage(t) for t in inputs}
        makes_view = bool(outputs) and all(_storage(t) in aliases for t in outputs) and not in_place
        if makes_view or op in NO_KERNEL_OPS:
            return out
        if not (frame.leaf and layer.kind == "snake"):  # a Snake is one fused kernel: counted at entry
            layer.launches += 1
        read, weights, written = self._op_bytes(op, args, inputs, outputs)
        if frame.state:
            layer.copy_bytes += read + weights + written
            return out
        if flops == 0 and op not in COPY_OPS:
            sizes = [t.numel() for t in inputs + outputs if _floating(t)]
            layer.vector_flops += max(sizes, default=0)
        if not frame.leaf and op not in SDPA_OPS:  # glue: counted op by op, unfused
            layer.act_read_bytes += read
            layer.weight_bytes += weights
            layer.act_write_bytes += written
        return out

    def _op_bytes(
        self, op: str, args: tuple, inputs: list[Tensor], outputs: list[Tensor]
    ) -> tuple[int, int, int]:
        """(activation bytes read, weight bytes read, bytes written) of one op, floating tensors
        in bf16. Gathers read only what they select; a copy does not read its destination."""
        if op in ("gather", "index_select", "embedding"):
            moved = _bf16_bytes(outputs)
            return moved, 0, moved
        if op in ("index_copy_", "index_add_"):
            moved = _bf16_bytes([args[3]])
            return moved, 0, moved
        if op == "copy_":
            moved = _bf16_bytes([args[0]])
            return moved, 0, moved
        weights = [t for t in inputs if _storage(t) in self.parameters]
        activations = [t for t in inputs if _storage(t) not in self.parameters]
        return _bf16_bytes(activations), _bf16_bytes(weights), _bf16_bytes(outputs)

    def _attention(self, layer: LayerCost, args: tuple, flops: int) -> None:
        """Attention reads q and the new keys/values; the cached window is state (read and
        rewritten). Scores of masked pairs beyond the window's `window` keys per query are
        recompute (steady state: every query sees a full window)."""
        q, k, v = args[0], args[1], args[2]
        new, keys = q.shape[-2], k.shape[-2]
        cached = keys - new
        layer.act_read_bytes += (q.numel() + (k.numel() + v.numel()) * new // keys) * BF16_BYTES
        layer.act_write_bytes += q.numel() * BF16_BYTES
        layer.state_bytes += 2 * (k.numel() + v.numel()) * cached // keys * BF16_BYTES
        layer.recompute_flops += flops - flops * min(self.window, keys) // keys


def stage_of(name: str, config: CodecConfig) -> str:
    """The decode stage a module belongs to, named with its rate and width."""
    frame_rate = config.sample_rate / config.frame_length
    if name == STATE_LAYER:
        return STATE_LAYER
    if name.startswith("quantizer.post_module"):
        return f"transformer ({config.transformer.n_layer} layers, {frame_rate:.1f} Hz)"
    if name.startswith("quantizer.upsample."):
        index = int(name.split(".")[2])
        factors = list(reversed(config.downsample_factor))
        rate = frame_rate * math.prod(factors[: index + 1])
        return f"upsample {index + 1} (x{factors[index]}, ConvNeXt, {rate:.0f} Hz)"
    if name.startswith("quantizer"):
        return "codebook embed"
    if name.startswith("decoder.model."):
        index = int(name.split(".")[2])
        rates = config.decoder_rates
        latent_rate = frame_rate * math.prod(config.downsample_factor)
        if index == 0:
            return f"decoder conv in ({config.decoder_dim} ch, {latent_rate:.0f} Hz)"
        if index <= len(rates):
            channels = config.decoder_dim // 2**index
            rate = latent_rate * math.prod(rates[:index])
            return f"decoder block {index} (x{rates[index - 1]}, {channels} ch, {rate:.0f} Hz)"
    return "decoder out (Snake, conv, tanh)"


def _leaf_kind(module: nn.Module) -> str | None:
    if isinstance(module, CausalConv1d):
        return "dwconv" if module.conv.groups > 1 else "conv"
    if isinstance(module, CausalConvTranspose1d):
        return "conv_transpose"
    if isinstance(module, nn.Linear | nn.Conv1d):
        return "linear"
    if isinstance(module, Snake1d):
        return "snake"
    if isinstance(module, RMSNorm | nn.LayerNorm):
        return "norm"
    if isinstance(module, LayerScale):
        return "scale"
    if isinstance(module, VectorQuantize):
        return "embedding"
    return None


def _parameter_bytes(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters()) * BF16_BYTES


def _account_leaf(layer: LayerCost, module: nn.Module, method, args, kwargs, result, flops: int) -> None:
    """Minimum bytes of one leaf call: its input read once, its output written once, its weights
    once; a causal conv's carried context is state (read and rewritten), not activation."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    params = bound.arguments
    if layer.kind in ("conv", "dwconv", "conv_transpose"):
        x = params["x"]
        context = module.context
        new = x.shape[1] - (context if params["joined"] else 0)
        batch, channels = x.shape[0], x.shape[2]
        layer.act_read_bytes += batch * new * channels * BF16_BYTES
        layer.act_write_bytes += result.numel() * BF16_BYTES
        layer.state_bytes += 2 * batch * context * channels * BF16_BYTES
        layer.weight_bytes += _parameter_bytes(module)
        if layer.kind == "conv_transpose":  # outputs of the carried inputs are computed, then cut
            layer.recompute_flops += flops * context // (new + context)
        conv = module.conv
        layer.call = {
            "batch": batch, "rows": new + context, "cin": channels, "cout": conv.out_channels,
            "kernel": conv.kernel_size[0], "dilation": conv.dilation[0], "stride": conv.stride[0],
            "groups": conv.groups,
        }  # fmt: skip
        return
    if layer.kind == "snake":
        pending = params.get("pending") or (None, None)
        layer.act_read_bytes += (params["x"].numel() + _numel(pending[0])) * BF16_BYTES
        total, activation = result
        layer.act_write_bytes += (activation.numel() + (total.numel() if params["need_sum"] else 0)) * 2
        layer.weight_bytes += _parameter_bytes(module)  # alpha; a pending bias is its conv's weight
        layer.launches += 1
        return
    if layer.kind == "embedding":
        codes = params["codes"]
        layer.act_read_bytes += codes.numel() * codes.element_size()
        layer.act_write_bytes += result.numel() * BF16_BYTES
        layer.weight_bytes += module.codebook.weight.numel() * BF16_BYTES
        return
    first = next(iter(params.values()))
    if layer.kind == "linear" and isinstance(module, nn.Linear):
        layer.call = {"rows": first.numel() // module.in_features, "cin": module.in_features,
                      "cout": module.out_features}  # fmt: skip
    layer.act_read_bytes += first.numel() * BF16_BYTES
    layer.act_write_bytes += result.numel() * BF16_BYTES
    layer.weight_bytes += _parameter_bytes(module)


def _numel(t: object) -> int:
    return t.numel() if isinstance(t, Tensor) else 0


@contextlib.contextmanager
def _traced_methods(codec: Codec, tracer: _Tracer) -> Iterator[None]:
    """Wrap each module's entry methods (instance attributes, removed after) so ops are charged
    to the innermost module; StepContext's state copies are marked as such."""
    wrapped: list[tuple[nn.Module, str]] = []

    def wrap(name: str, module: nn.Module, method_name: str):
        method = getattr(module, method_name)
        kind = _leaf_kind(module)
        if isinstance(module, VectorQuantize) and method_name != "embed":
            kind = None
        layer_kind = kind or ("attention" if isinstance(module, Attention) else "elementwise")
        layer_name = name if kind or isinstance(module, Attention) else f"{name or 'decode_step'} (glue)"

        @functools.wraps(method)
        def traced(*args, **kwargs):
            outer = tracer.frames[-1] if tracer.frames else None
            if outer is not None and outer.leaf:  # a leaf's own internals stay its own
                return method(*args, **kwargs)
            layer = tracer.layer(layer_name, layer_kind)
            before = layer.flops
            tracer.frames.append(_Frame(layer, leaf=kind is not None))
            try:
                result = method(*args, **kwargs)
            finally:
                tracer.frames.pop()
            if kind is not None:
                _account_leaf(layer, module, method, args, kwargs, result, layer.flops - before)
            return result

        setattr(module, method_name, traced)
        wrapped.append((module, method_name))

    def state_copy(original):
        @functools.wraps(original)
        def traced(self, *args, **kwargs):
            outer = tracer.frames[-1]
            tracer.frames.append(_Frame(outer.layer, leaf=outer.leaf, state=True))
            try:
                return original(self, *args, **kwargs)
            finally:
                tracer.frames.pop()

        return traced

    originals = {name: getattr(StepContext, name) for name in ("extend", "joined")}
    try:
        for name, module in codec.named_modules():
            for method_name in TRACED_METHODS:
                if method_name in type(module).__dict__ or any(
                    method_name in base.__dict__ for base in type(module).__mro__[1:-2]
                ):
                    wrap(name, module, method_name)
        for name, original in originals.items():
            setattr(StepContext, name, state_copy(original))
        yield
    finally:
        for name, original in originals.items():
            setattr(StepContext, name, original)
        for module, method_name in wrapped:
            delattr(module, method_name)


@torch.inference_mode()
def count_call(codec: Codec, batch: int, chunk: int, position: int = 1000) -> CallCost:
    """Trace one batched streaming call (every stream `chunk` new frames at frame `position`,
    i.e. in steady state) and return its cost per layer, in decode order."""
    parameters = {_storage(p) for p in codec.parameters()}
    tracer = _Tracer(codec, parameters)
    device = codec.device
    pool = CodecStreamPool(codec, batch)
    slots = torch.arange(batch, device=device)
    pool.positions.fill_(position)
    codes = torch.zeros(batch, codec.num_codebooks, chunk, dtype=torch.long, device=device)
    valid = torch.full((batch,), chunk, dtype=torch.long, device=device)
    state_layer = tracer.layer(STATE_LAYER, "state")
    with _traced_methods(codec, tracer), tracer:
        tracer.frames.append(_Frame(state_layer, leaf=False, state=True))
        pool._run(slots, codes, valid)
        tracer.frames.pop()
    layers = sorted(tracer.layers.values(), key=lambda layer: _decode_order(layer.name))  # stable
    return CallCost(codec.config, batch, chunk, [layer for layer in layers if _counted(layer)])


def _decode_order(name: str) -> tuple[int, int]:
    """Where a layer's stage runs in the decode: embed, transformer, upsample, decoder, state."""
    parts = name.split(" ")[0].split(".")
    if name == STATE_LAYER:
        return (4, 0)
    if parts[0] == "quantizer":
        section = parts[1] if len(parts) > 1 else ""
        if section == "post_module":
            return (1, 0)
        return (2, int(parts[2])) if section == "upsample" and len(parts) > 2 else (0, 0)
    if parts[0] == "decoder" and len(parts) > 2 and parts[2].isdigit():
        return (3, int(parts[2]))
    return (3, 1_000)  # decode_step's own ops: the final tanh


def _counted(layer: LayerCost) -> bool:
    return any(getattr(layer, name) for name in COUNTED_FIELDS)


def meta_codec(config: CodecConfig, dtype: torch.dtype = torch.bfloat16) -> Codec:
    """The codec's module tree on the meta device: shapes without memory or weights."""
    with torch.device("meta"):
        return Codec(config).to(dtype).eval().requires_grad_(False)


def codec_config(size: str) -> CodecConfig:
    """`s2-pro`: the shipped full-size codec (S1-mini and S2-Pro); `demo`: the demo checkpoint's."""
    if size == "s2-pro":
        return CodecConfig()
    if size == "demo":
        from shoal.demo import demo_codec_config

        return demo_codec_config()
    raise ValueError(f"size must be s2-pro or demo, got {size!r}")


# ---------------------------------------------------------------- report


HEADER = (
    f"{'GFLOP':>8} {'vGFLOP':>7} {'wts MB':>7} {'act MB':>8} {'st MB':>6} {'comp ms':>8} {'mem ms':>7} "
    f"{'floor ms':>8} {'FLOP-bound':>10} {'kernels':>7}"
)


def _row(label: str, layers: list[LayerCost], hardware: Hardware) -> str:
    """One table row for a group of layers: totals, compute and memory time, the layer-by-layer
    floor and the share of it spent in FLOP-bound layers, today's kernel count."""

    def total(name: str) -> int:
        return sum(getattr(layer, name) for layer in layers)

    compute = sum(layer.compute_seconds(hardware) for layer in layers)
    memory = sum(layer.memory_seconds(hardware) for layer in layers)
    floor = sum(layer.floor_seconds(hardware) for layer in layers)
    flop_bound = sum(
        layer.floor_seconds(hardware)
        for layer in layers
        if layer.compute_seconds(hardware) >= layer.memory_seconds(hardware)
    )
    activations = total("act_read_bytes") + total("act_write_bytes")
    return (
        f"{label:<46} {total('flops') / 1e9:>8.1f} {total('vector_flops') / 1e9:>7.1f} "
        f"{total('weight_bytes') / 1e6:>7.1f} {activations / 1e6:>8.1f} {total('state_bytes') / 1e6:>6.1f} "
        f"{1e3 * compute:>8.3f} {1e3 * memory:>7.3f} {1e3 * floor:>8.3f} "
        f"{100 * flop_bound / floor if floor else 0:>9.0f}% {total('launches'):>7}"
    )


def _grouped(layers: list[LayerCost], key) -> dict[str, list[LayerCost]]:
    out: dict[str, list[LayerCost]] = {}
    for layer in layers:
        out.setdefault(key(layer), []).append(layer)
    return out


def report(cost: CallCost, hardware: Hardware) -> str:
    """The per-stage and per-kind tables and the totals, as printed by the CLI."""
    seconds = cost.audio_seconds
    lines = [
        f"codec streaming-decode floor: {cost.batch} streams x {cost.chunk} frames = "
        f"{seconds:.2f} audio s per call (computed, not measured)",
        f"rates: {hardware.tensor_flops / 1e12:.0f} TFLOP/s tensor (bf16 dense), "
        f"{hardware.vector_flops / 1e12:.0f} TFLOP/s elementwise, {hardware.bandwidth / 1e12:.1f} TB/s; "
        "bytes in bf16, weights once per call",
        "",
        f"{'stage (one call)':<46} {HEADER}",
    ]
    for name, layers in _grouped(cost.layers, lambda layer: layer.stage).items():
        lines.append(_row(name, layers, hardware))
    lines.append(_row("total", cost.layers, hardware))
    lines += ["", f"{'layer kind (one call)':<46} {HEADER}"]
    for name, layers in _grouped(cost.layers, lambda layer: layer.kind).items():
        lines.append(_row(f"{name} ({len(layers)})", layers, hardware))
    floor, fused = cost.floor_seconds(hardware), cost.fused_seconds(hardware)
    act = cost.total("act_read_bytes") + cost.total("act_write_bytes")
    state, weights = cost.total("state_bytes"), cost.total("weight_bytes")
    recompute, moved = cost.total("recompute_flops"), cost.total("floor_bytes")
    state_launches = sum(layer.launches for layer in cost.layers if layer.stage == STATE_LAYER)
    lines += [
        "",
        f"per audio second: {cost.total('flops') / seconds / 1e9:.1f} GFLOP tensor + "
        f"{cost.total('vector_flops') / seconds / 1e9:.2f} GFLOP elementwise; "
        f"{cost.total('floor_bytes') / seconds / 1e6:.0f} MB at this batch x chunk (activations "
        f"{act / seconds / 1e6:.0f}, state {cost.total('state_bytes') / seconds / 1e6:.1f}, weights "
        f"{cost.total('weight_bytes') / seconds / 1e6:.1f})",
        f"floor, layer by layer (sum of each layer's max(compute, memory)): {1e3 * floor:.2f} ms per call "
        f"-> {seconds / floor:,.0f} audio-s/s",
        f"bound, everything fused and overlapped (max(total compute, total memory)): {1e3 * fused:.2f} ms "
        f"-> {seconds / fused:,.0f} audio-s/s",
        f"streaming overhead: recomputed {recompute / 1e9:.2f} GFLOP "
        f"({100 * recompute / max(cost.total('flops'), 1):.2f}% of FLOPs: transposed-conv outputs of "
        f"carried inputs, masked attention scores); carried state {state / 1e6:.0f} MB read + written, "
        f"weights {weights / 1e6:.0f} MB ({100 * (state + weights) / moved:.1f}% of bytes)",
        f"today's implementation: {cost.total('launches')} kernels per call ({state_launches} state "
        f"gather/scatter), {cost.total('copy_bytes') / 1e6:.0f} MB of state copies (gather, cat, "
        "scatter) that the floor leaves out",
    ]
    return "\n".join(lines)


def layer_report(cost: CallCost, hardware: Hardware, top: int) -> str:
    """The `top` layers by floor time."""
    rows = sorted(cost.layers, key=lambda layer: -layer.floor_seconds(hardware))[:top]
    lines = [f"{f'top {top} layers by floor time':<46} {HEADER}"]
    lines += [_row(f"{layer.name[-36:]} [{layer.kind}]", [layer], hardware) for layer in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------- measured on CUDA (optional)


@contextlib.contextmanager
def _stage_ranges(codec: Codec) -> Iterator[None]:
    """Profiler ranges named by decode stage around each module call that enters a new stage
    (never nested within the same stage), so kernel time can be charged per stage."""
    current: list[str] = [""]
    wrapped: list[tuple[nn.Module, str]] = []
    for name, module in codec.named_modules():
        if not name:
            continue
        stage = stage_of(name, codec.config)
        for method_name in ("step", "forward", "embed", "decode"):
            if method_name not in type(module).__dict__:
                continue

            def traced(*args, _method=getattr(module, method_name), _stage=stage, **kwargs):
                if current[-1] == _stage:
                    return _method(*args, **kwargs)
                current.append(_stage)
                try:
                    with torch.profiler.record_function(f"stage: {_stage}"):
                        return _method(*args, **kwargs)
                finally:
                    current.pop()

            setattr(module, method_name, traced)
            wrapped.append((module, method_name))
    try:
        yield
    finally:
        for module, method_name in wrapped:
            delattr(module, method_name)


def _subtree_kernels(event) -> list:
    return list(getattr(event, "kernels", [])) + [k for c in event.cpu_children for k in _subtree_kernels(c)]


@torch.inference_mode()
def measure_cuda(config: CodecConfig, shapes: list[tuple[int, int]], profile_shape: tuple[int, int],
                 replays: int = 20, dump: str | None = None) -> None:  # fmt: skip
    """Print measured graph-replay and `pool.step` times per (batch, chunk), and for
    `profile_shape` the kernel time and kernel count per stage of an eager call (cuDNN plans as
    the graphs use them) and of one graph replay: where the time of a call goes."""
    from shoal.models.codec import random_codec

    torch.backends.cudnn.benchmark = False
    codec = random_codec(config, seed=0, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    print(f"measured on {torch.cuda.get_device_name()}, bf16, random weights and codes")
    print(
        f"{'streams':>7} {'chunk':>5} {'replay ms':>9} {'step ms':>8} {'audio-s/s (step)':>16} {'floor %':>7}"
    )
    for batch, chunk in shapes:
        pool = codec.stream_pool(batch)
        pool.capture_cuda_graphs([batch], [chunk])
        graph, static, _ = pool._graphs[(batch, chunk)]
        streams = [pool.open() for _ in range(batch)]
        codes = _random_codes(codec, batch, chunk * (replays + 1), gen)
        static["slots"].copy_(torch.tensor([s.slot for s in streams]))
        static["valid"].fill_(chunk)
        static["codes"].copy_(codes[:, :, :chunk])
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        replay_ms = start.elapsed_time(end) / replays
        pieces = [[codes[b, :, i * chunk : (i + 1) * chunk] for b in range(batch)] for i in range(replays)]
        pool.step(streams, pieces[0])
        torch.cuda.synchronize()
        start.record()
        for piece in pieces[1:]:
            pool.step(streams, piece)
        end.record()
        torch.cuda.synchronize()
        step_ms = start.elapsed_time(end) / (replays - 1)
        audio = batch * chunk * config.frame_length / config.sample_rate
        floor = count_call(meta_codec(config), batch, chunk).floor_seconds(Hardware())
        print(f"{batch:>7} {chunk:>5} {replay_ms:>9.2f} {step_ms:>8.2f} {1e3 * audio / step_ms:>9,.0f} "
              f"{100 * 1e3 * floor / step_ms:>7.0f}%")  # fmt: skip
        if (batch, chunk) == profile_shape:
            try:
                _profile_call(codec, pool, static, graph, profile_shape, dump)
            except Exception as error:  # the timings above still stand
                print(f"profile failed: {error!r}")
        del pool, graph, static
        torch.cuda.empty_cache()


def kernel_category(name: str) -> str:
    """A CUDA kernel's kind, from its name (cuDNN, cuBLAS, Triton and aten kernel names)."""
    lowered = name.lower()
    for category, needles in (
        ("snake", ("snake",)),
        ("attention", ("sdpa", "flash", "fmha", "attention")),
        ("conv (cuDNN)", ("fprop", "dgrad", "convfwd", "conv", "implicit_gemm", "cudnn")),
        ("gemm", ("nvjet", "gemm", "cutlass")),
        ("cat", ("catarray",)),
        ("gather/index", ("gather", "scatter", "index")),
        ("reduce", ("reduce",)),
        ("elementwise", ("elementwise", "vectorized", "unrolled")),
    ):
        if any(needle in lowered for needle in needles):
            return category
    return "other"


def _profile_call(
    codec: Codec, pool: CodecStreamPool, static: dict, graph, shape: tuple[int, int], dump: str | None = None
) -> None:
    from torch.profiler import ProfilerActivity, profile

    pool.cudnn_benchmark_eager = True  # the plans the graph capture chose (cached per shape)
    args = (static["slots"], static["codes"], static["valid"])
    for _ in range(2):
        pool.run(*args)
    torch.cuda.synchronize()
    calls = 3
    with _stage_ranges(codec), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            pool.run(*args)
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = [e for e in prof.events() if e.device_type == cuda and not e.name.startswith("stage: ")]
    kernels = [e for e in kernels if not getattr(e, "is_user_annotation", False)]
    stages: dict[str, list[float]] = {}
    for event in prof.events():  # kernels launched under each stage's CPU range
        if event.name.startswith("stage: ") and event.device_type == torch.autograd.DeviceType.CPU:
            launched = _subtree_kernels(event)
            into = stages.setdefault(event.name[7:], [0.0, 0])
            into[0] += sum(k.duration for k in launched) / calls
            into[1] += len(launched) / calls
    if not any(us for us, _ in stages.values()):  # else: kernels inside each stage's GPU-side range
        stages = {}
        ranges = [e for e in prof.events() if e.device_type == cuda and e.name.startswith("stage: ")]
        for event in ranges:
            inside = [
                k for k in kernels
                if event.time_range.start <= k.time_range.start and k.time_range.end <= event.time_range.end
            ]  # fmt: skip
            into = stages.setdefault(event.name[7:], [0.0, 0])
            into[0] += sum(k.device_time_total for k in inside) / calls
            into[1] += len(inside) / calls
    total_us = sum(e.device_time_total for e in kernels) / calls
    floor = count_call(meta_codec(codec.config), *shape)
    floor_stages = floor.stages()
    hardware = Hardware()
    print(f"\neager {shape[0]} x {shape[1]}: {len(kernels) / calls:.0f} kernels, {total_us / 1e3:.2f} ms of "
          f"kernel time per call (floor {1e3 * floor.floor_seconds(hardware):.2f} ms; "
          f"{floor.total('launches')} kernels counted on the meta device)")  # fmt: skip
    print(f"{'stage':<44} {'kernel ms':>9} {'kernels':>7} {'floor ms':>8} {'x floor':>7}")
    staged_us, staged_kernels = 0.0, 0
    for name, (us, count) in stages.items():
        stage_floor = sum(
            layer.floor_seconds(hardware) for layer in floor.layers if layer.stage == name
        ) if name in floor_stages else 0.0  # fmt: skip
        staged_us, staged_kernels = staged_us + us, staged_kernels + count
        ratio = us / 1e6 / stage_floor if stage_floor else float("nan")
        print(f"{name:<44} {us / 1e3:>9.3f} {count:>7.0f} {1e3 * stage_floor:>8.3f} {ratio:>7.1f}")
    print(f"{'outside: state I/O, glue, unplaced kernels':<44} {(total_us - staged_us) / 1e3:>9.3f} "
          f"{len(kernels) / calls - staged_kernels:>7.0f}")  # fmt: skip
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        into = by_name.setdefault(e.name[:80], [0.0, 0])
        into[0] += e.device_time_total / calls
        into[1] += 1 / calls
    print("top kernels:")
    for name, (us, count) in sorted(by_name.items(), key=lambda item: -item[1][0])[:16]:
        print(f"  {us / 1e3:7.3f} ms {count:5.0f}x  {name}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    replayed = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    replayed = [e for e in replayed if not getattr(e, "is_user_annotation", False)]
    if dump:
        rows = sorted((e.time_range.start, e.device_time_total, e.name) for e in replayed)
        Path(dump).write_text(json.dumps([{"start_us": a, "us": b, "name": c} for a, b, c in rows]))
    categories: dict[str, list[float]] = {}
    for e in replayed:
        into = categories.setdefault(kernel_category(e.name), [0.0, 0])
        into[0] += e.device_time_total
        into[1] += 1
    ranked = sorted(categories.items(), key=lambda item: -item[1][0])
    print("graph replay by kernel kind: " + ", ".join(f"{k} {t / 1e3:.2f} ms ({n})" for k, (t, n) in ranked))
    if replayed:
        busy = sum(e.device_time_total for e in replayed)
        span = max(e.time_range.end for e in replayed) - min(e.time_range.start for e in replayed)
        idle = (span - busy) / max(len(replayed), 1)
        print(f"graph replay: {len(replayed)} kernels, {busy / 1e3:.2f} ms busy in a {span / 1e3:.2f} ms "
              f"span ({idle:.2f} us idle per kernel)")  # fmt: skip
    else:
        print("graph replay: the profiler recorded no kernels inside the graph")


def gemm_shape(layer: LayerCost) -> tuple[int, int, int] | None:
    """(M, K, N) of the dense GEMM with the FLOPs of a conv, transposed conv or linear layer as
    executed: an implicit-GEMM conv has K = cin x kernel; a transposed conv, N = cout x kernel."""
    call = layer.call
    if not call or call.get("groups", 1) > 1:
        return None
    if layer.kind == "linear":
        return call["rows"], call["cin"], call["cout"]
    if layer.kind == "conv_transpose":
        return call["batch"] * call["rows"], call["cin"], call["cout"] * call["kernel"]
    receptive = (call["kernel"] - 1) * call["dilation"] + 1
    return call["batch"] * (call["rows"] - receptive + 1), call["cin"] * call["kernel"], call["cout"]


def _time_ms(work, reps: int = 10) -> float:
    """Median ms of `work()` by CUDA events, after two warm-up calls."""
    for _ in range(2):
        work()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        work()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def probe_gemms(cost: CallCost) -> None:
    """For each distinct conv / linear shape of the call: today's cuDNN conv (channels-last, as
    the streaming step calls it; cuDNN's search on) against a dense bf16 GEMM and an FP8 GEMM
    (torch._scaled_mm, per-tensor scales) of the same FLOPs: what a GEMM-based or FP8 kernel
    could gain per layer. Random data, median of 10."""
    torch.backends.cudnn.benchmark = True
    groups: dict[tuple, list[LayerCost]] = {}
    for layer in cost.layers:
        shape = gemm_shape(layer)
        if shape is not None:
            key = (layer.kind, shape, tuple(sorted(layer.call.items())))
            groups.setdefault(key, []).append(layer)
    print(f"\n{'layer (count)':<44} {'M':>8} {'K':>5} {'N':>5} {'GFLOP':>6} {'today ms':>8} {'TF/s':>5} "
          f"{'phased':>7} {'TF/s':>5} {'bf16 mm':>7} {'TF/s':>5} {'fp8 mm':>7} {'TF/s':>5}")  # fmt: skip
    totals = [0.0, 0.0, 0.0, 0.0]
    for (kind, (m, k, n), _), layers in groups.items():
        flops, count = layers[0].flops, len(layers)
        times = _time_shapes(kind, layers[0].call, m, k, n)
        today = times[0] if times[0] == times[0] else times[2]  # a linear: as its bf16 GEMM
        fallback = (today, today, times[2], times[2])  # not applicable: as today / as the bf16 GEMM
        for i, ms in enumerate(times):
            totals[i] += count * (ms if ms == ms else fallback[i])
        rates = [flops / ms / 1e9 for ms in times]
        label = f"{layers[0].name[-34:]} [{kind}] ({count})"
        print(f"{label:<44} {m:>8} {k:>5} {n:>5} {flops / 1e9:>6.1f} {times[0]:>8.3f} {rates[0]:>5.0f} "
              f"{times[1]:>7.3f} {rates[1]:>5.0f} {times[2]:>7.3f} {rates[2]:>5.0f} {times[3]:>7.3f} "
              f"{rates[3]:>5.0f}")  # fmt: skip
    print(f"sum over the layers: today {totals[0]:.2f} ms (linears as their bf16 GEMM), dilated convs "
          f"phased {totals[1]:.2f} ms, as bf16 GEMMs {totals[2]:.2f} ms, "
          f"as FP8 GEMMs {totals[3]:.2f} ms")  # fmt: skip


def _time_shapes(kind: str, call: dict, m: int, k: int, n: int) -> tuple[float, float, float, float]:
    """ms of (today's cuDNN conv, the same dilated conv split into `dilation` phases, a bf16 GEMM
    M x K x N, an FP8 GEMM); nan where it does not apply.

    Phases: a conv of dilation d over time-major rows is an undilated (kernel x 1) conv over the
    rows viewed as [B, rows / d, d, C] (rows padded to a multiple of d): the same arithmetic,
    exact, as a plain 2-D conv with no dilation."""
    import torch.nn.functional as F

    bf16, today, phased, fp8 = torch.bfloat16, float("nan"), float("nan"), float("nan")
    if kind != "linear":
        x = torch.randn(call["batch"], call["rows"], call["cin"], device="cuda", dtype=bf16)
        x = x.transpose(1, 2).unsqueeze(2)  # channels-last [B, C, 1, T], as `channels_last_2d`
        if kind == "conv_transpose":
            w = torch.randn(call["cin"], call["cout"], 1, call["kernel"], device="cuda", dtype=bf16)
            today = _time_ms(lambda: F.conv_transpose2d(x, w, None, (1, call["stride"])))
        else:
            w = torch.randn(call["cout"], call["cin"], 1, call["kernel"], device="cuda", dtype=bf16)
            today = _time_ms(lambda: F.conv2d(x, w, None, 1, 0, (1, call["dilation"])))
            dilation = call["dilation"]
            if dilation > 1:
                rows = -(-call["rows"] // dilation) * dilation
                flat = torch.randn(call["batch"], rows, call["cin"], device="cuda", dtype=bf16)
                split = flat.view(call["batch"], rows // dilation, dilation, call["cin"]).permute(0, 3, 1, 2)
                w_split = w.permute(0, 1, 3, 2).contiguous()  # [Cout, Cin, kernel, 1]
                phased = _time_ms(lambda: F.conv2d(split, w_split))
    a = torch.randn(m, k, device="cuda", dtype=bf16)
    b = torch.randn(n, k, device="cuda", dtype=bf16)
    dense = _time_ms(lambda: a @ b.t())
    if k % 16 == 0 and n % 16 == 0:
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        fp8 = _time_ms(lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=bf16))
    return today, phased, dense, fp8


def _random_codes(codec: Codec, batch: int, frames: int, gen: torch.Generator) -> Tensor:
    cfg = codec.config
    semantic = torch.randint(0, cfg.semantic_codebook_size, (batch, 1, frames), generator=gen)
    residual = torch.randint(0, cfg.codebook_size, (batch, cfg.n_codebooks, frames), generator=gen)
    return torch.cat([semantic, residual], 1).to(codec.device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["s2-pro", "demo"], default="s2-pro")
    parser.add_argument("--batch", type=int, default=64, help="streams per call")
    parser.add_argument("--chunk", type=int, default=8, help="new frames per stream per call")
    parser.add_argument("--tflops", type=float, default=790.0, help="dense bf16 tensor-core TFLOP/s")
    parser.add_argument("--vector-tflops", type=float, default=67.0, help="elementwise TFLOP/s")
    parser.add_argument("--bandwidth", type=float, default=4.0, help="achievable TB/s")
    parser.add_argument("--layers", type=int, default=0, help="also list the N most expensive layers")
    parser.add_argument(
        "--measured", type=float, default=None, help="measured audio-s/s, shown as a fraction of the floor"
    )
    parser.add_argument(
        "--measure", action="store_true",
        help="CUDA: also time graph replays and profile a call per stage (random full-size weights)",
    )  # fmt: skip
    parser.add_argument(
        "--measure-shapes", nargs="+", default=["1x8", "16x8", "64x4", "64x8", "64x16", "64x32"],
        help="streams x chunk shapes to time with --measure",
    )  # fmt: skip
    parser.add_argument("--probe", action="store_true", help="CUDA: time conv shapes as cuDNN, GEMM, FP8")
    parser.add_argument("--dump-kernels", default=None, help="write the graph replay's kernels to this JSON")
    args = parser.parse_args(argv)
    hardware = Hardware(args.tflops * 1e12, args.vector_tflops * 1e12, args.bandwidth * 1e12)
    cost = count_call(meta_codec(codec_config(args.size)), args.batch, args.chunk)
    print(report(cost, hardware))
    if args.measured:
        floor = cost.audio_seconds / cost.floor_seconds(hardware)
        print(f"measured {args.measured:,.0f} audio-s/s = {100 * args.measured / floor:.0f}% of the floor "
              f"({1e3 * cost.audio_seconds / args.measured:.2f} ms per call)")  # fmt: skip
    if args.layers:
        print()
        print(layer_report(cost, hardware, args.layers))
    if args.measure:
        print()
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.measure_shapes]
        measure_cuda(codec_config(args.size), shapes, (args.batch, args.chunk), dump=args.dump_kernels)
    if args.probe:
        probe_gemms(cost)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
