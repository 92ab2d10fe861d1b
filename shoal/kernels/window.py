"""The previous-frames window shift: one launch, in place, CUDA-graph safe.

Contract (docs/contracts.md): window int32 `[bs, W, N+1]` (oldest frame first), next frames int32
`[bs, N+1]`; after the call `window[:, :-1]` holds the old `window[:, 1:]` and `window[:, -1]` the
new frames. No allocation, no host sync, no dtype promotion: the engine replays it inside the
decode graph. Each program owns one batch row and reads its whole [W, N+1] tile into registers
before writing, so the overlapping in-place move is safe.

`frame_index` (optional, int [bs]) keeps the window of rows whose frame index is 0 unchanged, as
`models.sampling.push_frames` does (the reference keeps the prefill frame out of its window).

`tokens` (optional, int32 [bs, N+1] like frames) also gets the new frames, every row whatever its
frame index: the next step's input, stored here instead of by a separate plain `copy_` kernel
that would break the step's PDL chain (kernels/pdl.py).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.pdl import pdl_launch, wait_for_inputs


@triton.jit
def _window_shift_kernel(
    window_ptr, frames_ptr, frame_index_ptr, tokens_ptr, width, columns,
    stride_wb, stride_ww, stride_fb, stride_tb,
    BLOCK_W: tl.constexpr, BLOCK_C: tl.constexpr, HAS_FRAME_INDEX: tl.constexpr,
    HAS_TOKENS: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    fresh = tl.load(frames_ptr + row * stride_fb + c, mask=c < columns, other=0)
    if HAS_TOKENS:
        tl.store(tokens_ptr + row * stride_tb + c, fresh, mask=c < columns)
    push = True
    if HAS_FRAME_INDEX:
        push = tl.load(frame_index_ptr + row) >= 1
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
    window: Tensor, frames: Tensor, frame_index: Tensor | None = None, tokens: Tensor | None = None
) -> None:
    """Shift `frames` [bs, N+1] into `window` [bs, W, N+1] in place, and copy them into `tokens`
    if given (see the module docstring)."""
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
    if bs == 0:
        return
    _window_shift_kernel[(bs,)](
        window, frames, frame_index if frame_index is not None else frames,
        tokens if tokens is not None else frames, width, columns,
        window.stride(0), window.stride(1), frames.stride(0),
        tokens.stride(0) if tokens is not None else 0,
        BLOCK_W=triton.next_power_of_2(width), BLOCK_C=triton.next_power_of_2(columns),
        HAS_FRAME_INDEX=frame_index is not None, HAS_TOKENS=tokens is not None, num_warps=1,
        **pdl_launch(),
    )  # fmt: skip
