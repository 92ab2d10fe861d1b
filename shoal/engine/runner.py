"""The model runner: turns a step plan into tensors, runs the model, returns frames.

Prefill chunks run eagerly as one varlen forward; the chunks that reach the end of their
request's sequence sample that request's next frame. Decodes run the whole frame step on the
static `DecodeBuffers` (`batch.py`): with `decode_step="fast"` (the default on CUDA) the
graph-safe `DecodeStep` (`decode_step.py`), replayed as a CUDA graph per batch-size bucket
(`graphs.py`); with `"reference"` (the default elsewhere) `models/reference.decode_frame`,
the oracle's own code. Each row has its own parameters and counter-based randomness, so
batching never changes a request's frames. With `weight_format="fp8"` the model's projections are
FP8 (`quant/engine_fp8.py`): the fused step runs them through `Fp8Projections`, whose GEMM buffers
are reserved for every captured batch size before the graphs are captured.

A decode is split in `launch_decode` (host fill, non-blocking copies, replay, non-blocking
copy of the frames into pinned memory, an event) and `PendingDecode.result` (wait for the
event), so the caller can prepare other work while the GPU runs; with `overlap_steps` the
next decode of the same rows can be launched (`ahead=1`) before that wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shoal.config import EngineConfig
from shoal.engine.batch import DecodeBuffers, HostBatch
from shoal.engine.kv_cache import PagedKV
from shoal.engine.request import Request
from shoal.models.reference import decode_frame
from shoal.models.sampling import Sampler, SamplingBatch, push_frames

__all__ = ["DecodeBuffers", "ModelRunner", "PendingDecode"]


@dataclass
class PendingDecode:
    """A launched decode: `rows` live rows whose frames land in `host_frames`."""

    rows: int
    host_frames: Tensor
    event: torch.cuda.Event | None

    def result(self) -> Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host_frames[: self.rows].clone()


class ModelRunner:
    def __init__(self, model, config: EngineConfig, num_pages: int, max_seq_len: int) -> None:
        self.model = model
        self.config = config
        mc = model.config
        weight = model.embeddings.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.sampler = Sampler.for_config(mc)
        self.window_size = self.sampler.rules.window
        self.num_rows = mc.num_codebooks + 1
        self.page_size = config.page_size
        self.max_pages = -(-max_seq_len // config.page_size)
        self.max_batch = config.max_running_requests
        self.kv = PagedKV(
            mc.n_layer, num_pages, config.page_size, mc.n_local_heads, mc.head_dim, self.dtype, self.device
        )
        on_gpu = self.device.type == "cuda"
        _prepare_weights(model, config)
        self.step = None
        if config.resolved_decode_step(self.device.type) == "fast":
            from shoal.engine.decode_step import DecodeStep

            self.step = DecodeStep(
                model, self.kv, self.max_batch, use_kernels=on_gpu,
                max_top_k=config.sample_max_top_k,
            )  # fmt: skip
        # overlap_steps: two decodes may be in flight (one launched before the other is read
        # back), so the pinned inputs and the frames' landing buffer come in pairs.
        copies = 2 if config.overlap_steps else 1
        self.host = HostBatch(self, self.max_batch, copies)
        self.buffers = DecodeBuffers.allocate(
            self.max_batch, self.max_pages, self.window_size, self.num_rows, self.device
        )
        self._host_frames = [
            torch.zeros(self.max_batch, self.num_rows, dtype=torch.int32, pin_memory=on_gpu)
            for _ in range(copies)
        ]
        self._launches = 0
        self.graphs = None
        if on_gpu and config.use_cuda_graphs:
            from shoal.engine.graphs import DecodeGraphs

            if self.step is not None and self.step.fp8 is not None:
                from shoal.quant.engine_fp8 import graph_row_counts

                # FP8 GEMM outputs and workspaces for every captured M, allocated before capture.
                self.step.fp8.reserve(graph_row_counts(config.resolved_graph_buckets()))

            self.graphs = DecodeGraphs(self, config.resolved_graph_buckets())
            self.host.invalidate()

    def params_for(self, requests: list[Request], device=None) -> SamplingBatch:
        p = [r.params for r in requests]
        return SamplingBatch.build(
            self.sampler.rules,
            temperature=[x.temperature for x in p],
            top_p=[x.top_p for x in p],
            top_k=[x.top_k for x in p],
            repetition_penalty=[x.repetition_penalty for x in p],
            seed=[x.seed for x in p],
            device=self.device if device is None else device,
        )

    # Prefill ------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, chunks: list[tuple[Request, int]]) -> tuple[list[Request], Tensor | None]:
        """Run prefill chunks (request, new tokens). Returns the requests whose chunk completes
        their sequence and their next frames, int32 [n, N+1] on the device (not yet synced)."""
        if not chunks:
            return [], None
        tokens, positions, segments, last_rows, completing = [], [], [], [], []
        offset = 0
        for request, count in chunks:
            start = request.num_computed
            tokens.append(request.columns(start, start + count).t())
            positions.append(torch.arange(start, start + count))
            segments.append((offset, count, start + count, request.block_table))
            offset += count
            if start + count == request.seq_len:
                completing.append(request)
                last_rows.append(offset - 1)
        self.kv.set_varlen(segments)
        tokens = _to_device(torch.cat(tokens), self.device)
        positions = _to_device(torch.cat(positions), self.device)
        fused = self.step is not None and self.step.use_kernels and self.kv._prefill_meta is not None
        if fused:
            hidden, normed = self.step.prefill(tokens, positions, self.kv._slots, self.kv._prefill_meta)
        else:
            hidden = self.model.forward_slow(tokens, positions, self.kv)
        if not completing:
            return [], None
        rows = _to_device(torch.tensor(last_rows), self.device)
        hidden = hidden[rows]
        normed = normed[rows] if fused else self.model.norm(hidden)
        window = torch.stack([r.window(self.window_size) for r in completing])
        frame_index = torch.tensor([r.num_frames for r in completing])
        if self.step is not None:
            buffers = DecodeBuffers.allocate(len(completing), 1, self.window_size, self.num_rows, "cpu")
            buffers.window.copy_(window)
            buffers.frame_index.copy_(frame_index)
            params = self.params_for(completing, device="cpu")
            for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
                getattr(buffers, name).copy_(getattr(params, name))
            buffers = DecodeBuffers(
                **{n: _to_device(getattr(buffers, n), self.device) for n in buffers.names}
            )
            self.step.frames_from_hidden(hidden, normed, buffers, capped=False)
            return completing, buffers.frames
        logits, fast_input = self.model.slow_head(hidden)
        params = self.params_for(completing)
        frames = decode_frame(
            self.model,
            self.sampler,
            logits,
            fast_input,
            params,
            window.to(self.device),
            frame_index.to(self.device),
        )
        return completing, frames.to(torch.int32)

    # Decode -------------------------------------------------------------------------------

    def decode_step(self, buffers: DecodeBuffers, capped: bool = True) -> None:
        """One frame for every row of `buffers`, in place: no allocation visible to the
        caller, no host synchronization on the fast path (the body CUDA graphs capture)."""
        if self.step is not None:
            self.step(buffers, capped)
            return
        self.kv.set_decode(buffers.slots, buffers.block_tables, buffers.kv_lens)
        hidden = self.model.forward_slow(buffers.tokens.long(), buffers.positions, self.kv)
        logits, fast_input = self.model.slow_head(hidden)
        frames = decode_frame(
            self.model,
            self.sampler,
            logits,
            fast_input,
            buffers.params(),
            buffers.window,
            buffers.frame_index,
        )
        push_frames(buffers.window, frames, buffers.frame_index)
        buffers.frames.copy_(frames)
        buffers.tokens.copy_(frames)

    def capped(self, requests: list[Request]) -> bool:
        """Whether every row's top_k fits the sampling kernels' candidate bound."""
        bound = self.step.max_top_k if self.step is not None else None
        return bound is None or all(r.params.top_k <= bound for r in requests)

    @property
    def host_frames(self) -> Tensor:
        """The pinned buffer the last launched decode's frames land in."""
        return self._host_frames[(self._launches - 1) % len(self._host_frames)]

    @torch.no_grad()
    def launch_decode(self, requests: list[Request], ahead: int = 0) -> PendingDecode:
        """Queue the next frame of each request; `PendingDecode.result()` gives int32
        [len(requests), N+1] on the host. `ahead` = 1: the frame after the one a decode still
        in flight (same requests, same rows, not yet booked) produces (`HostBatch.fill`)."""
        n = len(requests)
        if n > self.max_batch:
            raise ValueError(f"decode batch {n} exceeds max_running_requests {self.max_batch}")
        fields = self.host.fill(requests, ahead)
        capped = self.capped(requests)
        if self.graphs is not None and capped and self.graphs.can_run(n):
            bucket = self.graphs.bucket_for(n)
            self.host.upload(self.buffers, fields, bucket)
            self.graphs.replay(bucket)
        else:
            self.host.upload(self.buffers, fields, n)
            # Same block-table width as the graphs on a GPU (same attention splits); on the CPU
            # only the pages the batch uses.
            width = (
                self.max_pages if self.device.type == "cuda" else max(len(r.block_table) for r in requests)
            )
            self.decode_step(self.buffers.view(n, width), capped)
        self._launches += 1
        host_frames = self.host_frames
        host_frames[:n].copy_(self.buffers.frames[:n], non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingDecode(n, host_frames, event)

    def decode(self, requests: list[Request]) -> Tensor:
        """The next frame of each request, int32 [len(requests), N+1] on the host."""
        if not requests:
            return torch.zeros(0, self.num_rows, dtype=torch.int32)
        return self.launch_decode(requests).result()


def _prepare_weights(model, config: EngineConfig) -> None:
    """weight_format="fp8": quantize (unless loaded FP8) and verify in place; "bf16": refuse a
    model holding FP8 layers, which the bf16 step cannot multiply."""
    from shoal.quant.engine_fp8 import has_fp8_layers, prepare_model

    if config.weight_format == "fp8":
        prepare_model(model, config.fp8_quantize_activations)
    elif has_fp8_layers(model):
        raise ValueError("the model holds FP8 layers: run it with weight_format='fp8'")


def _to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """Host -> device without a stream sync (through pinned memory on a GPU)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
