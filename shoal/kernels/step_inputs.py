"""The inputs of the decode step's slow pass and fast pass 0, each in one PDL launch.

In torch, the slow pass starts from `DualARTransformer.embed` (about eight kernels) and fast pass
0 from a cast, a clamp, a copy into `frames[:, 1]`, a gather and a stack. Each plain torch kernel
in the decode graph drains the GPU and breaks the PDL chain (kernels/pdl.py), so here each input
is one kernel that reads the ids where the sampler wrote them, waits for it, and writes the bits
torch writes.

Rounding, as torch does it: the N codebook rows are summed in fp32 and rounded once to the table
dtype, the token row is added in fp32 and rounded, and the semantic rows are scaled in fp32 and
rounded. Torch's `x / float` divides on the CPU but multiplies by the fp32 reciprocal on CUDA, so
the kernel does the same as torch on its device.

Summation order: the kernel adds the N codebook rows one after the other from +0.0, as torch's
CPU sum does for N <= 16 on whole blocks of 32 columns (the engine's dims are whole blocks); its
tail columns and N > 16 sum in other orders. The orders agree whenever every partial sum is exact
in fp32, which a bf16 table's sums are unless a column's N values span more than about
16 - log2(N) binades; otherwise one sign's sums move by at most one bf16 ulp, and cancellation
can move them more.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from shoal.kernels.gather_rows import BLOCK_D  # the same row copies, the same programs per row
from shoal.kernels.norm_rope import cast_rne, interpreting
from shoal.kernels.out_buffer import out_buffer
from shoal.kernels.pdl import pdl_launch, wait_for_inputs


@triton.jit
def _embed_tokens_kernel(
    tokens_ptr, emb_ptr, cb_ptr, out_ptr, stride_tt, stride_tc, stride_emb, stride_cb, stride_out,
    vocab, codebook_size, semantic_begin, semantic_end, dim, scale,
    NUM_CODEBOOKS: tl.constexpr, BLOCK: tl.constexpr, SCALE: tl.constexpr, DIVIDE: tl.constexpr,
    EMULATE: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < dim
    wait_for_inputs(USE_PDL)  # the tokens come from the sampler
    base = tokens_ptr + row * stride_tt
    token = tl.load(base).to(tl.int64)
    valid = (token >= 0) & (token < vocab)  # out-of-range ids read nothing (a zero row)
    x = tl.load(emb_ptr + token * stride_emb + cols, mask=in_row & valid, other=0.0)
    semantic = (token >= semantic_begin) & (token <= semantic_end)
    total = tl.zeros([BLOCK], dtype=tl.float32)  # from +0.0 as torch's sum, in codebook order
    for i in tl.static_range(NUM_CODEBOOKS):
        code = tl.load(base + (i + 1) * stride_tc).to(tl.int64)
        ok = semantic & (code >= 0) & (code < codebook_size)
        row_ptr = cb_ptr + (code + i * codebook_size) * stride_cb
        total += tl.load(row_ptr + cols, mask=in_row & ok, other=0.0).to(tl.float32)
    codebook_sum = cast_rne(total, x.dtype, EMULATE).to(tl.float32)  # torch's sum rounds once
    y = cast_rne(x.to(tl.float32) + codebook_sum, x.dtype, EMULATE)  # + 0.0 off the semantic ids
    if SCALE:
        if DIVIDE:
            scaled = tl.math.div_rn(y.to(tl.float32), scale)
        else:
            scaled = y.to(tl.float32) * scale
        y = tl.where(semantic, cast_rne(scaled, x.dtype, EMULATE), y)
    tl.store(out_ptr + row * stride_out + cols, y, mask=in_row)


def _torch_divides(device: torch.device) -> bool:
    """Whether torch's `x / float` divides on `device`; on CUDA it multiplies by 1/float in fp32."""
    return device.type != "cuda"


def _check_table(name: str, table: Tensor) -> None:
    if table.dim() != 2 or not table.dtype.is_floating_point or table.stride(1) != 1:
        raise ValueError(f"{name} must be a 2-D floating table with contiguous rows")


def embed_tokens(
    tokens: Tensor, embeddings: Tensor, codebook_embeddings: Tensor, codebook_size: int, semantic_begin: int,
    semantic_end: int, scale_codebooks: bool, out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """`DualARTransformer.embed(tokens.long())` in one launch, for the slow pass: tokens int32 or
    int64 [T, N+1] (any strides), embeddings [V, D], codebook_embeddings [N * codebook_size, D] ->
    [T, D] (`out` if given, no allocation then). No host sync: safe inside a CUDA graph. Ids out
    of range add a zero row instead of raising (a device-side check would need a sync). The
    rounding and the summation order are in the module docstring."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int32, torch.int64) or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be int32/int64 [T, N+1], got {tokens.dtype} {tuple(tokens.shape)}")
    _check_table("embeddings", embeddings)
    _check_table("codebook_embeddings", codebook_embeddings)
    num_codebooks, dim = tokens.shape[1] - 1, embeddings.shape[1]
    if codebook_embeddings.shape != (num_codebooks * codebook_size, dim):
        raise ValueError(f"codebook_embeddings must be [{num_codebooks} * {codebook_size}, {dim}]")
    if codebook_embeddings.dtype != embeddings.dtype:
        raise ValueError("embeddings and codebook_embeddings must have one dtype")
    if not tokens.device == embeddings.device == codebook_embeddings.device:
        raise ValueError("tokens and tables must be on one device")
    out = out_buffer(out, tokens.shape[0], dim, embeddings.dtype, embeddings.device)
    if out.numel() == 0:
        return out
    divide = _torch_divides(tokens.device)
    divisor = np.float32(math.sqrt(num_codebooks + 1))  # torch takes the scalar in fp32
    scale = float(divisor if divide else np.float32(1.0) / divisor)
    _embed_tokens_kernel[(tokens.shape[0], triton.cdiv(dim, BLOCK_D))](
        tokens, embeddings, codebook_embeddings, out, tokens.stride(0), tokens.stride(1),
        embeddings.stride(0), codebook_embeddings.stride(0), out.stride(0), embeddings.shape[0],
        codebook_size, semantic_begin, semantic_end, dim, scale, NUM_CODEBOOKS=num_codebooks,
        BLOCK=BLOCK_D, SCALE=scale_codebooks, DIVIDE=divide, EMULATE=interpreting(), **pdl_launch(),
    )  # fmt: skip
    return out


@triton.jit
def _fast_pass0_kernel(
    frames_ptr, hidden_ptr, table_ptr, out_ptr, stride_fb, stride_fc, stride_hidden, stride_table,
    stride_out, semantic_begin, codebook_size, dim, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < dim
    wait_for_inputs(USE_PDL)  # frames[:, 0] from the main-token sampler, hidden from the slow head
    main = tl.load(frames_ptr + row * stride_fb).to(tl.int64)
    code = tl.minimum(tl.maximum(main - semantic_begin, 0), codebook_size - 1)
    if tl.program_id(1) == 0:  # one writer per row
        tl.store(frames_ptr + row * stride_fb + stride_fc, code.to(tl.int32))
    hidden = tl.load(hidden_ptr + row * stride_hidden + cols, mask=in_row)
    tl.store(out_ptr + 2 * row * stride_out + cols, hidden, mask=in_row)
    embedding = tl.load(table_ptr + code * stride_table + cols, mask=in_row)
    tl.store(out_ptr + (2 * row + 1) * stride_out + cols, embedding, mask=in_row)


def fast_pass0_input(
    frames: Tensor, hidden: Tensor, fast_embeddings: Tensor, semantic_begin: int, codebook_size: int,
    out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Fast pass 0's input in one launch: code0 = clamp(frames[:, 0] - semantic_begin, 0,
    codebook_size - 1) is written to frames[:, 1] (int32 [B, N+1], any strides) and
    out [2B, D] (given: no allocation) gets rows 2b = hidden[b], 2b+1 = fast_embeddings[code0[b]]:
    the bits of `torch.stack([hidden, fast_embeddings[code0]], 1).reshape(2B, D)`. No host sync:
    safe inside a CUDA graph."""
    if frames.dim() != 2 or frames.dtype != torch.int32 or frames.shape[1] < 2:
        raise ValueError(f"frames must be int32 [B, N+1], got {frames.dtype} {tuple(frames.shape)}")
    _check_table("fast_embeddings", fast_embeddings)
    batch, dim = frames.shape[0], fast_embeddings.shape[1]
    if fast_embeddings.shape[0] != codebook_size:
        raise ValueError(f"fast_embeddings must have codebook_size={codebook_size} rows")
    if hidden.shape != (batch, dim) or hidden.dtype != fast_embeddings.dtype or hidden.stride(1) != 1:
        raise ValueError(f"hidden must be {fast_embeddings.dtype} [{batch}, {dim}] with contiguous rows")
    if not frames.device == hidden.device == fast_embeddings.device:
        raise ValueError("frames, hidden and fast_embeddings must be on one device")
    out = out_buffer(out, 2 * batch, dim, hidden.dtype, hidden.device)
    if batch == 0:
        return out
    _fast_pass0_kernel[(batch, max(1, triton.cdiv(dim, BLOCK_D)))](
        frames, hidden, fast_embeddings, out, frames.stride(0), frames.stride(1), hidden.stride(0),
        fast_embeddings.stride(0), out.stride(0), semantic_begin, codebook_size, dim,
        BLOCK=BLOCK_D, **pdl_launch(),
    )  # fmt: skip
    return out
