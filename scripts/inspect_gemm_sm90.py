"""Compile the FP8 split-K GEMM for the H200 (sm_90) on any machine, GPU or not, and print what
its steady K loop costs per 128-column step: instructions, CTA barriers, shuffles, shared-memory
round trips, MMAs, and whether Triton software-pipelined the loads. No device time needed.

What it catches: a loop Triton did not pipeline, the CTA barriers per step (`GemmConfig.scales_ahead`
removes some), and the width of every global store (2-4 byte stores straight from the wgmma
layout are slow; `GemmConfig.vector_stores` widens them).

Usage: python scripts/inspect_gemm_sm90.py N K M [--config 'GemmConfig(16, 64, 7, 4, 4, tma=True)'] [--sass]
(default config: the tuned table's for (N, K, M), pre-quantized activations).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shoal.bench.gemm import add_gemm_case_arguments, gemm_case_config
from shoal.kernels import fp8_gemm
from shoal.kernels.fp8_gemm import BLOCK_K, GemmConfig

POINTERS = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
            "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32"}  # fmt: skip
ALIGNED = ("N", "K", "stride_am", "stride_wn", "stride_om")  # Triton specializes these as 16-divisible


def compile_split_k(k: int, config: GemmConfig):
    """The sm_90 build a `fp8_gemm` launch (pre-quantized activations, partials left to the
    consumer when split) would run, with PDL on."""
    constants = fp8_gemm.kernel_constants(fp8_gemm.ACT_FP8, False, k, config, config.split_k > 1)
    constants.update(DOT_IN_FP32=False, USE_PDL=True)
    names = fp8_gemm._fp8_gemm_kernel.arg_names
    descriptors = {
        "a_desc": f"tensordesc<fp8e4nv[{config.block_m}, {BLOCK_K}]>" if config.tma else "*fp8e4nv",
        "w_desc": f"tensordesc<fp8e4nv[{config.block_n}, {BLOCK_K}]>" if config.tma else "*fp8e4nv",
    }
    signature = {
        name: "constexpr" if name in constants else POINTERS.get(name) or descriptors.get(name) or "i32"
        for name in names
    }
    aligned = [i for i, name in enumerate(names) if name in POINTERS or name in ALIGNED]
    source = ASTSource(
        fn=fp8_gemm._fp8_gemm_kernel,
        signature=signature,
        constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 64), options=options)


def steady_loop(sass: list[str]) -> list[str]:
    """The instructions of the smallest backward-branch loop that issues MMAs."""
    labels = {m.group(1): i for i, line in enumerate(sass) if (m := re.match(r"^\s*(\.L_x_\d+):", line))}
    best: list[str] | None = None
    for i, line in enumerate(sass):
        m = re.search(r"BRA `\((\.L_x_\d+)\)", line)
        if m and labels.get(m.group(1), len(sass)) < i:
            body = [x for x in sass[labels[m.group(1)] : i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
            if any("MMA" in x for x in body) and (best is None or len(body) < len(best)):
                best = body
    return best or []


_STORE_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}


def store_widths(sass: list[str]) -> Counter:
    """Bytes per thread of each global store instruction in the kernel -> how many there are."""
    widths: Counter = Counter()
    for line in sass:
        if m := re.search(r"\bSTG((?:\.\w+)*) ", line):
            suffixes = [part for part in m.group(1).split(".") if part]
            widths[max([_STORE_BYTES.get(part, 4) for part in suffixes if part != "E"] or [4])] += 1
    return widths


def copies_of_fresh_loads(loop: list[str]) -> int:
    """Register copies, inside the loop, of a value the same iteration loaded from global memory.
    Such a copy (ptxas's answer to a loop-carried load whose old value is still live) waits out
    the whole load latency at that point."""
    loaded_at: dict[str, int] = {}
    copies = 0
    for i, line in enumerate(loop):
        if m := re.search(r"LDG\.E(?:\.\w+)* (R\d+),", line):
            loaded_at[m.group(1)] = i
        if (m := re.search(r"MOV(?:\.U32)? R\d+, (?:RZ, RZ, )?(R\d+) ;", line)) and m.group(1) in loaded_at:
            copies += 1
    return copies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_gemm_case_arguments(parser)
    parser.add_argument("--sass", action="store_true", help="also print the steady loop's instructions")
    args = parser.parse_args()
    config = gemm_case_config(args)
    if config.gluon:  # the tables' kernel at M <= 32 (`kernels/fp8_gemm_gluon.py`)
        from shoal.kernels.fp8_gemm_gluon import compile_for_hopper

        compiled = compile_for_hopper(
            args.m, args.n, args.k, block_m=config.block_m, block_n=config.block_n,
            split_k=config.split_k, swapped=config.swap_ab, num_stages=config.num_stages,
            tiles_before_wait=config.tiles_before_wait, leave_partials=config.split_k > 1,
            bf16_partials=config.bf16_partials, tma_scales=config.tma_scales,
            vector_stores=config.vector_stores,
        )  # fmt: skip
    else:
        compiled = compile_split_k(args.k, config)
    sass = with_cubin(compiled, disassemble)
    loop = steady_loop(sass.splitlines())
    opcodes = Counter(
        re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0].split(".")[0] for line in loop
    )
    registers = registers_of(compiled)
    widths = sorted(store_widths(sass.splitlines()).items())
    stores = ", ".join(f"{count} x {width} B" for width, count in widths)
    ttgir = compiled.asm["ttgir"]
    pipelined = ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy")
    print(config)
    if args.sass:
        print("\n".join(loop))
    print(
        f"steady loop: {len(loop)} instructions, {opcodes['BAR']} CTA barriers, {opcodes['SHFL']} shuffles, "
        f"{opcodes['LDS']} LDS / {opcodes['STS']} STS, {opcodes['LDG']} LDG, "
        f"{opcodes['QGMMA'] + opcodes['HGMMA'] + opcodes['HMMA']} MMA instructions, "
        f"{copies_of_fresh_loads(loop)} copies of values loaded in the same iteration; "
        f"async copies in the TTGIR: {pipelined} ({'pipelined' if pipelined else 'NOT pipelined'}); "
        f"global stores {stores or 'none'}; "
        f"{compiled.metadata.shared} B shared memory, {registers} registers per thread; "
        f"{programs_per_sm(registers, config.num_warps, compiled.metadata.shared)} programs per SM"
    )


def with_cubin(compiled, read):
    """`read(path)` of the build's cubin, written to a temporary file."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return read(cubin)


def disassemble(cubin: Path) -> str:
    """The cubin's SASS (`nvdisasm -c`, bundled with Triton)."""
    nvdisasm = Path(triton.__file__).parent / "backends/nvidia/bin/nvdisasm"
    return subprocess.run(
        [str(nvdisasm), "-c", str(cubin)], capture_output=True, text=True, check=True
    ).stdout


def registers_of(compiled) -> int:
    """Registers per thread of a build (`resource_usage` of its cubin)."""
    return with_cubin(compiled, resource_usage)["REG"]


def resource_usage(cubin: Path) -> dict[str, int]:
    """The kernel's `cuobjdump --dump-resource-usage` counts (REG, STACK, SHARED, LOCAL, ...)."""
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    out = subprocess.run(
        [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    return {key: int(value) for key, value in re.findall(r"(\w+):(\d+)", out.split("Resource usage:")[-1])}


def programs_per_sm(registers: int, warps: int, shared: int) -> int:
    """Resident programs per H100/H200 SM by its 64K registers, 228 KB of shared memory (1 KB of
    it reserved per program) and 64 warps: what decides whether a grid runs in one wave."""
    by_registers = 65536 // (max(registers, 1) * 32 * warps)
    by_shared = (228 * 1024) // (shared + 1024)
    return min(by_registers, by_shared, 64 // warps)


if __name__ == "__main__":
    main()
