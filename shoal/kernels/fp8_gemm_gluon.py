"""The FP8 block-scaled split-K GEMM written in Gluon, so that weights can stream before the PDL wait.

At batch 1 every FP8 GEMM of the decode step pays a few µs that move no weights: the pipeline's
ramp (the first tiles' DRAM latency) and its drain. Under programmatic dependent launch
(`kernels/pdl.py`) a GEMM's programs become resident while the kernel before it still runs, and
then sit at `griddepcontrol.wait`; the weights do not depend on that kernel. Triton's software
pipeline issues its first copies only after the wait, but in Gluon the pipeline is written out:
each program issues the TMA copies of its first `tiles_before_wait` weight tiles (and loads the
first block scale) before the wait, so that part of the weight stream overlaps the previous kernel.
How many is a trade: copies issued ahead shorten the GEMM, but they fill the memory system while
the kernel before (a norm, attention: chains of dependent loads) runs, and slow it.

With `TMA_SCALES` each step's activation scales ride the ring too: one more copy per stage, of the
step's group out of the group-major scale buffer read as a flat vector (group kb of row r at
kb * M + r), so they arrive `STAGES` steps ahead instead of one pointer load ahead (the multiply
waiting on those loads is otherwise the top stall). A copy is at least 32 floats (128-byte aligned
stages) and must start on 16 bytes, so only M % 4 == 0 with at least one copy of scales takes them
(`flat_scales`); a tile's rows past M read the next group's scales, which are never stored.

With `VECTOR_STORES` the finished tile (or split-K partial) goes through shared memory into a
blocked layout of 16 contiguous output bytes per thread before it is stored. Straight from the
wgmma layout a store instruction writes 2 bytes per thread (swapped tiles: consecutive output
columns sit in different lanes) or 4 (unswapped bf16 pairs), each 32-byte sector in pieces.

Same tiles and arithmetic as the Triton kernel with `swap_ab=True, tma=True, scales_ahead=True`
(weight rows are the wgmma's M side, each K step's product scaled by a_scale * w_scale and added
in K order): the same bits. Hopper only (TMA, wgmma); `fp8_gemm._launch` runs that Triton config
instead in the CPU interpreter and on older GPUs.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

BLOCK = 128  # K columns per step: one weight-scale column
BLOCK_K = gl.constexpr(BLOCK)


@gluon.jit
def _gdc_wait_then_release(USE_PDL: gl.constexpr):
    """`kernels.pdl.wait_for_inputs` for Gluon: the previous kernel's writes visible, then the
    next kernel may launch."""
    if USE_PDL:
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@gluon.jit
def _copy_weights(w_desc, w_smem, ready, slot, kb, off_n, tile_bytes: gl.constexpr):
    """Step kb's weight tile into `slot`; its barrier expects the activation tile's bytes too."""
    mbarrier.expect(ready.index(slot), tile_bytes)
    tma.async_copy_global_to_shared(w_desc, [off_n, kb * BLOCK_K], ready.index(slot), w_smem.index(slot))


@gluon.jit
def _copy_activations(a_desc, a_smem, s_desc, s_smem, ready, slot, kb, off_m, M, TMA_SCALES: gl.constexpr):
    """Step kb's activation tile (and with TMA_SCALES its scales) into `slot`."""
    tma.async_copy_global_to_shared(a_desc, [off_m, kb * BLOCK_K], ready.index(slot), a_smem.index(slot))
    if TMA_SCALES:
        tma.async_copy_global_to_shared(s_desc, [kb * M + off_m], ready.index(slot), s_smem.index(slot))


@gluon.jit
def _next_scales(
    w_scale_row, a_scale_ptr, offs_m, m_mask, kb, k_blocks, stride_asm, stride_asg, a_scale,
    TMA_SCALES: gl.constexpr,
):  # fmt: skip
    """Step kb's weight scale and (unless they ride the ring) activation scales."""
    w_scale = gl.load(w_scale_row + kb, mask=kb < k_blocks, other=0.0)
    if not TMA_SCALES:
        a_scale = gl.load(
            a_scale_ptr + offs_m * stride_asm + kb * stride_asg, mask=m_mask & (kb < k_blocks), other=0.0
        )
    return w_scale, a_scale


@gluon.jit
def _fp8_gemm_prefetch_kernel(
    w_desc, a_desc, s_desc, w_scale_ptr, a_scale_ptr, out_ptr, partial_ptr, counter_ptr,
    M, N, k_blocks, stride_wsn, stride_asm, stride_asg, stride_om,
    STEPS: gl.constexpr, STAGES: gl.constexpr, AHEAD: gl.constexpr, SPLIT_K: gl.constexpr,
    SWAPPED: gl.constexpr, LEAVE_PARTIALS: gl.constexpr, BF16_PARTIALS: gl.constexpr,
    TMA_SCALES: gl.constexpr, SCALES_FIRST: gl.constexpr, VECTOR_STORES: gl.constexpr,
    STORE_BYTES: gl.constexpr, USE_PDL: gl.constexpr, num_warps: gl.constexpr,
):  # fmt: skip
    BN: gl.constexpr = w_desc.block_type.shape[0]  # weight rows of the tile
    BM: gl.constexpr = a_desc.block_type.shape[0]  # activation rows of the tile
    SB: gl.constexpr = s_desc.block_type.shape[0] if TMA_SCALES else BM  # >= BM, 32 at least
    TILE_BYTES: gl.constexpr = (
        w_desc.block_type.nbytes + a_desc.block_type.nbytes + (SB * 4 if TMA_SCALES else 0)
    )
    # Grid (m tiles, n tiles, splits), as the Triton kernel's: one weight tile's M tiles run together.
    pid_m = gl.program_id(0)
    pid_n = gl.program_id(1)
    pid_k = gl.program_id(2)
    off_n = pid_n * BN
    off_m = pid_m * BM
    kb0 = pid_k * STEPS  # a fixed trip count: past K, TMA fills zeros and the scales load as 0

    # The accumulator is [BN, BM] when swapped (weight rows on the wgmma's M side), else [BM, BN].
    if SWAPPED:
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 32]
        )
        scale_layout: gl.constexpr = gl.SliceLayout(0, mma_layout)
        acc_shape: gl.constexpr = (BN, BM)
    else:
        mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 32]
        )
        scale_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
        acc_shape: gl.constexpr = (BM, BN)
    offs_m = off_m + gl.arange(0, BM, layout=scale_layout)
    m_mask = offs_m < M
    w_scale_row = w_scale_ptr + (off_n // BLOCK_K) * stride_wsn

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BLOCK_K], w_desc.layout)
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BLOCK_K], a_desc.layout)
    if TMA_SCALES:
        s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, SB], s_desc.layout)
    else:
        s_smem = a_smem  # unused
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    # Constants of the step first: AHEAD weight tiles and the first step's weight scale.
    for i in gl.static_range(STAGES):
        if i < STEPS and i < AHEAD:
            _copy_weights(w_desc, w_smem, ready, i, kb0 + i, off_n, TILE_BYTES)
    w_scale = gl.load(w_scale_row + kb0, mask=kb0 < k_blocks, other=0.0)
    _gdc_wait_then_release(USE_PDL)
    # From here on the inputs may come from the previous kernel.
    for i in gl.static_range(STAGES):
        if i < STEPS:
            if i >= AHEAD:
                _copy_weights(w_desc, w_smem, ready, i, kb0 + i, off_n, TILE_BYTES)
            _copy_activations(a_desc, a_smem, s_desc, s_smem, ready, i, kb0 + i, off_m, M, TMA_SCALES)
    a_scale = w_scale  # a placeholder when the scales ride the ring
    if not TMA_SCALES:
        a_scale = gl.load(
            a_scale_ptr + offs_m * stride_asm + kb0 * stride_asg, mask=m_mask & (kb0 < k_blocks), other=0.0
        )

    zero = gl.zeros(acc_shape, gl.float32, mma_layout)
    acc = gl.zeros(acc_shape, gl.float32, mma_layout)
    for step in range(STEPS):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        if TMA_SCALES:
            # Multiplied here, so every warp has read the slot's scales before the MMA below,
            # whose completion lets the slot be refilled.
            scale = s_smem.index(slot).slice(0, BM).load(scale_layout) * w_scale
        else:
            scale = a_scale * w_scale
        if SWAPPED:
            part = warpgroup_mma(
                w_smem.index(slot), a_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
            )
        else:
            part = warpgroup_mma(
                a_smem.index(slot), w_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
            )
        part = warpgroup_mma_wait(num_outstanding=0, deps=(part,))
        if SCALES_FIRST:
            # The next step's scales (this step's product is taken), then the refill: the order
            # of Triton's sm_90 loop, which issues the scale loads a refill earlier. Paired with
            # the scale copies (also where a launch falls back to loads).
            w_scale, a_scale = _next_scales(
                w_scale_row, a_scale_ptr, offs_m, m_mask, kb0 + step + 1, k_blocks, stride_asm,
                stride_asg, a_scale, TMA_SCALES,
            )  # fmt: skip
        following = step + STAGES  # into the slot this step has finished reading
        if following < STEPS:
            kb = kb0 + following
            _copy_weights(w_desc, w_smem, ready, slot, kb, off_n, TILE_BYTES)
            _copy_activations(a_desc, a_smem, s_desc, s_smem, ready, slot, kb, off_m, M, TMA_SCALES)
        if SWAPPED:
            acc += part * scale[None, :]
        else:
            acc += part * scale[:, None]
        if not SCALES_FIRST:
            w_scale, a_scale = _next_scales(
                w_scale_row, a_scale_ptr, offs_m, m_mask, kb0 + step + 1, k_blocks, stride_asm,
                stride_asg, a_scale, TMA_SCALES,
            )  # fmt: skip
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    if VECTOR_STORES:
        # Through shared memory into a layout whose threads hold 16 contiguous output bytes; the
        # accumulator's own layout stores 2-4 bytes per instruction.
        store_layout: gl.constexpr = _row_contiguous(acc_shape, SWAPPED, STORE_BYTES, num_warps)
        acc = gl.convert_layout(acc, store_layout)
    else:
        store_layout: gl.constexpr = mma_layout
    rows_m, rows_n = _tile_rows(off_m, off_n, BM, BN, SWAPPED, store_layout)
    mask = (rows_m < M) & (rows_n < N)
    tile_offsets = rows_m * N + rows_n
    out_ptrs = out_ptr + rows_m.to(gl.int64) * stride_om + rows_n
    if SPLIT_K == 1:
        gl.store(out_ptrs, acc.to(gl.bfloat16), mask=mask)
    else:
        split_stride = M * N
        if BF16_PARTIALS:
            gl.store(partial_ptr + pid_k * split_stride + tile_offsets, acc.to(gl.bfloat16), mask=mask)
        else:
            gl.store(partial_ptr + pid_k * split_stride + tile_offsets, acc, mask=mask)
        if not LEAVE_PARTIALS:  # the last program of the tile to arrive sums the partials in order
            gl.thread_barrier()
            tile = pid_m * gl.num_programs(1) + pid_n
            arrived = gl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = gl.zeros(acc_shape, gl.float32, store_layout)
                for s in range(SPLIT_K):
                    total += gl.load(
                        partial_ptr + s * split_stride + tile_offsets,
                        mask=mask,
                        other=0.0,
                        cache_modifier=".cg",
                    ).to(gl.float32)
                gl.store(out_ptrs, total.to(gl.bfloat16), mask=mask)
                gl.atomic_xchg(counter_ptr + tile, 0, sem="relaxed", scope="gpu")


@gluon.constexpr_function
def _row_contiguous(shape, swapped, element_bytes, num_warps):
    """A blocked layout of the [BN, BM] (swapped) or [BM, BN] tile in which each thread holds 16
    bytes along the output's rows (N), the contiguous side of out[m, n]."""
    along_n = 0 if swapped else 1
    per_thread = [1, 1]
    per_thread[along_n] = 16 // element_bytes
    lanes = [1, 1]
    lanes[along_n] = max(1, min(32, shape[along_n] // per_thread[along_n]))
    lanes[1 - along_n] = 32 // lanes[along_n]
    warps = [1, 1]
    warps[1 - along_n] = num_warps
    return gl.BlockedLayout(per_thread, lanes, warps, [along_n, 1 - along_n])


@gluon.jit
def _tile_rows(off_m, off_n, BM: gl.constexpr, BN: gl.constexpr, SWAPPED: gl.constexpr, layout: gl.constexpr):
    """The tile's output rows (m) and columns (n) as broadcastable index tensors in `layout`."""
    if SWAPPED:
        offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, layout))
        return offs_m[None, :], offs_n[:, None]
    else:
        offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
        offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
        return offs_m[:, None], offs_n[None, :]


def check_tile(block_m: int, block_n: int, swapped: bool, num_warps: int) -> None:
    """The wgmma's M side (weight rows when swapped, else activation rows) is 16 rows per warp of
    the warpgroups; its N side is 8-256 columns in 8s."""
    mma_m, mma_n = (block_n, block_m) if swapped else (block_m, block_n)
    if mma_m % (16 * num_warps) or mma_m > 128 or mma_n % 8 or not 8 <= mma_n <= 128:
        side = ("block_n", "block_m") if swapped else ("block_m", "block_n")
        raise ValueError(
            f"the Gluon GEMM ({'swapped' if swapped else 'unswapped'}, {num_warps} warps) needs "
            f"{side[0]} a multiple of {16 * num_warps} up to 128 and {side[1]} 8-128 in 8s: "
            f"block_m {block_m}, block_n {block_n}"
        )


def _kernel_constants(
    k: int, *, split_k: int, swapped: bool, num_stages: int, tiles_before_wait: int,
    leave_partials: bool, bf16_partials: bool, tma_scales: bool, scales_first: bool, vector_stores: bool,
) -> dict:  # fmt: skip
    """The kernel's compile-time constants for one launch shape (USE_PDL comes with the launch)."""
    return {
        "STEPS": triton.cdiv(triton.cdiv(k, BLOCK), split_k), "STAGES": num_stages,
        "AHEAD": tiles_before_wait, "SPLIT_K": split_k, "SWAPPED": swapped,
        "LEAVE_PARTIALS": leave_partials, "BF16_PARTIALS": bf16_partials and split_k > 1,
        "TMA_SCALES": tma_scales, "SCALES_FIRST": scales_first, "VECTOR_STORES": vector_stores,
        # the bytes of what the epilogue stores: fp32 partials, else bf16 (its layout's vector width)
        "STORE_BYTES": 4 if split_k > 1 and not bf16_partials else 2,
    }  # fmt: skip


def _descriptor(tensor: torch.Tensor, rows: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([rows, BLOCK], gl.float8e4nv)
    return TensorDescriptor.from_tensor(tensor, [rows, BLOCK], layout)


# The flat scale vector's copies: `scale_box` fp32 values, unswizzled.
_SCALE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


def scale_box(block_m: int) -> int:
    """Floats per scale copy: the tile's rows, at least 32, so that each stage's copy lands
    128-byte aligned in shared memory; the rows past the tile's are not read."""
    return max(block_m, 32)


def flat_scales(a_scale: torch.Tensor, block_m: int) -> torch.Tensor | None:
    """The group-major activation scales [M, groups] as the flat vector the kernel's scale copies
    read (group kb of row r at kb * M + r), or None where a copy could not be made: a buffer not
    laid out so or not 16-byte aligned, M not a multiple of 4 (a copy's start, kb * M + the tile's
    first row, must fall on 16 bytes), or fewer scales than one copy. Such launches load their
    scales by pointer."""
    m, groups = a_scale.shape
    if (
        m % 4
        or a_scale.stride(0) != 1
        or (groups > 1 and a_scale.stride(1) != m)
        or a_scale.data_ptr() % 16
        or m * groups < scale_box(block_m)
    ):
        return None
    return a_scale.t().reshape(-1)


def _scale_descriptor(flat: torch.Tensor, block_m: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    return TensorDescriptor.from_tensor(flat, [scale_box(block_m)], _SCALE_LAYOUT)


def launch_prefetch_gemm(
    a: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor,
    partials: torch.Tensor, counters: torch.Tensor, *, block_m: int, block_n: int, split_k: int,
    swapped: bool, num_stages: int, tiles_before_wait: int, num_warps: int, bf16_partials: bool,
    leave_partials: bool, launch: dict, tma_scales: bool = False, vector_stores: bool = False,
) -> None:  # fmt: skip
    """One launch; the caller (`fp8_gemm._launch`) has checked shapes, scales and the workspace."""
    check_tile(block_m, block_n, swapped, num_warps)
    (m, k), n = a.shape, w_q.shape[0]
    if k % 16:
        raise ValueError(f"TMA loads need K % 16 == 0 (16-byte aligned e4m3 rows), got K = {k}")
    flat = flat_scales(a_scale, block_m) if tma_scales else None
    constants = _kernel_constants(
        k, split_k=split_k, swapped=swapped, num_stages=num_stages, tiles_before_wait=tiles_before_wait,
        leave_partials=leave_partials, bf16_partials=bf16_partials, tma_scales=flat is not None,
        scales_first=tma_scales, vector_stores=vector_stores,
    )  # fmt: skip
    s_desc = _scale_descriptor(flat, block_m) if flat is not None else a_scale  # else unused
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), split_k)
    _fp8_gemm_prefetch_kernel[grid](
        _descriptor(w_q, block_n), _descriptor(a, block_m), s_desc, w_scale, a_scale, out, partials, counters,
        m, n, triton.cdiv(k, BLOCK), w_scale.stride(0), a_scale.stride(0), a_scale.stride(1), out.stride(0),
        **constants, num_warps=num_warps, **launch,
    )  # fmt: skip


def compile_for_hopper(
    m: int, n: int, k: int, *, block_m: int, block_n: int, split_k: int, num_stages: int,
    tiles_before_wait: int, leave_partials: bool, bf16_partials: bool = False, use_pdl: bool = True,
    num_warps: int = 4, swapped: bool = True, tma_scales: bool = False, vector_stores: bool = False,
):  # fmt: skip
    """The sm_90 build of one launch, on any machine (no GPU needed): for tests that read its PTX
    (where the weight copies sit against the PDL wait) and for `scripts/`-style inspection."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    kernel = _fp8_gemm_prefetch_kernel
    constants = _kernel_constants(
        k, split_k=split_k, swapped=swapped, num_stages=num_stages, tiles_before_wait=tiles_before_wait,
        leave_partials=leave_partials, bf16_partials=bf16_partials, tma_scales=tma_scales,
        scales_first=tma_scales, vector_stores=vector_stores,
    ) | {"USE_PDL": use_pdl, "num_warps": num_warps}  # fmt: skip
    w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
    a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta")
    signature = {name: "constexpr" if name in constants else "i32" for name in kernel.arg_names}
    scales = torch.empty(triton.cdiv(k, BLOCK) * m, dtype=torch.float32, device="meta")
    signature.update(
        w_desc=mangle_type(_descriptor(w, block_n)), a_desc=mangle_type(_descriptor(a, block_m)),
        s_desc=mangle_type(_scale_descriptor(scales, block_m)) if tma_scales else "*fp32",
        w_scale_ptr="*fp32", a_scale_ptr="*fp32", out_ptr="*bf16",
        partial_ptr="*bf16" if bf16_partials else "*fp32", counter_ptr="*i32",
    )  # fmt: skip
    names = kernel.arg_names
    constexprs = {(names.index(name),): value for name, value in constants.items()}
    # What the launcher specializes: pointers and integer arguments divisible by 16 (it decides
    # whether a store can be vectorized, so a reading without it is not the GPU's build).
    k_blocks = triton.cdiv(k, BLOCK)
    values = {"M": m, "N": n, "k_blocks": k_blocks, "stride_wsn": k_blocks, "stride_asm": 1,
              "stride_asg": m, "stride_om": n}  # fmt: skip
    aligned = [i for i, name in enumerate(names) if name.endswith("_ptr") or values.get(name, 1) % 16 == 0]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": num_warps})
