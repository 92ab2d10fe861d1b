"""Compile the decode step's RMSNorm (`kernels/norm_rope.py`) for the H200 (sm_90) on any machine,
GPU or not, and print how many dependent rounds its loads take to reach memory after the PDL wait.

Why: the norm's cost at decode sizes is latency, and it was written to issue every load in one
round. ptxas decides otherwise unless the build states a register limit: it interleaves the loads
of the split-K partials with the sums that consume them, so loads issued after the first sum wait
for that sum's data; with `NORM_MAX_REGISTERS` the loads go out in one round. The count is read
off the SASS: a round ends at the first instruction that reads a
register an outstanding global load writes.

With `--gather` the build is a fast pass's first norm gathering its code embeddings
(`GatheredRows`): the ids are one round, the rows a second, then the reduction.

Usage: python scripts/inspect_norm_sm90.py [--parts 7] [--partials fp32|bf16] [--slice-groups 4]
[--warps 8] [--max-registers 255|0] [--gather]
"""

from __future__ import annotations

import argparse
import re

import triton
from inspect_gemm_sm90 import disassemble, registers_of, with_cubin  # a sibling script
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shoal.kernels import norm_rope
from shoal.kernels.quant import FP8_MAX, GROUP, MIN_SCALE

DIM = 2560  # S2-Pro's hidden size
POINTERS = {"residual_ptr": "*bf16", "residual_out_ptr": "*bf16", "weight_ptr": "*bf16",
            "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "ids_ptr": "*i32", "eps": "fp32"}  # fmt: skip
# The integers a launch at S2-Pro's width passes (Triton specializes those divisible by 16).
INTEGERS = {"dim": DIM, "stride_x": DIM, "stride_xs": DIM, "stride_r": DIM, "stride_ro": DIM, "stride_o": DIM}


def compile_decode_norm(
    parts: int, partials: str, slice_groups: int, warps: int, max_registers: int | None, gather: bool = False
):
    """The sm_90 build of the decode step's norm: residual add, RMSNorm, fused FP8 quantization,
    a row of S2-Pro's width split over programs of `slice_groups` groups, x the `parts` split-K
    partials (`partials` "fp32" or "bf16"; parts 0: a bf16 row), with PDL. `gather`: no residual
    add, x a bf16 row gathered by an int32 id (parts must be 0)."""
    kernel = norm_rope._rms_norm_kernel
    main_groups, tail_groups = norm_rope.row_tiles(DIM)
    constants = {
        "GROUPS": triton.next_power_of_2(triton.cdiv(DIM, GROUP)), "SLICE_GROUPS": slice_groups,
        "MAIN_GROUPS": main_groups, "TAIL_GROUPS": tail_groups,
        "PARTS": parts, "HAS_RESIDUAL": not gather, "GATHER": gather, "EMULATE": False, "QUANT_OUT": True,
        "GROUP_SIZE": GROUP, "FP8_MAX_": FP8_MAX, "MIN_SCALE_": MIN_SCALE, "USE_PDL": True,
    }  # fmt: skip
    names = kernel.arg_names
    x_type = {"fp32": "*fp32", "bf16": "*bf16"}[partials] if parts else "*bf16"
    signature = {name: "constexpr" if name in constants else POINTERS.get(name, "i32") for name in names}
    signature["x_ptr"] = x_type
    aligned = [i for i, name in enumerate(names) if name.endswith("_ptr") or INTEGERS.get(name, 1) % 16 == 0]
    source = ASTSource(
        kernel, signature, constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )  # fmt: skip
    options = {"num_warps": warps, **({"maxnreg": max_registers} if max_registers else {})}
    return triton.compile(source, target=GPUTarget("cuda", 90, 64), options=options)


def sass_lines(compiled) -> list[str]:
    """The build's instructions, one per line, without addresses."""
    return [
        re.sub(r"/\*[0-9a-f]+\*/", "", line).strip()
        for line in with_cubin(compiled, disassemble).splitlines()
        if re.search(r"/\*[0-9a-f]{4}\*/", line)
    ]


def load_rounds(sass: list[str], start: str = "ACQBULK", stop: str = "SHFL") -> list[int]:
    """The global loads of each dependent round between the PDL wait (`start`) and the first
    cross-lane reduction (`stop`): a round ends at the first instruction reading a register that
    an outstanding load writes (it waits for that load, so later loads start a new round)."""
    begin = next((i for i, line in enumerate(sass) if start in line), 0)
    end = next((i for i, line in enumerate(sass) if stop in line and i > begin), len(sass))
    rounds, pending, count = [], set(), 0
    for line in sass[begin:end]:
        match = re.match(r"(@!?U?P\w+\s+)?(\S+)\s+(.*?);", line)
        if not match:
            continue
        opcode, operands = match.group(2), match.group(3)
        registers = [int(r) for r in re.findall(r"\bR(\d+)\b", operands)]
        sources = registers if opcode.startswith("STG") else registers[1:]
        if pending and pending.intersection(sources):
            rounds.append(count)
            pending, count = set(), 0
        if re.fullmatch(r"LDG(\.\w+)*", opcode) and registers:  # not LDGSTS (cp.async)
            width = 4 if ".128" in opcode else 2 if ".64" in opcode else 1
            pending.update(range(registers[0], registers[0] + width))
            count += 1
    return rounds + [count] if count else rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=7, help="split-K partials summed (0: a bf16 row)")
    parser.add_argument("--partials", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--slice-groups", type=int, default=4)
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument(
        "--max-registers", type=int, default=norm_rope.NORM_MAX_REGISTERS, help="0: ptxas's own choice"
    )
    parser.add_argument("--gather", action="store_true", help="a fast pass's first norm gathering its codes")
    args = parser.parse_args()
    if args.gather and args.parts:
        parser.error("--gather reads a gathered bf16 row: use --parts 0")
    compiled = compile_decode_norm(
        args.parts, args.partials, args.slice_groups, args.warps, args.max_registers or None, args.gather
    )
    rounds = load_rounds(sass_lines(compiled))
    print(
        f"norm{' gathering its rows' if args.gather else ''}, {args.parts} {args.partials} partials, "
        f"{args.slice_groups} groups per program, "
        f"{args.warps} warps, register limit {args.max_registers or 'none'}: "
        f"{registers_of(compiled)} registers, {len(rounds)} round(s) of loads {rounds}"
    )


if __name__ == "__main__":
    main()
