"""Embedding rows by ids that a kernel just wrote: one PDL launch instead of two plain ones.

Each fast-transformer pass k >= 2 starts from the embedding of the code the sampler drew for
codebook k (`frames[:, k]`, int32). In torch that is a cast to int64 and an `nn.Embedding`
gather: two kernels launched without programmatic dependent launch, so the decode graph drains
the GPU before each and the pass's first kernel cannot start early (docs/performance.md run 81:
the step's plain torch kernels cost 2-3 µs each at batch 1). Here one kernel reads the ids in
place (any integer dtype and stride), waits for the sampler, and copies the rows: the same bits
as `F.embedding`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.out_buffer import out_buffer
from shoal.kernels.pdl import pdl_launch, wait_for_inputs

BLOCK_D = 1024  # columns per program: a 2,560-wide row is three programs


@dataclass(frozen=True)
class GatheredRows:
    """`table[ids]` left for the kernel that consumes it to gather while loading
    (`kernels.norm_rope.rms_norm`), which also stores the rows into `out` [B, D] (the residual
    stream that starts from them): the same bits as `gather_rows(ids, table, out)` followed by
    that kernel, one launch fewer. An id outside [0, V) gives a zero row, as in `gather_rows`."""

    ids: Tensor  # [B], any integer dtype and stride
    table: Tensor  # [V, D], contiguous rows
    out: Tensor  # [B, D] in the table's dtype, contiguous rows

    def check(self) -> None:
        """Raise unless the three fit together as `gather_rows` requires of its arguments."""
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


@triton.jit
def _gather_rows_kernel(
    ids_ptr, table_ptr, out_ptr, stride_ids, stride_table, stride_out, num_rows, dim,
    BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < dim
    wait_for_inputs(USE_PDL)  # the ids come from the kernel just before
    index = tl.load(ids_ptr + row * stride_ids).to(tl.int64)
    valid = (index >= 0) & (index < num_rows)  # `gather_rows` refuses nothing at replay time
    values = tl.load(table_ptr + index * stride_table + cols, mask=in_row & valid, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, values, mask=in_row)


def gather_rows(ids: Tensor, table: Tensor, out: Tensor | None = None) -> Tensor:
    """`F.embedding(ids, table)` for integer ids [B] of any stride -> [B, D] (`out`, if given,
    must be [B, D] of the table's dtype with contiguous rows). No host sync, no allocation with
    `out`: safe inside a CUDA graph. An id outside [0, V) yields a zero row instead of an error
    (a device-side check would need a sync); the engine's ids come from the samplers, which draw
    only valid codes."""
    check_ids_and_table(ids, table)
    (batch,), (num_rows, dim) = ids.shape, table.shape
    out = out_buffer(out, batch, dim, table.dtype, table.device)
    if batch == 0 or dim == 0:
        return out
    _gather_rows_kernel[(batch, triton.cdiv(dim, BLOCK_D))](
        ids, table, out, ids.stride(0), table.stride(0), out.stride(0), num_rows, dim,
        BLOCK=BLOCK_D, **pdl_launch(),
    )  # fmt: skip
    return out
