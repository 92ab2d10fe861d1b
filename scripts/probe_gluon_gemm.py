"""An FP8 block-scaled split-K GEMM written in Gluon (Triton's explicit-layout dialect), to test
one hypothesis the Triton kernel cannot: that the batch-64 GEMMs lose time because every K
step's MMA is waited for before its scale promotion (`WARPGROUP.DEPBAR.LE gsb0, 0x0` after each
MMA in the sm_90 build of `kernels/fp8_gemm.py`, docs/performance.md after run 60).

Here each K step's MMA starts into a fresh accumulator and is waited for one step later
(`warpgroup_mma_wait(num_outstanding=1)`), so step k+1's MMA runs while step k's partial is
scaled and added; the slot step k read is refilled by TMA only then. `OVERLAP=False` waits at
once (the Triton kernel's order), so the two are compared on the same tiles and pipeline.
Operands are swapped as in `GemmConfig.swap_ab`: the weight tile is the MMA's M side (64 or 128
rows), the activations its N side. The output is the split-K partials [splits, M, N] (what the
decode step's consumers read), fp32 or bf16, and must equal the Triton kernel's bit for bit.

Usage (GPU): python scripts/probe_gluon_gemm.py [--m 1 16 64] [--shapes down qkv] [--case-timeout 90]
Compile check on any machine: python scripts/probe_gluon_gemm.py --compile-only

Not yet run to completion on a GPU: its first run (docs/performance.md run 64) hung on a split
with no K steps, since fixed on the CPU (a fixed trip count, as the Triton kernel has). A kernel
that hangs cannot be stopped from inside the process, so each (shape, M) case runs under a
watchdog that ends the process with a traceback after `--case-timeout` seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

BLOCK_K = 128


@gluon.jit
def _scales(a_scale_ptr, w_scale_ptr, offs_m, m_mask, w_scale_row, kb, k_blocks, stride_asm, stride_asg):
    """The K step's promotion factors, one per activation row: a_scale[m, kb] * w_scale[tile, kb]."""
    w_scale = gl.load(w_scale_row + kb, mask=kb < k_blocks, other=0.0)
    a_scale = gl.load(
        a_scale_ptr + offs_m * stride_asm + kb * stride_asg, mask=m_mask & (kb < k_blocks), other=0.0
    )
    return a_scale * w_scale


@gluon.jit
def _load_step(w_desc, a_desc, w_smem, a_smem, ready, slot, kb, off_n, off_m, pred):
    """TMA copies of one K step's weight and activation tiles into `slot`, counted on its barrier."""
    BK: gl.constexpr = w_desc.block_type.shape[1]
    mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes + a_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(
        w_desc, [off_n, kb * BK], ready.index(slot), w_smem.index(slot), pred=pred
    )
    tma.async_copy_global_to_shared(
        a_desc, [off_m, kb * BK], ready.index(slot), a_smem.index(slot), pred=pred
    )


@gluon.jit
def _gluon_fp8_gemm(
    w_desc, a_desc, w_scale_ptr, a_scale_ptr, partial_ptr,
    M, N, k_blocks, stride_wsn, stride_asm, stride_asg,
    STEPS: gl.constexpr, STAGES: gl.constexpr, BF16_OUT: gl.constexpr, OVERLAP: gl.constexpr,
    num_warps: gl.constexpr,
):  # fmt: skip
    BN: gl.constexpr = w_desc.block_type.shape[0]  # weight rows: the MMA's M side
    BM: gl.constexpr = a_desc.block_type.shape[0]  # activation rows: the MMA's N side
    BK: gl.constexpr = w_desc.block_type.shape[1]
    pid_n = gl.program_id(0)
    pid_k = gl.program_id(1)
    pid_m = gl.program_id(2)
    off_n = pid_n * BN
    off_m = pid_m * BM
    kb0 = pid_k * STEPS
    n_steps: gl.constexpr = STEPS  # a fixed trip count: past K, TMA fills zeros and the scales are 0

    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 32]
    )
    offs_m = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, mma_layout))
    offs_n = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_layout))
    m_mask = offs_m < M
    w_scale_row = w_scale_ptr + (off_n // BK) * stride_wsn

    w_smem = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BN, BK], w_desc.layout)
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BM, BK], a_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES - 1):  # the first STAGES - 1 steps in flight
        _load_step(w_desc, a_desc, w_smem, a_smem, ready, i, kb0 + i, off_n, off_m, i < n_steps)

    zero = gl.zeros((BN, BM), gl.float32, mma_layout)
    acc = gl.zeros((BN, BM), gl.float32, mma_layout)
    # Step 0, peeled: its MMA is the one in flight when the loop starts.
    mbarrier.wait(ready.index(0), 0)
    pending = warpgroup_mma(
        w_smem.index(0), a_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True
    )
    if not OVERLAP:
        pending = warpgroup_mma_wait(num_outstanding=0, deps=(pending,))
    pending_scale = _scales(
        a_scale_ptr, w_scale_ptr, offs_m, m_mask, w_scale_row, kb0, k_blocks, stride_asm, stride_asg
    )
    last = STAGES - 1  # slot STAGES - 1 was never filled: step STAGES - 1 goes there
    _load_step(w_desc, a_desc, w_smem, a_smem, ready, last, kb0 + last, off_n, off_m, last < n_steps)
    for step in range(1, n_steps):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        current = warpgroup_mma(
            w_smem.index(slot), a_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True
        )
        if OVERLAP:  # all but the MMA just issued are done: step - 1's partial and its slot
            done = warpgroup_mma_wait(num_outstanding=1, deps=(pending,))
        else:
            current = warpgroup_mma_wait(num_outstanding=0, deps=(current,))
            done = pending
        following = step + STAGES - 1  # into the slot step - 1 read
        _load_step(
            w_desc, a_desc, w_smem, a_smem, ready, following % STAGES, kb0 + following, off_n, off_m,
            following < n_steps,
        )  # fmt: skip
        acc += done * pending_scale[None, :]
        pending = current
        pending_scale = _scales(
            a_scale_ptr,
            w_scale_ptr,
            offs_m,
            m_mask,
            w_scale_row,
            kb0 + step,
            k_blocks,
            stride_asm,
            stride_asg,
        )
    if OVERLAP:
        pending = warpgroup_mma_wait(num_outstanding=0, deps=(pending,))
    acc += pending * pending_scale[None, :]
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    out = partial_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None]
    mask = m_mask[None, :] & (offs_n < N)[:, None]
    if BF16_OUT:
        gl.store(out, acc.to(gl.bfloat16), mask=mask)
    else:
        gl.store(out, acc, mask=mask)


@dataclasses.dataclass(frozen=True)
class GluonConfig:
    block_n: int  # weight rows per tile (64 or 128)
    block_m: int  # activation rows per tile (16 or 64)
    split_k: int
    stages: int
    overlap: bool
    num_warps: int = 4
    bf16_partials: bool = False


def _descriptor(tensor: torch.Tensor, rows: int):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([rows, BLOCK_K], gl.float8e4nv)
    return TensorDescriptor.from_tensor(tensor, [rows, BLOCK_K], layout)


def gluon_fp8_partials(
    x_q, x_s, w_q, w_s, config: GluonConfig, partials: torch.Tensor | None = None
) -> torch.Tensor:
    """Split-K partials [splits, M, N] of x_q @ w_q^T with the block scales (fp32 or bf16)."""
    (m, k), n = x_q.shape, w_q.shape[0]
    k_blocks = triton.cdiv(k, BLOCK_K)
    steps = triton.cdiv(k_blocks, config.split_k)
    dtype = torch.bfloat16 if config.bf16_partials else torch.float32
    if partials is None:
        partials = torch.empty(config.split_k, m, n, dtype=dtype, device=x_q.device)
    grid = (triton.cdiv(n, config.block_n), config.split_k, triton.cdiv(m, config.block_m))
    _gluon_fp8_gemm[grid](
        _descriptor(w_q, config.block_n), _descriptor(x_q, config.block_m), w_s, x_s, partials,
        m, n, k_blocks, w_s.stride(0), x_s.stride(0), x_s.stride(1),
        STEPS=steps, STAGES=config.stages, BF16_OUT=config.bf16_partials, OVERLAP=config.overlap,
        num_warps=config.num_warps,
    )  # fmt: skip
    return partials


def compile_only() -> None:
    """The sm_90 build on this machine (no GPU): does the kernel compile, and what does its steady
    loop wait on."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    for block_n, block_m, overlap in ((64, 64, True), (64, 64, False), (128, 64, True), (64, 16, True)):
        w = torch.zeros(2560, 9728, dtype=torch.float8_e4m3fn)
        a = torch.zeros(64, 9728, dtype=torch.float8_e4m3fn)
        names = _gluon_fp8_gemm.arg_names
        constants = {"STEPS": 11, "STAGES": 4, "BF16_OUT": False, "OVERLAP": overlap, "num_warps": 4}
        signature = {name: "constexpr" if name in constants else "i32" for name in names}
        signature.update(
            w_desc=mangle_type(_descriptor(w, block_n)), a_desc=mangle_type(_descriptor(a, block_m)),
            w_scale_ptr="*fp32", a_scale_ptr="*fp32", partial_ptr="*fp32",
        )  # fmt: skip
        source = GluonASTSource(
            _gluon_fp8_gemm, signature, constexprs={(names.index(k),): v for k, v in constants.items()}
        )
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
        ptx = compiled.asm["ptx"]
        print(
            f"block_n {block_n} block_m {block_m} overlap {overlap}: compiled, {compiled.metadata.shared} B "
            f"shared; wgmma.wait_group 1: {ptx.count('wgmma.wait_group.sync.aligned 1')}, "
            f"wait_group 0: {ptx.count('wgmma.wait_group.sync.aligned 0')}, "
            f"wgmma: {ptx.count('wgmma.mma_async')}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--shapes", nargs="+", default=["qkv", "o", "gate_up", "down"])
    parser.add_argument("--compile-only", action="store_true")
    parser.add_argument("--case-timeout", type=float, default=90.0, help="seconds per (shape, M) case")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    os.environ.setdefault("SHOAL_PDL", "0")  # neither kernel overlaps its neighbour here
    from shoal.bench.gemm import ROTATION_BYTES, SHAPES, _weight_sets, time_variant
    from shoal.kernels import fp8_gemm, quant
    from shoal.kernels.fp8_gemm import GemmConfig

    print(f"{'shape':>8} {'M':>3} {'variant':<44} {'us':>7} {'TB/s':>6} {'vs tuned':>8}")
    for name in args.shapes:
        n, k = SHAPES[name]
        sets = _weight_sets(n, k, max(2, -(-ROTATION_BYTES // (n * k))))
        for m in args.m:
            faulthandler.dump_traceback_later(args.case_timeout, exit=True)  # a hung kernel ends the run
            print(f"{name:>8} {m:>3} case started (watchdog {args.case_timeout:.0f} s)", flush=True)
            x_q, x_s = quant.quantize_activations(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
            tuned = fp8_gemm.pick_config(n, k, m, fp8_activations=True)
            block_m = 16 if m <= 16 else 64
            candidates = [
                GluonConfig(bn, block_m, split, 4, overlap, bf16_partials=tuned.bf16_partials and split > 1)
                for bn in (64, 128)
                for split in sorted({tuned.split_k, 2 * tuned.split_k})
                for overlap in (True, False)
            ]
            # Bits: against the Triton kernel on the same tiles (swapped, TMA, scales ahead).
            w = sets[0]
            for config in (candidates[0], dataclasses.replace(candidates[0], block_n=128)):
                plain = dataclasses.replace(config, bf16_partials=False)
                triton_config = GemmConfig(
                    block_m, plain.block_n, plain.split_k, 4, 3, swap_ab=True, tma=True, scales_ahead=True
                )
                want = fp8_gemm.fp8_gemm(
                    x_q, x_s, w["w_q"], w["w_scale"], config=triton_config, unreduced=True
                )
                want = want.parts if isinstance(want, fp8_gemm.SplitKPartials) else want[None]
                for overlap in (True, False):
                    got = gluon_fp8_partials(
                        x_q, x_s, w["w_q"], w["w_scale"], dataclasses.replace(plain, overlap=overlap)
                    )
                    same = torch.equal(got, want.float())
                    worst = (got - want.float()).abs().max().item()
                    verdict = "EQUAL" if same else f"DIFFER (max {worst:.3g})"
                    label = f"{plain.block_n} rows split {plain.split_k} overlap {overlap}"
                    print(f"{name:>8} {m:>3} bits vs Triton, {label}: {verdict}", flush=True)

            def triton_call(x, w, config=tuned):
                return fp8_gemm.fp8_gemm(x[0], x[1], w["w_q"], w["w_scale"], config=config, unreduced=True)

            base = time_variant(triton_call, (x_q, x_s), sets, 20, 3)
            print(
                f"{name:>8} {m:>3} {'triton tuned':<44} {base * 1e6:>7.1f} {n * k / base / 1e12:>6.2f}",
                flush=True,
            )
            for config in candidates:
                try:
                    t = time_variant(
                        lambda x, w, c=config: gluon_fp8_partials(x[0], x[1], w["w_q"], w["w_scale"], c),
                        (x_q, x_s), sets, 20, 3,
                    )  # fmt: skip
                except Exception as error:  # noqa: BLE001 - out of shared memory, etc.
                    print(f"{name:>8} {m:>3} {config}: {type(error).__name__} {str(error)[:80]}")
                    continue
                label = (
                    f"gluon {config.block_n}x{config.block_m} split {config.split_k} st {config.stages} "
                    + ("overlap" if config.overlap else "wait0")
                )
                rate = n * k / t / 1e12
                print(
                    f"{name:>8} {m:>3} {label:<44} {t * 1e6:>7.1f} {rate:>6.2f} {t / base:>7.3f}x", flush=True
                )
    faulthandler.cancel_dump_traceback_later()


if __name__ == "__main__":
    main()
