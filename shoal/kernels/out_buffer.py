"""The `out=` argument of the decode step's row kernels: allocate one, or check the one given.

Inside a CUDA graph the engine passes preallocated outputs so that a replay allocates nothing; a
given buffer of the wrong shape, dtype or row layout would be written out of bounds, so it is
refused before the launch (the same message from every kernel)."""

from __future__ import annotations

import torch
from torch import Tensor


def out_buffer(
    out: Tensor | None, rows: int, columns: int, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """`out`, checked to be `dtype` [rows, columns] with contiguous rows, or a new such tensor."""
    if out is None:
        return torch.empty(rows, columns, dtype=dtype, device=device)
    if out.shape != (rows, columns) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {dtype} [{rows}, {columns}] with contiguous rows")
    return out
