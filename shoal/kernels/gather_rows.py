"""Embedding rows by ids that a kernel just wrote, gathered by the kernel that consumes them.

Each fast-transformer pass k >= 2 starts from the embedding of the code the sampler drew for
codebook k (`frames[:, k]`, int32). In torch that is a cast to int64 and an `nn.Embedding`
gather: two kernels launched without programmatic dependent launch, so the decode graph drains
the GPU before each. Instead the pass's
first RMSNorm (`kernels.norm_rope.rms_norm`) reads the ids in place, any integer dtype and
stride, and gathers the rows while loading: the same bits as `F.embedding`, no launch of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from shoal.kernels.out_buffer import out_buffer

BLOCK_D = 1024  # columns per program of a row copy: a 2,560-wide row is three programs


@dataclass(frozen=True)
class GatheredRows:
    """`table[ids]` left for the kernel that consumes it to gather while loading
    (`kernels.norm_rope.rms_norm`), which also stores the rows into `out` [B, D] (the residual
    stream that starts from them). An id outside [0, V) gives a zero row (a device-side check
    would need a sync; the samplers draw only valid codes)."""

    ids: Tensor  # [B], any integer dtype and stride
    table: Tensor  # [V, D], contiguous rows
    out: Tensor  # [B, D] in the table's dtype, contiguous rows

    def check(self) -> None:
        """Raise unless ids, table and out fit together."""
        check_ids_and_table(self.ids, self.table)
        if self.out.device != self.table.device:
            raise ValueError(f"out on {self.out.device}, table on {self.table.device}")
        out_buffer(self.out, self.ids.shape[0], self.table.shape[1], self.table.dtype, self.table.device)


def check_ids_and_table(ids: Tensor, table: Tensor) -> None:
    """Raise unless ids are 1-D integers and the table 2-D with contiguous rows, on one device."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    if table.dim() != 2 or table.stride(1) != 1:
        raise ValueError("the table must be 2-D with contiguous rows")
    if ids.device != table.device:
        raise ValueError(f"ids on {ids.device}, table on {table.device}")
