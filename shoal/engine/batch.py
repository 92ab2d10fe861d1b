"""Decode-step inputs: the static buffers a step (or its CUDA graph) reads and writes, and the
host side that fills them.

`DecodeBuffers` rows 0..bs-1 are live; the rest is padding pointed at the KV cache's scratch
page. `HostBatch` keeps a pinned host copy of every buffer and fills it with numpy. When a step
runs the same requests in the same rows as the previous one, the device already holds their
tokens and window (the step writes them in place), so only the per-step metadata travels: the
four per-row scalars in one copy, the block tables only when a row gained a page (each copy is a
few µs of GPU time between two steps' graphs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from shoal.engine.request import Request
from shoal.models.sampling import SamplingBatch

METADATA = ("positions", "slots", "block_tables", "kv_lens", "frame_index")
SCALARS = ("positions", "slots", "frame_index", "kv_lens")  # views into `DecodeBuffers.scalars`
PER_REQUEST = ("tokens", "window", "temperature", "top_p", "top_k", "repetition_penalty", "seed")


@dataclass
class DecodeBuffers:
    """Inputs and outputs of a decode step. Graph replays read and write these same tensors,
    so they are only ever filled in place."""

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
    # The storage of the `SCALARS` fields (int64 [4B]; kv_lens in the low half of the last B) in
    # buffers made by `allocate`, None in views.
    scalars: Tensor | None = field(default=None, repr=False)

    @classmethod
    def allocate(
        cls, batch: int, pages: int, window: int, rows: int, device, pin: bool = False
    ) -> DecodeBuffers:
        def z(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device, pin_memory=pin)

        i32, i64, f32 = torch.int32, torch.int64, torch.float32
        scalars = z(4 * batch, dtype=i64)
        positions, slots, frame_index, wide_lens = scalars.view(4, batch)
        kv_lens = wide_lens.view(i32)[:batch]
        return cls(
            z(batch, rows, dtype=i32), positions, slots, z(batch, pages, dtype=i32), kv_lens,
            z(batch, window, rows, dtype=i32), frame_index, z(batch, dtype=f32), z(batch, dtype=f32),
            z(batch, dtype=i64), z(batch, dtype=f32), z(batch, dtype=i64), z(batch, rows, dtype=i32), scalars,
        )  # fmt: skip

    @property
    def names(self) -> tuple[str, ...]:
        """The step's tensors (not the `scalars` storage behind four of them)."""
        return tuple(name for name in self.__dataclass_fields__ if name != "scalars")

    def view(self, batch: int, pages: int | None = None) -> DecodeBuffers:
        views = {name: getattr(self, name)[:batch] for name in self.names}
        if pages is not None:
            views["block_tables"] = views["block_tables"][:, :pages]
        return DecodeBuffers(**views)

    def params(self) -> SamplingBatch:
        return SamplingBatch(self.temperature, self.top_p, self.top_k, self.repetition_penalty, self.seed)


@dataclass
class _HostCopy:
    """One set of host buffers, its numpy views and how many of its rows were live at its
    last fill (the rows after that are padding)."""

    buffers: DecodeBuffers
    arrays: dict
    live: int = 0


class HostBatch:
    """Fills host buffers (pinned on a GPU) for a list of decoding requests.

    `copies` sets of buffers are used in turn, one per fill. One is enough when every step is
    read back before the next is filled; the overlapped schedule (`overlap_steps`) fills step
    n+1 while step n's non-blocking uploads may still be pending, so it uses two (the fill
    after that one comes after step n was waited for)."""

    def __init__(self, runner, max_batch: int, copies: int = 1) -> None:
        self.runner = runner
        self.max_batch = max_batch
        pin = runner.device.type == "cuda"
        self.copies: list[_HostCopy] = []
        for _ in range(copies):
            host = DecodeBuffers.allocate(
                max_batch, runner.max_pages, runner.window_size, runner.num_rows, "cpu", pin=pin
            )
            self.copies.append(_HostCopy(host, {name: getattr(host, name).numpy() for name in host.names}))
        self.current = 0  # the copy of the last fill (the one `upload` sends)
        self.rows: list[Request] = []  # requests of the last fill, in row order
        self.device_current = False  # the device buffers hold the last fill's per-request fields
        # Each step advances the metadata on the device (`ModelRunner.advance_on_device`): an
        # upload of the same rows with the same block tables sends no scalars.
        self.device_advances = False
        # What the device's block tables hold in rows [0, device_table_rows) (uploads skip equal ones).
        self.device_tables = np.zeros((max_batch, runner.max_pages), dtype=np.int32)
        self.device_table_rows = 0
        self.reset()

    @property
    def host(self) -> DecodeBuffers:
        return self.copies[self.current].buffers

    @property
    def np(self) -> dict:
        return self.copies[self.current].arrays

    def reset(self) -> None:
        """Every row of every copy padding, no rows on the device (graph capture)."""
        for index in range(len(self.copies)):
            self.current = index
            self._pad(0, self.max_batch)
            self.copies[index].live = 0
        self.current = 0
        self.rows = []
        self.device_current = False

    def _pad(self, start: int, end: int) -> None:
        """Rows [start, end) of the current copy harmless padding: the scratch page, one key,
        top_k 1."""
        if start >= end:
            return
        a, kv = self.np, self.runner.kv
        for name in ("tokens", "positions", "window", "frame_index", "seed", "frames"):
            a[name][start:end] = 0
        a["slots"][start:end] = kv.scratch_page * kv.page_size
        a["block_tables"][start:end] = kv.scratch_page
        a["kv_lens"][start:end] = 1
        for name in ("temperature", "top_p", "repetition_penalty"):
            a[name][start:end] = 1.0
        a["top_k"][start:end] = 1

    def holds(self, requests: list[Request]) -> bool:
        """Whether the device buffers hold `requests`' rows (in this order) from the last fill,
        their tokens and window written in place by the steps since."""
        return (
            self.device_current
            and len(self.rows) == len(requests)
            and all(x is y for x, y in zip(self.rows, requests, strict=True))
        )

    def fill(self, requests: list[Request], ahead: int = 0) -> tuple[str, ...]:
        """Write `requests`' step inputs into rows 0..n-1 of the next copy (padding after
        them); returns the fields that changed and must reach the device.

        `ahead` = 1: the step after the one in flight for the same rows, whose frames are not
        booked yet (each request one frame further than its `num_frames` says); only possible
        when the device holds the rows (the step in flight writes their tokens and window)."""
        same = self.holds(requests)
        if ahead and not same:
            raise RuntimeError("a step ahead needs the rows of the step in flight on the device")
        self.current = (self.current + 1) % len(self.copies)
        copy = self.copies[self.current]
        a, n = copy.arrays, len(requests)
        if n < copy.live:
            self._pad(n, copy.live)
        copy.live = n
        seq = np.fromiter((r.seq_len for r in requests), dtype=np.int64, count=n) + ahead
        a["positions"][:n] = seq - 1
        a["kv_lens"][:n] = seq
        a["frame_index"][:n] = np.fromiter((r.num_frames for r in requests), dtype=np.int64, count=n) + ahead
        tables = a["block_tables"]
        page = self.runner.kv.page_size
        for i, r in enumerate(requests):
            table = r.block_table
            last = int(seq[i]) - 1
            tables[i, : len(table)] = table
            tables[i, len(table) :] = self.runner.kv.scratch_page
            a["slots"][i] = table[last // page] * page + last % page
        if same:
            return METADATA
        width = self.runner.window_size
        for i, r in enumerate(requests):
            frames = r.frames.numpy()
            a["tokens"][i] = frames[r.num_frames - 1]
            count = min(width, max(0, r.num_frames - 1))
            a["window"][i, : width - count] = 0
            if count:
                a["window"][i, width - count :] = frames[r.num_frames - count : r.num_frames]
        params = self.runner.params_for(requests, device="cpu")
        for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed"):
            a[name][:n] = getattr(params, name).numpy()
        self.rows = list(requests)
        return METADATA + PER_REQUEST

    def invalidate(self) -> None:
        """The device buffers were overwritten (graph capture, a fallback step): resend all."""
        self.device_current = False
        self.device_table_rows = 0

    def upload(self, device: DecodeBuffers, fields: tuple[str, ...], rows: int) -> tuple[str, ...]:
        """Copy rows [0, rows) of `fields` from the copy of the last fill to the device buffers
        (non-blocking from pinned): the four scalars in one copy (every row: a few KB), the block
        tables only where they differ from what the device holds. Returns what was sent, in
        order ("scalars" for the one copy of the four)."""
        pending = list(fields)
        host = self.host
        if "block_tables" in pending:
            tables = self.np["block_tables"][:rows]
            if rows <= self.device_table_rows and np.array_equal(tables, self.device_tables[:rows]):
                pending.remove("block_tables")
            else:
                self.device_tables[:rows] = tables
                self.device_table_rows = max(self.device_table_rows, rows)
        if self.device_advances and fields == METADATA and "block_tables" not in pending:
            # The same rows (`fill`'s `same`), each advanced by the step before on the device, with
            # the block tables it looked the slots up in: the device holds this fill's scalars.
            pending = [name for name in pending if name not in SCALARS]
        sent = []
        if device.scalars is not None and host.scalars is not None and set(SCALARS) <= set(pending):
            device.scalars.copy_(host.scalars, non_blocking=True)
            pending = [name for name in pending if name not in SCALARS]
            sent.append("scalars")
        for name in pending:
            getattr(device, name)[:rows].copy_(getattr(host, name)[:rows], non_blocking=True)
        self.device_current = True
        return (*sent, *pending)
