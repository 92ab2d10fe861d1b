"""Batched streaming decode for the codec: feed frames as they arrive, get only the new samples.

Design (docs/codec.md has the receptive-field arithmetic): the decode path is causal, and its
8-layer window-128 transformer alone sees 8 * 127 = 1016 frames back, so re-decoding a bounded
left context could not reproduce the full decode. Instead every stream carries exactly the
state its next frames need: each transformer layer's last 127 keys/values and each causal
conv's last (kernel - 1) * dilation inputs. The arithmetic then equals the full decode.

States live in a `CodecStreamPool`: one preallocated buffer per state tensor, `[slots, ...]`,
and a `CodecStream` is a handle to one slot. One `pool.step(...)` decodes the new frames of
many streams whose frame counts differ: rows are right-padded, causality keeps the padding out
of the real samples, and each row's carried state is cut at its own valid end. Gather, decode
and scatter run as one function of fixed-shape tensors, so a (batch, chunk) shape can be
captured as a CUDA graph (`pool.capture_cuda_graphs`).

The pool asks the codec for its state (`codec.stream_state_shapes()`) and its step
(`codec.decode_step(...)`): the modded DAC's are the two functions below; Fish Speech 1.5's
codec (`codec_firefly.FireflyCodec`, convolutions only) brings its own.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from shoal.models.codec_modules import CausalConv1d, CausalConvTranspose1d, StepContext, snake_then_conv


def stream_state_shapes(codec: nn.Module) -> dict[str, tuple[int, ...]]:
    """Per-stream carried state (no batch dim) of a modded DAC `codec.Codec`, keyed by the module
    that owns it."""
    shapes = codec.quantizer.post_module.state_shapes("quantizer.post_module")
    for name, module in codec.named_modules():
        on_decode_path = name.startswith(("quantizer.upsample", "decoder."))
        if on_decode_path and isinstance(module, CausalConv1d | CausalConvTranspose1d) and module.context:
            shapes[name] = (module.context, module.conv.in_channels)  # time-major, like the step path
    return shapes


def decode_step(
    codec: nn.Module, codes: Tensor, valid: Tensor, positions: Tensor, states: dict[str, Tensor]
) -> tuple[Tensor, dict[str, Tensor]]:
    """Decode new frames codes [B, N, t] (row b real for its first valid[b] frames; the stream's
    first new frame has absolute index positions[b]) -> (audio [B, t * frame_length], new states).

    Runs time-major ([B, T, C]) throughout; each conv bias is added by the fused Snake after it."""
    ctx = StepContext(states, positions)
    quantizer, layers = codec.quantizer, codec.decoder.model
    x = quantizer.embed(codes).transpose(1, 2)
    x = quantizer.post_module.step(x, ctx, "quantizer.post_module", valid)
    for i, (transposed, convnext) in enumerate(quantizer.upsample):
        x = transposed.step(x, ctx, f"quantizer.upsample.{i}.0", valid)
        valid = valid * transposed.stride
        x = convnext.step(x, ctx, f"quantizer.upsample.{i}.1", valid)
    pending = (None, layers[0].conv.bias)
    x = layers[0].step(x, ctx, "decoder.model.0", valid, bias=False)
    for j in range(1, len(layers) - 3):
        block, key = layers[j].block, f"decoder.model.{j}.block"
        x = snake_then_conv(
            block[0], block[1], x, pending, ctx, f"{key}.1", valid, bias=False, need_sum=False
        )[1]
        valid, pending = valid * block[1].stride, (None, block[1].conv.bias)
        for u in range(2, len(block)):
            x, pending = block[u].step(x, pending, ctx, f"{key}.{u}", valid)
    last = len(layers) - 2
    audio = snake_then_conv(
        layers[last - 1], layers[last], x, pending, ctx, f"decoder.model.{last}", valid, need_sum=False
    )[1]
    return torch.tanh(audio.squeeze(-1)), ctx.new_states


@contextlib.contextmanager
def cudnn_benchmark(enabled: bool):
    """Temporarily set torch.backends.cudnn.benchmark (the conv algorithm search)."""
    previous = torch.backends.cudnn.benchmark
    torch.backends.cudnn.benchmark = enabled
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = previous


class CodecStream:
    """One request's decode state: a slot in its pool plus how many frames it has decoded."""

    def __init__(self, pool: CodecStreamPool, slot: int):
        self.pool, self.slot, self.frames = pool, slot, 0

    def close(self) -> None:
        self.pool.release(self)


class CodecStreamPool:
    """Carried decode state for up to `max_streams` concurrent streams of one codec."""

    def __init__(self, codec: nn.Module, max_streams: int):
        self.codec, self.max_streams = codec, max_streams
        slots = max_streams + 1  # the last slot absorbs the padding rows of a batch bucket
        self.scratch = max_streams
        opts = {"device": codec.device, "dtype": codec.dtype}
        self.states = {
            k: torch.zeros(slots, *shape, **opts) for k, shape in codec.stream_state_shapes().items()
        }
        self.positions = torch.zeros(slots, dtype=torch.long, device=codec.device)
        self._free = list(range(max_streams - 1, -1, -1))
        # cuDNN algorithm search (torch.backends.cudnn.benchmark) while capturing graphs: the
        # fastest algorithm per conv shape is timed once and frozen into the graph. Off for eager
        # steps by default: there every new (batch, chunk) shape would pay a search of seconds.
        self.cudnn_benchmark_eager = False
        self._capturing = False
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict[str, Tensor], Tensor]] = {}

    def state_bytes_per_stream(self) -> int:
        return sum(buf[0].numel() * buf.element_size() for buf in self.states.values())

    def open(self) -> CodecStream:
        if not self._free:
            raise RuntimeError(f"all {self.max_streams} codec streams are in use")
        slot = self._free.pop()
        for buf in self.states.values():
            buf[slot].zero_()
        self.positions[slot] = 0
        return CodecStream(self, slot)

    def release(self, stream: CodecStream) -> None:
        if stream.slot is not None:
            self._free.append(stream.slot)
            stream.slot = None

    @torch.inference_mode()
    def step(self, streams: list[CodecStream], codes: list[Tensor]) -> list[Tensor]:
        """Decode each stream's new frames codes[i] [num_codebooks, t_i] (t_i may differ, may be 0);
        returns each stream's new audio [t_i * frame_length], continuing where it left off."""
        if len({s.slot for s in streams}) != len(streams) or any(s.slot is None for s in streams):
            raise ValueError("each open stream may appear once per step")
        lengths = [c.shape[-1] for c in codes]
        outputs: list[list[Tensor]] = [[] for _ in streams]
        done = [0] * len(streams)
        while True:
            todo = [i for i, n in enumerate(lengths) if done[i] < n]
            if not todo:
                break
            chunk = self._chunk_for(max(lengths[i] - done[i] for i in todo))
            take = {i: min(chunk, lengths[i] - done[i]) for i in todo}
            audio = self._run_padded(
                [streams[i] for i in todo], [codes[i][:, done[i] : done[i] + take[i]] for i in todo], chunk
            )
            for row, i in enumerate(todo):
                outputs[i].append(audio[row, : take[i] * self.codec.frame_length])
                done[i] += take[i]
                streams[i].frames += take[i]
        empty = torch.zeros(0, device=self.codec.device, dtype=self.codec.dtype)
        return [(parts[0] if len(parts) == 1 else torch.cat(parts)) if parts else empty for parts in outputs]

    def _chunk_for(self, frames: int) -> int:
        captured = sorted({t for _, t in self._graphs})
        if not captured:
            return frames
        return next((t for t in captured if t >= frames), captured[-1])

    def _run_padded(self, streams: list[CodecStream], codes: list[Tensor], chunk: int) -> Tensor:
        batch = len(streams)
        graph_batch = next((b for b, t in sorted(self._graphs) if t == chunk and b >= batch), None)
        rows = graph_batch or batch
        device = self.codec.device
        # Codes on the host (the vocoder's) are packed there, in pinned memory on CUDA, and sent
        # in one non-blocking copy: no pageable copies, which stall the thread on their stream.
        on_host = all(c.device.type == "cpu" for c in codes)
        pin = on_host and device.type == "cuda"
        pack_device = torch.device("cpu") if on_host else device
        meta = torch.zeros(2, rows, dtype=torch.long, pin_memory=pin)  # slots, valid frames
        meta[0] = self.scratch
        meta[0, :batch] = torch.tensor([s.slot for s in streams])
        meta[1, :batch] = torch.tensor([c.shape[-1] for c in codes])
        packed = torch.zeros(
            rows, self.codec.num_codebooks, chunk, dtype=torch.long, device=pack_device, pin_memory=pin
        )
        if all(c.shape[-1] == chunk for c in codes):  # the usual case: one copy, not one per row
            packed[:batch] = torch.stack([c.to(pack_device) for c in codes])
        else:
            for row, c in enumerate(codes):
                packed[row, :, : c.shape[-1]] = c
        if graph_batch is None:
            meta = meta.to(device, non_blocking=pin)
            return self.run(meta[0], packed.to(device, non_blocking=pin), meta[1])
        graph, static, out = self._graphs[(graph_batch, chunk)]
        static["slots"].copy_(meta[0], non_blocking=pin)
        static["valid"].copy_(meta[1], non_blocking=pin)
        static["codes"].copy_(packed, non_blocking=pin)
        graph.replay()
        return out[:batch].clone()  # the graph's output buffer is overwritten by the next replay

    def run(self, slots: Tensor, codes: Tensor, valid: Tensor) -> Tensor:
        """The fixed-shape core: gather states by slot, decode, scatter states back. Graph-safe."""
        with cudnn_benchmark(self._capturing or self.cudnn_benchmark_eager):
            return self._run(slots, codes, valid)

    def _run(self, slots: Tensor, codes: Tensor, valid: Tensor) -> Tensor:
        states = {k: buf.index_select(0, slots) for k, buf in self.states.items()}
        positions = self.positions.index_select(0, slots)
        audio, new_states = self.codec.decode_step(codes, valid, positions, states)
        for k, buf in self.states.items():
            buf.index_copy_(0, slots, new_states[k])
        self.positions.index_add_(0, slots, valid)
        return audio

    @torch.inference_mode()
    def capture_cuda_graphs(self, batch_sizes: list[int], chunk_frames: list[int]) -> None:
        """Capture `run` for each (batch bucket, chunk) shape; later steps pad up to a bucket."""
        self._capturing = True
        try:
            self._capture(batch_sizes, chunk_frames)
        finally:
            self._capturing = False

    def _capture(self, batch_sizes: list[int], chunk_frames: list[int]) -> None:
        device = self.codec.device
        pool = torch.cuda.graph_pool_handle()
        for chunk in chunk_frames:
            for batch in sorted(batch_sizes, reverse=True):
                static = {
                    "slots": torch.full((batch,), self.scratch, dtype=torch.long, device=device),
                    "valid": torch.zeros(batch, dtype=torch.long, device=device),
                    "codes": torch.zeros(
                        batch, self.codec.num_codebooks, chunk, dtype=torch.long, device=device
                    ),
                }
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # warm up kernels/allocator on the scratch slot only
                        self.run(static["slots"], static["codes"], static["valid"])
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self.run(static["slots"], static["codes"], static["valid"])
                self._graphs[(batch, chunk)] = (graph, static, out)
        torch.cuda.synchronize()
