"""The model runner: turns a step plan into tensors, runs the model, returns frames.

Prefill chunks run eagerly as one varlen forward; the chunks that reach the end of their
request's sequence sample that request's next frame. Decodes run the whole frame step (slow
model, constrained sampling, fast loop over the codebooks, window update) on static buffers:
on CUDA replayed as a CUDA graph per batch-size bucket (`graphs.py`), elsewhere eagerly. The
frame math is `models/reference.decode_frame`, the oracle's own function, with each row's own
parameters and counter-based randomness, so batching never changes a request's frames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shoal.config import EngineConfig
from shoal.engine.kv_cache import PagedKV
from shoal.engine.request import Request
from shoal.models.reference import decode_frame
from shoal.models.sampling import Sampler, SamplingBatch, push_frames


@dataclass
class DecodeBuffers:
    """Inputs and outputs of a decode step, rows 0..bs-1 live. Graph replays read and write
    these same tensors, so they are only ever filled in place."""

    tokens: Tensor  # int32 [B, N+1]: each row's last frame, the step's input
    positions: Tensor  # int64 [B]
    slots: Tensor  # int64 [B]: flat KV slot of the new key
    block_tables: Tensor  # int32 [B, P]
    kv_lens: Tensor  # int32 [B]
    window: Tensor  # int32 [B, W, N+1]
    frame_index: Tensor  # int64 [B]
    temperature: Tensor  # float32 [B]
    top_p: Tensor  # float32 [B]
    top_k: Tensor  # int64 [B]
    repetition_penalty: Tensor  # float32 [B]
    seed: Tensor  # int64 [B]
    frames: Tensor  # int32 [B, N+1]: the step's output

    @classmethod
    def allocate(cls, batch: int, pages: int, window: int, rows: int, device) -> DecodeBuffers:
        def z(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            z(batch, rows, dtype=torch.int32),
            z(batch, dtype=torch.int64),
            z(batch, dtype=torch.int64),
            z(batch, pages, dtype=torch.int32),
            z(batch, dtype=torch.int32),
            z(batch, window, rows, dtype=torch.int32),
            z(batch, dtype=torch.int64),
            z(batch, dtype=torch.float32),
            z(batch, dtype=torch.float32),
            z(batch, dtype=torch.int64),
            z(batch, dtype=torch.float32),
            z(batch, dtype=torch.int64),
            z(batch, rows, dtype=torch.int32),
        )

    def view(self, batch: int) -> DecodeBuffers:
        return DecodeBuffers(*(getattr(self, f)[:batch] for f in self.__dataclass_fields__))

    def copy_from(self, other: DecodeBuffers) -> None:
        """Fill the first rows from host-built buffers (non-blocking from pinned memory)."""
        for name in self.__dataclass_fields__:
            source = getattr(other, name)
            target = getattr(self, name)
            if name == "block_tables":
                target = target[: source.shape[0], : source.shape[1]]
            else:
                target = target[: source.shape[0]]
            target.copy_(source, non_blocking=True)


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
        self.kv = PagedKV(
            mc.n_layer, num_pages, config.page_size, mc.n_local_heads, mc.head_dim, self.dtype, self.device
        )
        self.graphs = None
        if self.device.type == "cuda" and config.use_cuda_graphs:
            from shoal.engine.graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, config.resolved_graph_buckets())

    # Prefill ------------------------------------------------------------------------------

    def params_for(self, requests: list[Request]) -> SamplingBatch:
        p = [r.params for r in requests]
        return SamplingBatch.build(
            self.sampler.rules,
            temperature=[x.temperature for x in p],
            top_p=[x.top_p for x in p],
            top_k=[x.top_k for x in p],
            repetition_penalty=[x.repetition_penalty for x in p],
            seed=[x.seed for x in p],
            device=self.device,
        )

    @torch.no_grad()
    def prefill(self, chunks: list[tuple[Request, int]]) -> dict[Request, Tensor]:
        """Run prefill chunks (request, new tokens); returns the next frame, int32 [N+1] on
        the host, of each request whose chunk completes its sequence."""
        if not chunks:
            return {}
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
        hidden = self.model.forward_slow(
            torch.cat(tokens).to(self.device), torch.cat(positions).to(self.device), self.kv
        )
        if not completing:
            return {}
        logits, fast_input = self.model.slow_head(hidden[torch.tensor(last_rows, device=self.device)])
        window = torch.stack([r.window(self.window_size) for r in completing]).to(self.device)
        frame_index = torch.tensor([r.num_frames for r in completing], device=self.device)
        frames = decode_frame(
            self.model, self.sampler, logits, fast_input, self.params_for(completing), window, frame_index
        )
        frames = frames.to(torch.int32).cpu()
        return {r: frames[i] for i, r in enumerate(completing)}

    # Decode -------------------------------------------------------------------------------

    def host_buffers(self, requests: list[Request], pages: int | None = None) -> DecodeBuffers:
        """Decode inputs built on the host (pinned when the device is a GPU)."""
        batch = len(requests)
        if pages is None:
            pages = max(len(r.block_table) for r in requests)
        host = DecodeBuffers.allocate(batch, pages, self.window_size, self.num_rows, "cpu")
        host.block_tables.fill_(self.kv.scratch_page)
        params = self.params_for(requests)
        for i, r in enumerate(requests):
            position = r.seq_len - 1
            host.tokens[i] = r.frames[r.num_frames - 1]
            host.positions[i] = position
            host.slots[i] = self.kv.slot_of(r.block_table, position)
            host.block_tables[i, : len(r.block_table)] = torch.tensor(r.block_table, dtype=torch.int32)
            host.kv_lens[i] = r.seq_len
            host.window[i] = r.window(self.window_size)
            host.frame_index[i] = r.num_frames
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
            getattr(host, name).copy_(getattr(params, name))
        if self.device.type == "cuda":
            for name in host.__dataclass_fields__:
                setattr(host, name, getattr(host, name).pin_memory())
        return host

    def decode_step(self, buffers: DecodeBuffers) -> None:
        """One frame for every row of `buffers`, in place: no allocation visible to the
        caller, no host synchronization (the body CUDA graphs capture)."""
        self.kv.set_decode(buffers.slots, buffers.block_tables, buffers.kv_lens)
        hidden = self.model.forward_slow(buffers.tokens.long(), buffers.positions, self.kv)
        logits, fast_input = self.model.slow_head(hidden)
        params = SamplingBatch(
            buffers.temperature, buffers.top_p, buffers.top_k, buffers.repetition_penalty, buffers.seed
        )
        frames = decode_frame(
            self.model, self.sampler, logits, fast_input, params, buffers.window, buffers.frame_index
        )
        push_frames(buffers.window, frames, buffers.frame_index)
        buffers.frames.copy_(frames)
        buffers.tokens.copy_(frames)

    @torch.no_grad()
    def decode(self, requests: list[Request]) -> Tensor:
        """The next frame of each request, int32 [len(requests), N+1] on the host."""
        if not requests:
            return torch.zeros(0, self.num_rows, dtype=torch.int32)
        if self.graphs is not None and self.graphs.can_run(len(requests)):
            host = self.host_buffers(requests, pages=self.max_pages)
            return self.graphs.run(host, len(requests))
        host = self.host_buffers(requests)
        device_buffers = DecodeBuffers(
            *(getattr(host, f).to(self.device, non_blocking=True) for f in host.__dataclass_fields__)
        )
        self.decode_step(device_buffers)
        return device_buffers.frames.cpu()
