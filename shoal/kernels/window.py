"""The previous-frames window shift: one launch, in place, CUDA-graph safe.

Contract (docs/contracts.md): window int32 `[bs, W, N+1]` (oldest frame first), next frames int32
`[bs, N+1]`; after the call `window[:, :-1]` holds the old `window[:, 1:]` and `window[:, -1]` the
new frames. Each program owns one batch row and reads its whole [W, N+1] tile into registers
before writing, so the overlapping in-place move is safe. `frame_index` (optional) keeps the
window of rows at frame 0 unchanged, as `models.sampling.push_frames` does. `tokens` (optional)
also gets the new frames (the next step's input) instead of a separate `copy_` kernel that would
break the step's PDL chain.

`advance` (optional, a `StepAdvance`): as the decode step's last kernel, it also makes the step's
metadata the next step's for every row with a frame index >= 1 (padding rows have 0): position,
KV length and frame index one up, the KV slot looked up in the row's block table (a row whose next
position is past the table's width keeps its metadata), and stores the new frame into
`ring[frame_index % R, row]`, pinned host memory the GPU writes directly. Steady decoding then
needs no copy between two steps' graphs. Every other kernel of the step has finished when this
one passes its wait, so none reads the metadata after it changes (kernels/pdl.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.pdl import pdl_launch, wait_for_inputs


@dataclass(frozen=True)
class StepAdvance:
    """The decode step's metadata the window kernel advances in place (module docstring), and the
    host ring its frames go to: int32 [R, >= bs, N+1], pinned (the GPU stores into it)."""

    positions: Tensor  # int64 [bs]
    kv_lens: Tensor  # int32 [bs]
    slots: Tensor  # int64 [bs]
    block_tables: Tensor  # int32 [bs, P]
    page_size: int
    ring: Tensor


@triton.jit
def _advance_row(
    row, frame_index, frames, c, columns, positions_ptr, kv_lens_ptr, slots_ptr, frame_index_ptr,
    tables_ptr, stride_bt, table_width, ring_ptr, ring_slots, stride_rr, stride_rb, PAGE: tl.constexpr,
):  # fmt: skip
    """The next step's metadata for a live row (frame index >= 1) and its frame into the ring. A
    row whose next position lies past its block table keeps its metadata (the engine never runs
    one there; a step replayed on fixed inputs must not walk its keys off the table)."""
    if frame_index >= 1:
        position = tl.load(positions_ptr + row) + 1
        at = position // PAGE
        if at < table_width:
            tl.store(positions_ptr + row, position)
            tl.store(kv_lens_ptr + row, tl.load(kv_lens_ptr + row) + 1)
            tl.store(frame_index_ptr + row, frame_index + 1)
            page = tl.load(tables_ptr + row * stride_bt + at).to(tl.int64)
            tl.store(slots_ptr + row, page * PAGE + position % PAGE)
        ring = ring_ptr + (frame_index % ring_slots) * stride_rr + row * stride_rb
        tl.store(ring + c, frames, mask=c < columns)


@triton.jit
def _window_shift_kernel(
    window_ptr, frames_ptr, frame_index_ptr, tokens_ptr, width, columns,
    stride_wb, stride_ww, stride_fb, stride_tb,
    positions_ptr, kv_lens_ptr, slots_ptr, tables_ptr, stride_bt, table_width, ring_ptr, ring_slots,
    stride_rr, stride_rb,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, HAS_FRAME_INDEX: tl.constexpr,
    HAS_TOKENS: tl.constexpr, ADVANCE: tl.constexpr, PAGE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    fresh = tl.load(frames_ptr + row * stride_fb + c, mask=c < columns, other=0)
    if HAS_TOKENS:
        tl.store(tokens_ptr + row * stride_tb + c, fresh, mask=c < columns)
    push = True
    if HAS_FRAME_INDEX:
        frame_index = tl.load(frame_index_ptr + row)
        push = frame_index >= 1
        if ADVANCE:
            _advance_row(
                row, frame_index, fresh, c, columns, positions_ptr, kv_lens_ptr, slots_ptr, frame_index_ptr,
                tables_ptr, stride_bt, table_width, ring_ptr, ring_slots, stride_rr, stride_rb, PAGE,
            )  # fmt: skip
    if push:
        w = tl.arange(0, BLOCK_W)
        base = window_ptr + row * stride_wb
        # Row w of the new window is row w+1 of the old one; the last row is the new frame.
        from_window = (w[:, None] + 1 < width) & (c[None, :] < columns)
        shifted = tl.load(base + (w[:, None] + 1) * stride_ww + c[None, :], mask=from_window, other=0)
        tile = tl.where(w[:, None] == width - 1, fresh[None, :], shifted)
        tl.debug_barrier()
        keep = (w[:, None] < width) & (c[None, :] < columns)
        tl.store(base + w[:, None] * stride_ww + c[None, :], tile, mask=keep)


def window_shift(
    window: Tensor, frames: Tensor, frame_index: Tensor | None = None, tokens: Tensor | None = None,
    advance: StepAdvance | None = None,
) -> None:  # fmt: skip
    """Shift `frames` [bs, N+1] into `window` [bs, W, N+1] in place, copy them into `tokens` if
    given, and with `advance` (which needs `frame_index`) advance the step's metadata (see the
    module docstring)."""
    bs, width, columns = window.shape
    if frames.shape != (bs, columns) or frames.dtype != window.dtype:
        raise ValueError(
            f"frames must be {window.dtype} [{bs}, {columns}], got {frames.dtype} {tuple(frames.shape)}"
        )
    if window.stride(2) != 1 or frames.stride(1) != 1:
        raise ValueError("the frame dimension must be contiguous")
    if tokens is not None and (
        tokens.shape != (bs, columns) or tokens.dtype != frames.dtype or tokens.stride(1) != 1
    ):
        raise ValueError(
            f"tokens must be {frames.dtype} [{bs}, {columns}] with a contiguous frame dimension, "
            f"got {tokens.dtype} {tuple(tokens.shape)}"
        )
    if advance is not None:
        _check_advance(advance, frame_index, bs, columns)
    if bs == 0:
        return
    a = advance
    ring = a.ring if a is not None else frames
    _window_shift_kernel[(bs,)](
        window, frames, frame_index if frame_index is not None else frames,
        tokens if tokens is not None else frames, width, columns,
        window.stride(0), window.stride(1), frames.stride(0),
        tokens.stride(0) if tokens is not None else 0,
        a.positions if a else frames, a.kv_lens if a else frames, a.slots if a else frames,
        a.block_tables if a else frames, a.block_tables.stride(0) if a else 0,
        a.block_tables.shape[1] if a else 0, ring, ring.shape[0] if a else 1,
        ring.stride(0) if a else 0, ring.stride(1) if a else 0,
        BLOCK_W=triton.next_power_of_2(width), BLOCK_C=triton.next_power_of_2(columns),
        HAS_FRAME_INDEX=frame_index is not None, HAS_TOKENS=tokens is not None, ADVANCE=a is not None,
        PAGE=a.page_size if a else 1, num_warps=1, **pdl_launch(),
    )  # fmt: skip


def _check_advance(advance: StepAdvance, frame_index: Tensor | None, bs: int, columns: int) -> None:
    a = advance
    if frame_index is None or frame_index.dtype != torch.int64 or frame_index.stride(0) != 1:
        raise ValueError("advancing the step needs its int64 frame_index, contiguous")
    expected = {"positions": torch.int64, "kv_lens": torch.int32, "slots": torch.int64}
    for name, dtype in expected.items():
        tensor = getattr(a, name)
        if tensor.dtype != dtype or tuple(tensor.shape) != (bs,) or tensor.stride(0) != 1:
            raise ValueError(f"advance.{name} must be {dtype} [{bs}], contiguous")
    tables = a.block_tables
    if tables.dtype != torch.int32 or tables.shape[0] != bs or tables.stride(1) != 1:
        raise ValueError(f"advance.block_tables must be int32 [{bs}, P] with contiguous rows")
    ring = a.ring
    if ring.dtype != torch.int32 or ring.dim() != 3 or ring.shape[1] < bs or ring.shape[2] != columns:
        raise ValueError(f"advance.ring must be int32 [R, >= {bs}, {columns}]")
    if ring.stride(2) != 1 or a.page_size < 1:
        raise ValueError("advance.ring needs contiguous frames and page_size >= 1")
