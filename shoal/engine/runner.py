"""The model runner: turns a step plan into tensors, runs the model, returns frames.

Prefill chunks run eagerly as one varlen forward, or (`prefill_graphs`) on `PrefillBatch`'s static
buffers replayed as a CUDA graph; the chunks that complete their request's sequence sample its
first frame (`DecodeStep.frames_from_hidden`), on `FirstFrameBatch`'s static buffers replayed per
bucket where the decode graphs are captured. Decodes run the whole frame step on the static
`DecodeBuffers`: `DecodeStep` (`decode_step="fast"`, the default on CUDA) replayed per batch
bucket, or `models/reference.decode_frame` (the oracle's own code, the default elsewhere). Each row
has its own parameters and counter-based randomness, so batching never changes a request's frames.

A decode is split in `launch_decode` (host fill, non-blocking copies, replay, non-blocking copy of
the frames into pinned memory, an event) and `PendingDecode.result` (wait for the event), so the
caller can prepare other work while the GPU runs; with `overlap_steps` the next decode of the same
rows can be launched (`ahead=1`) before that wait.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from shoal.config import EngineConfig
from shoal.engine.batch import DecodeBuffers, HostBatch
from shoal.engine.kv_cache import PagedKV, kv_storage_dtype
from shoal.engine.prefill_batch import Chunk, PrefillBatch
from shoal.engine.request import Request
from shoal.models.reference import decode_frame
from shoal.models.sampling import Sampler, SamplingBatch, push_frames

__all__ = ["DecodeBuffers", "FirstFrameBatch", "ModelRunner", "PendingDecode"]

# The per-row inputs `DecodeStep.frames_from_hidden` reads besides the hidden states.
FIRST_FRAME_FIELDS = ("window", "frame_index", "temperature", "top_p", "top_k", "repetition_penalty", "seed")


@dataclass
class PendingDecode:
    """A launched decode: `rows` live rows whose frames land in `host_frames` [rows, N+1], or
    with `ring_slots` in the step's frame ring (`ModelRunner.advance_on_device`): row i's frame
    at `host_frames[ring_slots[i], i]`."""

    rows: int
    host_frames: Tensor
    event: torch.cuda.Event | None
    ring_slots: np.ndarray | None = None

    def result(self) -> Tensor:
        if self.event is not None:
            self.event.synchronize()
        if self.ring_slots is not None:
            return self.host_frames[torch.from_numpy(self.ring_slots), torch.arange(self.rows)]  # a copy
        return self.host_frames[: self.rows].clone()


class FirstFrameBatch:
    """Static inputs and outputs of the first frames of requests that complete their prefill:
    slow hidden states (`hidden` before, `normed` after the final norm), a `DecodeBuffers` of
    the per-row fields (`FIRST_FRAME_FIELDS`; `frames` is the output) and one pinned host
    staging copy of those fields. `FirstFrameGraphs` captures `compute` per bucket; without
    graphs `compute` runs eagerly on the same buffers, so the CPU tests exercise the same fill.

    Separate from the decode step's `DecodeBuffers`: a prefill's completing rows are not the
    decode batch's rows. The fast transformer's per-row cache (`DecodeStep.fast_k/fast_v`) is
    shared with the decode step; both run on one stream, one after the other, and every frame
    writes a row's fast positions before reading them, so nothing carries over.

    Rows [:n] of a bucket are the requests; rows n.. are padding: zero hidden states, frame
    index 0 (no RAS, no penalty), temperature, top_p and penalty 1, top_k 1, seed 0, empty
    window. Every op of the first-frame step is row-wise (GEMMs, per-token quantization, the
    sampling kernels, a fast-cache page per row), so a padding row cannot touch a live row,
    and its indices stay in range (code 0 is clamped, sampled ids are columns of the heads)."""

    def __init__(self, runner: ModelRunner, buckets: tuple[int, ...]) -> None:
        self.runner = runner
        self.buckets = tuple(sorted(buckets))
        self.max_batch = self.buckets[-1]
        device, rows = runner.device, self.max_batch
        pin = device.type == "cuda"
        # hidden and normed in one tensor: their padding rows are zeroed by one launch.
        self.states = torch.zeros(2, rows, runner.model.config.dim, dtype=runner.dtype, device=device)
        self.hidden, self.normed = self.states[0], self.states[1]
        self.buffers = DecodeBuffers.allocate(rows, 1, runner.window_size, runner.num_rows, device)
        self.rows = torch.zeros(rows, dtype=torch.int64, device=device)  # rows of the prefill output
        self.host = DecodeBuffers.allocate(rows, 1, runner.window_size, runner.num_rows, "cpu", pin=pin)
        self.host_rows = torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
        self.np = {name: getattr(self.host, name).numpy() for name in FIRST_FRAME_FIELDS}
        self.live = 0  # rows holding a request's data (host staging and states); the rest is padding
        # Recorded after each fill's copies out of the staging (a GPU only).
        self._uploaded = torch.cuda.Event() if pin else None
        self.reset()

    def bucket_for(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def _pad(self, start: int, end: int) -> None:
        a = self.np
        for name in ("window", "frame_index", "seed"):
            a[name][start:end] = 0
        for name in ("temperature", "top_p", "repetition_penalty"):
            a[name][start:end] = 1.0
        a["top_k"][start:end] = 1

    def reset(self) -> None:
        """Every row padding, on the host and the device (before and after graph capture)."""
        self._pad(0, self.max_batch)
        for name in FIRST_FRAME_FIELDS:
            getattr(self.buffers, name).copy_(getattr(self.host, name))
        self.states.zero_()
        self.buffers.frames.zero_()
        self.live = 0

    def fill(
        self, requests: list[Request], hidden: Tensor, normed: Tensor | None, last_rows: list[int]
    ) -> int:
        """Rows [:n] from `requests` and rows `last_rows` of the prefill's `hidden` / `normed`
        ([T, dim]; `normed` None: the model's final norm of `hidden`), padding up to the
        bucket; returns the bucket. Copies are non-blocking, through the pinned staging."""
        n = len(requests)
        bucket = self.bucket_for(n)
        if self._uploaded is not None:
            # The previous fill's non-blocking copies read the staging. Done long ago in the
            # engine (its frames were read back since), so this does not wait there; an
            # event never recorded returns at once.
            self._uploaded.synchronize()
        a, width = self.np, self.runner.window_size
        if n < self.live:
            self._pad(n, self.live)
            self.states[:, n : self.live].zero_()
        self.live = n
        for i, r in enumerate(requests):
            a["frame_index"][i] = r.num_frames
            a["window"][i] = r.window(width).numpy()
        params = self.runner.params_for(requests, device="cpu")
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
            a[name][:n] = getattr(params, name).numpy()
        self.host_rows.numpy()[:n] = np.asarray(last_rows, dtype=np.int64)
        for name in FIRST_FRAME_FIELDS:
            getattr(self.buffers, name)[:bucket].copy_(getattr(self.host, name)[:bucket], non_blocking=True)
        rows = self.rows[:n]
        rows.copy_(self.host_rows[:n], non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        torch.index_select(hidden, 0, rows, out=self.hidden[:n])
        if normed is None:
            self.normed[:n].copy_(self.runner.model.norm(self.hidden[:n]))
        else:
            torch.index_select(normed, 0, rows, out=self.normed[:n])
        return bucket

    def compute(self, bucket: int) -> None:
        """The first frames of the bucket's rows into `buffers.frames` (what the graphs capture).
        Capped sampling (the eager path sorts whole rows): only rows whose top_k fits the bound
        come here (`ModelRunner.uses_first_frame_batch`), and for those `kernels/sample.py`
        extracts every candidate the draw can take, so the tokens are the same."""
        view = self.buffers.view(bucket)
        self.runner.step.frames_from_hidden(self.hidden[:bucket], self.normed[:bucket], view, capped=True)


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
            mc.n_layer, num_pages, config.page_size, mc.n_local_heads, mc.head_dim, self.dtype, self.device,
            kv_dtype=kv_storage_dtype(config, self.dtype),
        )  # fmt: skip
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
        self.last_upload: tuple[str, ...] = ()  # what the last decode launch sent (`HostBatch.upload`)
        # The kernel step's frame ring (`advance_on_device`); None: frames come back by a copy.
        self.frame_ring: Tensor | None = None
        if config.advance_on_device and self.step is not None and self.step.use_kernels:
            self.advance_on_device()  # before the graphs capture the step
        graphs = on_gpu and config.use_cuda_graphs
        self.first_frame: FirstFrameBatch | None = None
        if self.step is not None and _static_buffers(config.first_frame_graphs, graphs):
            self.first_frame = FirstFrameBatch(self, config.resolved_graph_buckets())
        self.graphs = None
        self.first_frame_graphs = None
        static_prefill = (
            self.step is not None and self.step.use_kernels and _static_buffers(config.prefill_graphs, graphs)
        )
        # Prefill graphs replay on a stream of their own, beside the step's decode graph: the
        # decode leaves SMs idle (latency chains) that the compute-bound prefill fills
        # (`begin_step`, `_prefill_static`; docs/engine.md).
        self.prefill_stream = None
        overlap = graphs and static_prefill and config.overlap_prefill
        if overlap:
            self.prefill_stream = torch.cuda.Stream(self.device)
            self._main_ready = torch.cuda.Event()  # main stream: where this step's prefill may start
            self._prefill_done = torch.cuda.Event()  # prefill stream: the last prefill's end
            self._ready_marked = False  # `_main_ready` recorded: the step's prefill goes beside its decode
            self._prefill_unwaited = False  # the main stream has not waited for `_prefill_done`
        if graphs:
            from shoal.engine.graphs import DecodeGraphs, FirstFrameGraphs

            if self.step is not None and self.step.fp8 is not None:
                from shoal.engine.fp8_weights import graph_row_counts

                # FP8 GEMM outputs and workspaces for every captured M (the prefill buckets'
                # token counts too), allocated once, before any capture; beside the decode, the
                # prefill runs projections with buffers and a workspace of their own.
                rows = graph_row_counts(config.resolved_graph_buckets())
                buckets = set(config.prefill_graph_buckets) if static_prefill else set()
                if overlap:
                    self.step.prefill_fp8 = self.step.fp8.sibling()
                    self.step.prefill_fp8.reserve(buckets)
                    buckets = set()
                self.step.fp8.reserve(rows | buckets)

            self.graphs = DecodeGraphs(self, config.resolved_graph_buckets())
            self.host.invalidate()
            if self.first_frame is not None:
                # Same buckets, so the same FP8 row counts (reserved above); the decode graphs' pool.
                self.first_frame_graphs = FirstFrameGraphs(self.first_frame, self.graphs.pool)
        self.prefill_batch: PrefillBatch | None = None
        self.prefill_graphs = None
        if static_prefill:
            self.prefill_batch = PrefillBatch(
                self.step, config.prefill_graph_buckets, self.num_rows, self.max_pages,
                config.prefill_graph_segments,
            )  # fmt: skip
            if graphs:
                from shoal.engine.graphs import PrefillGraphs

                # Captured on a stream of its own when it replays beside the decode: torch gives
                # cuBLAS a workspace per stream, and graphs keep the capture's.
                capture_stream = torch.cuda.Stream(self.device) if overlap else None
                self.prefill_graphs = PrefillGraphs(self.prefill_batch, capture_stream)

    def params_for(self, requests: list[Request], device=None) -> SamplingBatch:
        p = [r.params for r in requests]
        return SamplingBatch.build(
            self.sampler.rules, temperature=[x.temperature for x in p], top_p=[x.top_p for x in p],
            top_k=[x.top_k for x in p], repetition_penalty=[x.repetition_penalty for x in p],
            seed=[x.seed for x in p], device=self.device if device is None else device,
        )  # fmt: skip

    # Prefill ------------------------------------------------------------------------------

    @torch.no_grad()
    def prefill(self, chunks: list[tuple[Request, int]]) -> tuple[list[Request], Tensor | None]:
        """Run prefill chunks (request, new tokens). Returns the requests whose chunk completes
        their sequence and their next frames, int32 [n, N+1] on the device (not yet synced)."""
        if not chunks:
            return [], None
        packed: list[Chunk] = []
        last_rows, completing = [], []
        offset = 0
        for request, count in chunks:
            start = request.num_computed
            packed.append((request.columns(start, start + count).t(), start, request.block_table))
            offset += count
            if start + count == request.seq_len:
                completing.append(request)
                last_rows.append(offset - 1)
        if self.uses_prefill_batch(chunks):
            hidden, normed = self._prefill_static(packed)
        else:
            hidden, normed = self._prefill_eager(packed)
        if self.prefill_stream is not None:
            self._ready_marked = False  # the mark is this step's: a later prefill needs its own
        if not completing:
            return [], None
        return completing, self._first_frames_after_prefill(completing, hidden, normed, last_rows)

    def begin_step(self, prefills: bool = True, decodes: bool = True) -> None:
        """Before a step's launches: the main stream waits (on the GPU) for the previous prefill
        if nothing has yet, and, when the step has both `prefills` and `decodes`, marks where its
        prefill may start, beside the decode enqueued next. The prefill stream therefore never
        runs ahead of main-stream work enqueued before it (the writers of pages it reuses) nor
        behind the next step (which waits for it). A step without a decode to overlap keeps its
        prefill on the main stream (no stream hop before a lone request's first frame), and a
        pure decode step with nothing to wait for adds no stream op."""
        if self.prefill_stream is None:
            return
        main = torch.cuda.current_stream(self.device)
        self._wait_for_prefill(main)
        self._ready_marked = prefills and decodes
        if self._ready_marked:
            self._main_ready.record(main)

    def _wait_for_prefill(self, main: torch.cuda.Stream) -> None:
        if self._prefill_unwaited:
            main.wait_event(self._prefill_done)
            self._prefill_unwaited = False

    def uses_prefill_batch(self, chunks: list[tuple[Request, int]]) -> bool:
        """Whether these chunks take the static prefill (`PrefillBatch`, a graph replay on CUDA):
        it exists (a kernel step), and they are at most its segment count of chunks
        (`EngineConfig.prefill_graph_segments`) that fit its largest bucket together."""
        batch = self.prefill_batch
        return batch is not None and batch.takes([count for _, count in chunks])

    def _prefill_eager(self, packed: list[Chunk]) -> tuple[Tensor, Tensor | None]:
        """One varlen forward of the chunks; (hidden, normed), normed None off the fused kernels."""
        segments, offset = [], 0
        for columns, start, pages in packed:
            count = columns.shape[0]
            segments.append((offset, count, start + count, pages))
            offset += count
        self.kv.set_varlen(segments)
        tokens = _to_device(torch.cat([columns for columns, _, _ in packed]), self.device)
        positions = torch.cat([torch.arange(start, start + c.shape[0]) for c, start, _ in packed])
        positions = _to_device(positions, self.device)
        if self.step is not None and self.step.use_kernels and self.kv._prefill_meta is not None:
            return self.step.prefill(tokens, positions, self.kv._slots, self.kv._prefill_meta)
        return self.model.forward_slow(tokens, positions, self.kv), None

    def _prefill_static(self, packed: list[Chunk]) -> tuple[Tensor, Tensor]:
        """The chunks through `PrefillBatch`: fill, replay their bucket (or run it eagerly); on
        the prefill stream where there is one (its outputs are read after `_prefill_done`)."""
        batch = self.prefill_batch
        side = self.prefill_stream
        if side is None or not self._ready_marked:  # no decode of this step to go beside
            self._run_prefill_batch(packed)
            return batch.hidden, batch.normed
        side.wait_event(self._main_ready)
        with torch.cuda.stream(side):
            self._run_prefill_batch(packed)
            self._prefill_done.record(side)
        self._prefill_unwaited = True
        return batch.hidden, batch.normed

    def _run_prefill_batch(self, packed: list[Chunk]) -> None:
        """Fill the static prefill batch and replay its bucket's graph (eagerly without graphs)."""
        bucket = self.prefill_batch.fill_chunks(packed)
        if self.prefill_graphs is not None:
            self.prefill_graphs.replay(bucket)
        else:
            self.prefill_batch.compute(bucket)

    def _first_frames_after_prefill(
        self, completing: list[Request], hidden: Tensor, normed: Tensor | None, last_rows: list[int]
    ) -> Tensor:
        """The first frames of the requests whose prefill completed, from rows `last_rows` of the
        prefill's outputs (`normed` None: the model's final norm of `hidden`)."""
        if self.prefill_stream is not None:  # the outputs come from the prefill stream
            self._wait_for_prefill(torch.cuda.current_stream(self.device))
        if self.uses_first_frame_batch(completing):  # static buffers, a graph replay on CUDA
            return self.first_frames(completing, hidden, normed, last_rows)
        rows = _to_device(torch.tensor(last_rows), self.device)
        hidden = hidden[rows]
        normed = normed[rows] if normed is not None else self.model.norm(hidden)
        if self.step is not None:
            buffers = self.fresh_first_frame_buffers(completing)
            self.step.frames_from_hidden(hidden, normed, buffers, capped=False)
            return buffers.frames
        window = torch.stack([r.window(self.window_size) for r in completing])
        frame_index = torch.tensor([r.num_frames for r in completing])
        logits, fast_input = self.model.slow_head(hidden)
        params = self.params_for(completing)
        frames = decode_frame(
            self.model, self.sampler, logits, fast_input, params, window.to(self.device),
            frame_index.to(self.device),
        )  # fmt: skip
        return frames.to(torch.int32)

    def fresh_first_frame_buffers(self, requests: list[Request]) -> DecodeBuffers:
        """Device buffers of exactly these rows for `DecodeStep.frames_from_hidden`: window,
        frame index and sampling fields filled (the first frame outside `FirstFrameBatch`)."""
        buffers = DecodeBuffers.allocate(len(requests), 1, self.window_size, self.num_rows, "cpu")
        buffers.window.copy_(torch.stack([r.window(self.window_size) for r in requests]))
        buffers.frame_index.copy_(torch.tensor([r.num_frames for r in requests]))
        params = self.params_for(requests, device="cpu")
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
            getattr(buffers, name).copy_(getattr(params, name))
        return DecodeBuffers(**{n: _to_device(getattr(buffers, n), self.device) for n in buffers.names})

    def uses_first_frame_batch(self, requests: list[Request]) -> bool:
        """Whether these completing rows take the static first-frame path (`FirstFrameBatch`):
        it exists, they fit its largest bucket, and their top_k fits the sampling bound."""
        batch = self.first_frame
        return batch is not None and len(requests) <= batch.max_batch and self.capped(requests)

    def first_frames(
        self, requests: list[Request], hidden: Tensor, normed: Tensor | None, last_rows: list[int]
    ) -> Tensor:
        """First frames of `requests` from rows `last_rows` of the prefill's hidden states:
        fill the static batch, replay its bucket's graph (or run it eagerly without graphs).
        Returns int32 [n, N+1], a copy: the static output is overwritten by the next call, and
        on the CPU the caller's `.cpu()` would not copy it (a delivered frame would change)."""
        batch = self.first_frame
        bucket = batch.fill(requests, hidden, normed, last_rows)
        if self.first_frame_graphs is not None:
            self.first_frame_graphs.replay(bucket)
        else:
            batch.compute(bucket)
        return batch.buffers.frames[: len(requests)].clone()

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
            self.model, self.sampler, logits, fast_input, buffers.params(), buffers.window,
            buffers.frame_index,
        )  # fmt: skip
        push_frames(buffers.window, frames, buffers.frame_index)
        buffers.frames.copy_(frames)
        buffers.tokens.copy_(frames)

    def advance_on_device(self, ring_slots: int = 4) -> None:
        """Let the kernel step's last kernel advance the step's metadata and write its frames into
        a pinned host ring of `ring_slots` frames per row (`kernels.window.StepAdvance`): the host
        then uploads metadata only when the rows or a block table change, and copies no frames
        back. A row's frame of index f lands in slot f % ring_slots; with at most one step in
        flight beyond the one being read (`overlap_steps`), 2 would do."""
        if self.step is None or not self.step.use_kernels:
            raise ValueError("advancing the step on the device needs the kernel decode step")
        on_gpu = self.device.type == "cuda"
        self.frame_ring = torch.zeros(
            ring_slots, self.max_batch, self.num_rows, dtype=torch.int32, pin_memory=on_gpu
        )
        self.step.advance_ring = self.frame_ring
        self.host.device_advances = True
        self.host.invalidate()

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
        ring = self.frame_ring
        ring_slots = None if ring is None else self.host.np["frame_index"][:n] % ring.shape[0]
        capped = self.capped(requests)
        if self.graphs is not None and capped and self.graphs.can_run(n):
            bucket = self.graphs.bucket_for(n)
            self.last_upload = self.host.upload(self.buffers, fields, bucket)
            self.graphs.replay(bucket)
        else:
            self.last_upload = self.host.upload(self.buffers, fields, n)
            # Same block-table width as the graphs on a GPU (same attention splits); on the CPU
            # only the pages the batch uses.
            width = (
                self.max_pages if self.device.type == "cuda" else max(len(r.block_table) for r in requests)
            )
            self.decode_step(self.buffers.view(n, width), capped)
        self._launches += 1
        if ring is None:
            host_frames = self.host_frames
            host_frames[:n].copy_(self.buffers.frames[:n], non_blocking=True)
        else:  # the step's last kernel wrote the frames there
            host_frames = ring
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingDecode(n, host_frames, event, ring_slots)

    def decode(self, requests: list[Request]) -> Tensor:
        """The next frame of each request, int32 [len(requests), N+1] on the host."""
        if not requests:
            return torch.zeros(0, self.num_rows, dtype=torch.int32)
        return self.launch_decode(requests).result()


def _prepare_weights(model, config: EngineConfig) -> None:
    """weight_format="fp8": quantize (unless loaded FP8) and verify in place, and with
    `fp8_fast_head` round the fast head (`quant/fp8_head.py`); "bf16": refuse a model holding FP8
    layers, which the bf16 step cannot multiply."""
    from shoal.engine.fp8_weights import has_fp8_layers, prepare_model
    from shoal.quant.fp8_head import round_fast_head_

    if config.weight_format == "fp8":
        prepare_model(model, config.fp8_quantize_activations)
        if config.fp8_fast_head:
            round_fast_head_(model)
    elif has_fp8_layers(model):
        raise ValueError("the model holds FP8 layers: run it with weight_format='fp8'")


def _static_buffers(setting: bool | None, graphs: bool) -> bool:
    """A static-buffer path's config setting (`first_frame_graphs`, `prefill_graphs`): True always
    (eagerly without graphs), None wherever the decode graphs are captured, False never."""
    return bool(setting) or (graphs and setting is None)


def _to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """Host -> device without a stream sync (through pinned memory on a GPU)."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
