"""Compile the decode attention for the H200 (sm_90) on any machine, GPU or not, as the engine
launches each tuned entry, and print what decides its speed before it runs: how many key/value
buffers Triton's pipeliner gave the key loop, the registers and shared memory per program, the
programs per SM they allow, and how many waves the entry's largest batch then takes.

What it catches: a key loop whose loads the pipeliner left one buffer short (a page-table load
inside the loop does that), or a build whose registers cost it a program per SM, which can put a
batch's programs in two waves (`AttentionConfig.max_registers` caps it).

Usage: python scripts/inspect_attention_sm90.py [--capacity 32768] [--kv bf16 fp8]
(`--capacity`: the block tables' width in keys, which sets the split count; `shoal serve` uses
the model's 32,768, the engine bench its requests' length plus a margin).
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass

import triton
from inspect_gemm_sm90 import programs_per_sm, registers_of  # a sibling script: scripts/ is on the path
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from shoal.kernels import attention

H200_SMS = 132
# S2-Pro's slow transformer: 32 query heads over 8 kv heads of 128.
HQ, HKV, HEAD_DIM = 32, 8, 128
# The integers a launch at these shapes passes that Triton specializes as divisible by 16.
ALIGNED = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_bt", "stride_kp", "stride_kt",
           "stride_kh", "stride_q8", "num_q_heads")  # fmt: skip


@dataclass(frozen=True)
class EntryBuild:
    """One tuned entry's decode build at a table width, and what it allows."""

    kv: str
    batch: int
    splits: int
    block_n: int
    num_stages: int
    buffers: int  # key (and value) buffers of the key loop
    registers: int
    shared_bytes: int
    per_sm: int

    @property
    def programs(self) -> int:
        return self.batch * HKV * self.splits

    @property
    def waves(self) -> int:
        return math.ceil(self.programs / (H200_SMS * self.per_sm))

    def line(self) -> str:
        return (
            f"{self.kv} batch {self.batch}: {self.splits} split(s), {self.block_n}-key blocks, "
            f"{self.num_stages} stages: {self.buffers} key/value buffer(s), {self.registers} registers, "
            f"{self.shared_bytes} B shared, {self.per_sm} programs per SM, {self.programs} programs: "
            f"{self.waves} wave(s)"
        )


def compile_decode(config: attention.AttentionConfig, splits: int, kv_fp8: bool):
    """The sm_90 build `paged_decode_attention` runs for `config` at `splits` splits (FP8 output
    for the o projection, PDL on), and its key block."""
    kernel = attention._paged_attention_kernel
    config = attention.split_launch_config(config, splits)
    split = splits > 1
    fused = split and config.fused_merge
    block_g = triton.next_power_of_2(HQ // HKV)
    constants = {
        "GROUP": HQ // HKV, "BLOCK_G": block_g, "BLOCK_M": 1, "BLOCK_R": max(16, block_g),
        "BLOCK_N": config.block_n,
        "PAGE": attention.PAGE_SIZE, "HEAD_DIM": HEAD_DIM, "IS_DECODE": True, "CAUSAL": False,
        "HAS_KV_START": False, "WRITE_PARTIAL": split, "FUSED_MERGE": fused,
        "BLOCK_S": triton.next_power_of_2(max(splits, config.max_splits)) if fused else 1,
        "UPCAST": False, "QUANT_OUT": True, "KV_FP8": kv_fp8, "USE_PDL": True,
    }  # fmt: skip
    cache = "*fp8e4nv" if kv_fp8 else "*bf16"
    pointers = {"q_ptr": "*bf16", "k_ptr": cache, "v_ptr": cache, "k_scale_ptr": "*fp32",
                "v_scale_ptr": "*fp32", "out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32",
                "q8_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "scale_log2e": "fp32"}  # fmt: skip
    names = kernel.arg_names
    # The rest: int32 tables, lengths and counters, and integer strides.
    default = {name: "*i32" if name.endswith("_ptr") else "i32" for name in names}
    signature = {
        name: "constexpr" if name in constants else pointers.get(name, default[name]) for name in names
    }
    aligned = [i for i, name in enumerate(names) if name.endswith("_ptr") or name in ALIGNED]
    source = ASTSource(
        kernel, signature, constexprs={(names.index(name),): value for name, value in constants.items()},
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )  # fmt: skip
    limit = attention._register_limit(config)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages, **limit}
    return triton.compile(source, target=GPUTarget("cuda", 90, 64), options=options), constants["BLOCK_N"]


def key_buffers(ttgir: str, block_n: int) -> int:
    """The leading dimension of the key tile's shared-memory allocation: the pipeliner's buffers."""
    shapes = re.findall(r"ttg\.local_alloc[^\n]*-> !ttg\.memdesc<(\d+)x(\d+)x(\d+)x", ttgir)
    counts = [int(n) for n, rows, cols in shapes if int(rows) == block_n and int(cols) == HEAD_DIM]
    return max(counts, default=0)


def inspect_entry(kv: str, batch: int, config: attention.AttentionConfig, capacity: int) -> EntryBuild:
    pages = -(-capacity // attention.PAGE_SIZE)  # the launch counts the table's whole pages
    splits = attention.choose_num_splits(batch, HKV, pages * attention.PAGE_SIZE, config)
    compiled, block_n = compile_decode(config, splits, kv == "fp8")
    registers = registers_of(compiled)
    shared = compiled.metadata.shared
    return EntryBuild(
        kv, batch, splits, block_n, config.num_stages, key_buffers(compiled.asm["ttgir"], block_n),
        registers, shared, programs_per_sm(registers, config.num_warps, shared),
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--capacity", type=int, default=32768, help="block table width in keys")
    parser.add_argument("--kv", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    args = parser.parse_args()
    tables = {"bf16": attention.TUNED_DECODE_CONFIGS, "fp8": attention.TUNED_DECODE_CONFIGS_FP8_KV}
    for kv in args.kv:
        for batch, config in sorted(tables[kv].items()):
            print(inspect_entry(kv, batch, config, args.capacity).line(), flush=True)


if __name__ == "__main__":
    main()
