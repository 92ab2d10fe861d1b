"""The floor of the codec's batched streaming decode: FLOPs and bytes per call, and the time they allow.

Speeding up the vocoder needs to know, layer by layer, how far a call is from what its arithmetic and
memory traffic allow, and counts by hand drift from the code: so this runs one real `CodecStreamPool`
call on the meta device under a `TorchDispatchMode` that charges every aten op to the innermost module
running it. Bytes are the minimum in bf16 (input read and output written once, weights once per call,
carried state read and rewritten once); a layer's floor is max(compute, memory) time, the call's their
sum. Reading of the numbers: docs/codec.md, "Floor of the streaming decode".

    python -m shoal.bench.codec_floor [--size s2-pro|demo] [--batch 64] [--chunk 8] [--layers N] [--measure]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import math
from collections import namedtuple
from dataclasses import dataclass, field, fields
from unittest import mock

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from shoal.models import codec_modules as cm
from shoal.models.codec import Codec, CodecConfig, VectorQuantize
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
    """What one layer (a module, or the glue ops of a composite module) costs in one call.
    `recompute_flops`: what the streaming step computes and throws away; `launches` and `copy_bytes`
    (state copies): today's implementation, outside the floor."""

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

    @property
    def floor_bytes(self) -> int:
        return self.weight_bytes + self.act_read_bytes + self.act_write_bytes + self.state_bytes

    def compute_seconds(self, hardware: Hardware) -> float:
        return self.flops / hardware.tensor_flops + self.vector_flops / hardware.vector_flops

    def memory_seconds(self, hardware: Hardware) -> float:
        return self.floor_bytes / hardware.bandwidth

    def floor_seconds(self, hardware: Hardware) -> float:
        return max(self.compute_seconds(hardware), self.memory_seconds(hardware))


COUNTED_FIELDS = tuple(f.name for f in fields(LayerCost))[3:]  # all but name, stage, kind


def _total(layers: list[LayerCost], name: str) -> int:
    return sum(getattr(layer, name) for layer in layers)


@dataclass
class CallCost:
    """All layers of one batched streaming call of `batch` streams x `chunk` frames, in decode order."""

    config: CodecConfig
    batch: int
    chunk: int
    layers: list[LayerCost] = field(default_factory=list)

    @property
    def audio_seconds(self) -> float:
        return self.batch * self.chunk * self.config.frame_length / self.config.sample_rate

    def total(self, name: str) -> int:
        return _total(self.layers, name)

    def floor_seconds(self, hardware: Hardware) -> float:
        """Layer by layer: each layer at its own roofline."""
        return sum(layer.floor_seconds(hardware) for layer in self.layers)

    def fused_seconds(self, hardware: Hardware) -> float:
        """Everything overlapped: the larger of total compute and total memory time."""
        compute = sum(layer.compute_seconds(hardware) for layer in self.layers)
        return max(compute, self.total("floor_bytes") / hardware.bandwidth)

    def by_name(self) -> dict[str, LayerCost]:
        return {layer.name: layer for layer in self.layers}


def _tensors(tree: object) -> list[Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, Tensor)]


def _bf16_bytes(tensors: list[Tensor]) -> int:
    """Bytes of the floating tensors among `tensors`, at 2 bytes per element (bf16)."""
    return sum(t.numel() * BF16_BYTES for t in tensors if t.is_floating_point())


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def tensor_flops(op: str, args: tuple, out: object) -> int:
    """Multiply-add FLOPs (2 per MAC) of a matmul, convolution or attention op; 0 for others."""
    if op == "linear":
        return 2 * (args[0].numel() // args[1].shape[1]) * args[1].numel()
    if op in ("mm", "bmm", "matmul", "addmm", "baddbmm"):
        return 2 * out.numel() * args[1 if op in ("addmm", "baddbmm") else 0].shape[-1]
    if op.startswith(("conv", "_convolution", "convolution")):
        x, weight = args[0], args[1]
        generic = op in ("convolution", "_convolution")
        transposed = "transpose" in op or (generic and len(args) > 6 and bool(args[6]))
        # Each output (or, transposed, each input) element takes weight.shape[1] x kernel MACs.
        return 2 * (x.numel() if transposed else out.numel()) * weight.shape[1] * math.prod(weight.shape[2:])
    if op in SDPA_OPS:
        q, k, v = args[0], args[1], args[2]
        return 2 * math.prod(q.shape[:-1]) * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return 0


_Frame = namedtuple("_Frame", "layer leaf state", defaults=[False])  # the traced module running an op


class _Tracer(TorchDispatchMode):
    """Charges every aten op to the innermost traced module (its `LayerCost`)."""

    def __init__(self, codec: Codec):
        super().__init__()
        self.config = codec.config
        self.parameters = {_storage(p) for p in codec.parameters()}
        self.layers: dict[str, LayerCost] = {}
        self.frames: list[_Frame] = []
        self.keep: list[Tensor] = []  # outputs stay alive, so a storage id is never reused

    def layer(self, name: str, kind: str) -> LayerCost:
        if name not in self.layers:
            self.layers[name] = LayerCost(name, stage_of(name, self.config), kind)
        return self.layers[name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.frames:
            return out
        (layer, leaf, state), op = self.frames[-1], func.overloadpacket.__name__
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        self.keep += outputs
        flops = tensor_flops(op, args, out)
        layer.flops += flops
        if op in SDPA_OPS:
            self._attention(layer, args, flops)
        aliases = {_storage(t) for t in inputs}
        makes_view = bool(outputs) and all(_storage(t) in aliases for t in outputs) and not op.endswith("_")
        if makes_view or op in NO_KERNEL_OPS:
            return out
        if not (leaf and layer.kind == "snake"):  # a Snake is one fused kernel: counted at entry
            layer.launches += 1
        # Bytes in bf16: gathers read only what they select; a copy does not read its destination.
        selected = {"copy_": 0, "index_copy_": 3, "index_add_": 3}  # the argument holding what moves
        if op in ("gather", "index_select", "embedding") or op in selected:
            read = written = _bf16_bytes([args[selected[op]]] if op in selected else outputs)
            weights = 0
        else:
            read = _bf16_bytes([t for t in inputs if _storage(t) not in self.parameters])
            weights = _bf16_bytes([t for t in inputs if _storage(t) in self.parameters])
            written = _bf16_bytes(outputs)
        if state:
            layer.copy_bytes += read + weights + written
            return out
        if flops == 0 and op not in COPY_OPS:
            sizes = [t.numel() for t in inputs + outputs if t.is_floating_point()]
            layer.vector_flops += max(sizes, default=0)
        if not leaf and op not in SDPA_OPS:  # glue: counted op by op, unfused
            layer.act_read_bytes += read
            layer.weight_bytes += weights
            layer.act_write_bytes += written
        return out

    def _attention(self, layer: LayerCost, args: tuple, flops: int) -> None:
        """Attention reads q and the new keys/values; the cached window is state (read and rewritten).
        Scores beyond the window's keys per query are masked: recompute (steady state)."""
        q, k, v = args[0], args[1], args[2]
        new, keys = q.shape[-2], k.shape[-2]
        layer.act_read_bytes += (q.numel() + (k.numel() + v.numel()) * new // keys) * BF16_BYTES
        layer.act_write_bytes += q.numel() * BF16_BYTES
        layer.state_bytes += 2 * (k.numel() + v.numel()) * (keys - new) // keys * BF16_BYTES
        layer.recompute_flops += flops - flops * min(self.config.window_size, keys) // keys

    def wrap(self, name: str, module: nn.Module, method_name: str):
        method, kind = getattr(module, method_name), _leaf_kind(module, method_name)
        attention = isinstance(module, cm.Attention)
        layer_name = name if kind or attention else f"{name or 'decode_step'} (glue)"
        layer_kind = kind or ("attention" if attention else "elementwise")

        @functools.wraps(method)
        def traced(*args, **kwargs):
            if self.frames and self.frames[-1].leaf:  # a leaf's own internals stay its own
                return method(*args, **kwargs)
            layer = self.layer(layer_name, layer_kind)
            before = layer.flops
            result = self._run_in(_Frame(layer, leaf=kind is not None), method, *args, **kwargs)
            if kind is not None:
                _account_leaf(layer, module, method, args, kwargs, result, layer.flops - before)
            return result

        return traced

    def state_copy(self, method):
        def traced(*args, **kwargs):  # in the frame of the module copying: its state bytes are copies
            return self._run_in(self.frames[-1]._replace(state=True), method, *args, **kwargs)

        return functools.wraps(method)(traced)

    def _run_in(self, frame: _Frame, method, *args, **kwargs):
        self.frames.append(frame)
        try:
            return method(*args, **kwargs)
        finally:
            self.frames.pop()


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
        index, rates = int(name.split(".")[2]), config.decoder_rates
        latent_rate = frame_rate * math.prod(config.downsample_factor)
        if index == 0:
            return f"decoder conv in ({config.decoder_dim} ch, {latent_rate:.0f} Hz)"
        if index <= len(rates):
            channels, rate = config.decoder_dim // 2**index, latent_rate * math.prod(rates[:index])
            return f"decoder block {index} (x{rates[index - 1]}, {channels} ch, {rate:.0f} Hz)"
    return "decoder out (Snake, conv, tanh)"


def _leaf_kind(module: nn.Module, method_name: str) -> str | None:
    """The kind of a module whose ops count as one layer, None for a composite (its ops are glue)."""
    if isinstance(module, cm.CausalConv1d):
        return "dwconv" if module.conv.groups > 1 else "conv"
    kinds = (
        (cm.CausalConvTranspose1d, "conv_transpose"), (nn.Linear | nn.Conv1d, "linear"),
        (cm.Snake1d, "snake"), (cm.RMSNorm | nn.LayerNorm, "norm"), (cm.LayerScale, "scale"),
    )  # fmt: skip
    if isinstance(module, VectorQuantize):
        return "embedding" if method_name == "embed" else None
    return next((kind for cls, kind in kinds if isinstance(module, cls)), None)


def _account_leaf(layer: LayerCost, module: nn.Module, method, args, kwargs, result, flops: int) -> None:
    """Minimum bytes of one leaf call: its input read once, its output written once, its weights
    once; a causal conv's carried context is state (read and rewritten), not activation."""
    bound = inspect.signature(method).bind(*args, **kwargs)
    bound.apply_defaults()
    params = bound.arguments
    weights = sum(p.numel() for p in module.parameters()) * BF16_BYTES
    if layer.kind in ("conv", "dwconv", "conv_transpose"):
        x, context = params["x"], module.context
        new = x.shape[1] - (context if params["joined"] else 0)
        layer.act_read_bytes += x.shape[0] * new * x.shape[2] * BF16_BYTES
        layer.state_bytes += 2 * x.shape[0] * context * x.shape[2] * BF16_BYTES
        if layer.kind == "conv_transpose":  # outputs of the carried inputs are computed, then cut
            layer.recompute_flops += flops * context // (new + context)
    elif layer.kind == "snake":  # reads x and a pending residual; writes snake(s) and, if asked, s
        pending = (params.get("pending") or (None, None))[0]
        layer.act_read_bytes += _bf16_bytes(_tensors([params["x"], pending]))
        total, activation = result
        layer.act_write_bytes += _bf16_bytes([activation, total] if params["need_sum"] else [activation])
        layer.weight_bytes += weights  # alpha; a pending bias is its conv's weight
        layer.launches += 1
        return
    elif layer.kind == "embedding":
        layer.act_read_bytes += params["codes"].numel() * params["codes"].element_size()
        weights = module.codebook.weight.numel() * BF16_BYTES
    else:
        layer.act_read_bytes += next(iter(params.values())).numel() * BF16_BYTES
    layer.act_write_bytes += result.numel() * BF16_BYTES
    layer.weight_bytes += weights


@torch.inference_mode()
def count_call(codec: Codec, batch: int, chunk: int, position: int = 1000) -> CallCost:
    """Trace one batched streaming call (every stream `chunk` new frames at frame `position`, i.e.
    in steady state) and return its cost per layer, in decode order."""
    tracer, device = _Tracer(codec), codec.device
    pool = CodecStreamPool(codec, batch)
    pool.positions.fill_(position)
    slots = torch.arange(batch, device=device)
    codes = torch.zeros(batch, codec.num_codebooks, chunk, dtype=torch.long, device=device)
    valid = torch.full((batch,), chunk, dtype=torch.long, device=device)
    with contextlib.ExitStack() as patches, tracer:
        # Each module's entry methods charge their ops to it; StepContext's state copies are marked.
        for name, module in codec.named_modules():
            classes = (type(module), *type(module).__mro__[1:-2])  # not nn.Module's, object's
            for method_name in TRACED_METHODS:
                if any(method_name in vars(cls) for cls in classes):
                    wrapped = tracer.wrap(name, module, method_name)
                    patches.enter_context(mock.patch.object(module, method_name, wrapped))
        for name in ("extend", "joined"):
            copy = tracer.state_copy(getattr(cm.StepContext, name))
            patches.enter_context(mock.patch.object(cm.StepContext, name, copy))
        tracer.frames.append(_Frame(tracer.layer(STATE_LAYER, "state"), leaf=False, state=True))
        pool._run(slots, codes, valid)
    # In the order the layers first ran, except the call's own glue (the final tanh) and state copies.
    last = {"decode_step (glue)": 0, STATE_LAYER: 1}
    layers = sorted(tracer.layers.values(), key=lambda layer: last.get(layer.name, -1))  # stable
    counted = [layer for layer in layers if any(getattr(layer, name) for name in COUNTED_FIELDS)]
    return CallCost(codec.config, batch, chunk, counted)


def meta_codec(config: CodecConfig, dtype: torch.dtype = torch.bfloat16) -> Codec:
    """The codec's module tree on the meta device: shapes without memory or weights."""
    with torch.device("meta"):
        return Codec(config).to(dtype).eval().requires_grad_(False)


def codec_config(size: str) -> CodecConfig:
    """`s2-pro`: the shipped full-size codec (S1-mini and S2-Pro); `demo`: the demo checkpoint's."""
    from shoal.demo import demo_codec_config

    return {"s2-pro": CodecConfig, "demo": demo_codec_config}[size]()


def _table(title: str, groups: dict[str, list[LayerCost]], hardware: Hardware) -> list[str]:
    """One row per group of layers: totals, compute and memory time, the layer-by-layer floor and
    the share of it in FLOP-bound layers, today's kernel count."""
    lines = [
        f"{title:<46} {'GFLOP':>8} {'vGFLOP':>7} {'wts MB':>7} {'act MB':>8} {'st MB':>6} {'comp ms':>8} "
        f"{'mem ms':>7} {'floor ms':>8} {'FLOP-bound':>10} {'kernels':>7}"
    ]
    for label, layers in groups.items():
        total = functools.partial(_total, layers)
        times = [
            (x.compute_seconds(hardware), x.memory_seconds(hardware), x.floor_seconds(hardware))
            for x in layers
        ]
        compute, memory, floor = (sum(column) for column in zip(*times, strict=True))
        flop_bound = sum(f for c, m, f in times if c >= m)
        activations = total("act_read_bytes") + total("act_write_bytes")
        lines.append(
            f"{label:<46} {total('flops') / 1e9:>8.1f} {total('vector_flops') / 1e9:>7.1f} "
            f"{total('weight_bytes') / 1e6:>7.1f} {activations / 1e6:>8.1f} "
            f"{total('state_bytes') / 1e6:>6.1f} {1e3 * compute:>8.3f} {1e3 * memory:>7.3f} "
            f"{1e3 * floor:>8.3f} {100 * flop_bound / floor if floor else 0:>9.0f}% {total('launches'):>7}"
        )
    return lines


def report(cost: CallCost, hardware: Hardware) -> str:
    """The per-stage and per-kind tables and the totals, as printed by the CLI."""
    seconds, total, layers = cost.audio_seconds, cost.total, cost.layers
    stages = {s: [x for x in layers if x.stage == s] for s in dict.fromkeys(x.stage for x in layers)}
    kinds = {k: [x for x in layers if x.kind == k] for k in dict.fromkeys(x.kind for x in layers)}
    floor, fused = cost.floor_seconds(hardware), cost.fused_seconds(hardware)
    act = total("act_read_bytes") + total("act_write_bytes")
    state, weights, recompute = total("state_bytes"), total("weight_bytes"), total("recompute_flops")
    state_launches = _total(stages.get(STATE_LAYER, []), "launches")
    return "\n".join([
        f"codec streaming-decode floor: {cost.batch} streams x {cost.chunk} frames = "
        f"{seconds:.2f} audio s per call (computed, not measured)",
        f"rates: {hardware.tensor_flops / 1e12:.0f} TFLOP/s tensor (bf16 dense), "
        f"{hardware.vector_flops / 1e12:.0f} TFLOP/s elementwise, {hardware.bandwidth / 1e12:.1f} TB/s; "
        "bytes in bf16, weights once per call",
        "",
        *_table("stage (one call)", stages | {"total": layers}, hardware),
        "",
        *_table("layer kind (one call)", {f"{k} ({len(v)})": v for k, v in kinds.items()}, hardware),
        "",
        f"per audio second: {total('flops') / seconds / 1e9:.1f} GFLOP tensor + "
        f"{total('vector_flops') / seconds / 1e9:.2f} GFLOP elementwise; "
        f"{total('floor_bytes') / seconds / 1e6:.0f} MB at this batch x chunk (activations "
        f"{act / seconds / 1e6:.0f}, state {state / seconds / 1e6:.1f}, "
        f"weights {weights / seconds / 1e6:.1f})",
        f"floor, layer by layer (sum of each layer's max(compute, memory)): {1e3 * floor:.2f} ms per call "
        f"-> {seconds / floor:,.0f} audio-s/s",
        f"bound, everything fused and overlapped (max(total compute, total memory)): {1e3 * fused:.2f} ms "
        f"-> {seconds / fused:,.0f} audio-s/s",
        f"streaming overhead: recomputed {recompute / 1e9:.2f} GFLOP "
        f"({100 * recompute / max(total('flops'), 1):.2f}% of FLOPs: transposed-conv outputs of "
        f"carried inputs, masked attention scores); carried state {state / 1e6:.0f} MB read + written, "
        f"weights {weights / 1e6:.0f} MB ({100 * (state + weights) / total('floor_bytes'):.1f}% of bytes)",
        f"today's implementation: {total('launches')} kernels per call ({state_launches} state "
        f"gather/scatter), {total('copy_bytes') / 1e6:.0f} MB of state copies (gather, cat, "
        "scatter) that the floor leaves out",
    ])  # fmt: skip


def _ms_per_call(calls: list) -> float:
    """Mean ms of the calls, run in order, by CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for call in calls:
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / len(calls)


@torch.inference_mode()
def measure_cuda(config: CodecConfig, shapes: list[tuple[int, int]], replays: int = 20) -> None:
    """Print measured graph-replay and `pool.step` times per (batch, chunk), against the floor."""
    from shoal.models.codec import random_codec

    torch.backends.cudnn.benchmark = False
    codec = random_codec(config, seed=0, device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    print(f"measured on {torch.cuda.get_device_name()}, bf16, random weights and codes")
    print("streams chunk replay ms  step ms audio-s/s (step) floor %")
    for batch, chunk in shapes:
        pool = codec.stream_pool(batch)
        pool.capture_cuda_graphs([batch], [chunk])
        graph, static, _ = pool._graphs[(batch, chunk)]
        streams = [pool.open() for _ in range(batch)]
        size = min(config.codebook_size, config.semantic_codebook_size)
        codes = torch.randint(0, size, (batch, codec.num_codebooks, chunk * replays), generator=gen).cuda()
        static["slots"].copy_(torch.tensor([s.slot for s in streams]))
        static["valid"].fill_(chunk)
        static["codes"].copy_(codes[:, :, :chunk])
        graph.replay()
        replay_ms = _ms_per_call([graph.replay] * replays)
        pieces = [[codes[b, :, i * chunk : (i + 1) * chunk] for b in range(batch)] for i in range(replays)]
        pool.step(streams, pieces[0])
        torch.cuda.synchronize()
        step_ms = _ms_per_call([functools.partial(pool.step, streams, piece) for piece in pieces[1:]])
        audio = batch * chunk * config.frame_length / config.sample_rate
        floor = count_call(meta_codec(config), batch, chunk).floor_seconds(Hardware())
        print(f"{batch:>7} {chunk:>5} {replay_ms:>9.2f} {step_ms:>8.2f} {1e3 * audio / step_ms:>9,.0f} "
              f"{100 * 1e3 * floor / step_ms:>7.0f}%")  # fmt: skip
        del pool, graph, static
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["s2-pro", "demo"], default="s2-pro")
    parser.add_argument("--batch", type=int, default=64, help="streams per call")
    parser.add_argument("--chunk", type=int, default=8, help="new frames per stream per call")
    parser.add_argument("--tflops", type=float, default=790.0, help="dense bf16 tensor-core TFLOP/s")
    parser.add_argument("--vector-tflops", type=float, default=67.0, help="elementwise TFLOP/s")
    parser.add_argument("--bandwidth", type=float, default=4.0, help="achievable TB/s")
    parser.add_argument("--layers", type=int, default=0, help="also list the N most expensive layers")
    parser.add_argument("--measure", action="store_true", help="CUDA: also time graph replays and pool.step")
    shapes = ["1x8", "16x8", "64x4", "64x8", "64x16", "64x32"]
    parser.add_argument("--measure-shapes", nargs="+", default=shapes, help="streams x chunk, for --measure")
    args = parser.parse_args(argv)
    hardware = Hardware(args.tflops * 1e12, args.vector_tflops * 1e12, args.bandwidth * 1e12)
    cost = count_call(meta_codec(codec_config(args.size)), args.batch, args.chunk)
    print(report(cost, hardware))
    if args.layers:
        rows = sorted(cost.layers, key=lambda layer: -layer.floor_seconds(hardware))[: args.layers]
        by_floor = {f"{layer.name[-36:]} [{layer.kind}]": [layer] for layer in rows}
        print("", *_table(f"top {args.layers} layers by floor time", by_floor, hardware), sep="\n")
    if args.measure:
        print()
        shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.measure_shapes]
        measure_cuda(codec_config(args.size), shapes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
