"""`shoal bench attention`: paged decode attention against torch SDPA (GPU only).

S2-Pro's slow-layer shapes (32 q heads, 8 kv heads, head_dim 128, bf16). For batch 1/16/64 x
context 1k/4k/8k it times `paged_decode_attention` with the engine's tuned config (pages scattered
at random) against `F.scaled_dot_product_attention(enable_gqa=True)` on contiguous KV, then short
rows in tables 32k keys wide (`shoal serve`'s width, which sets the split count). Each decode case
is also timed on an FP8 KV cache ("FP8-KV µs", "x bf16": its ratio to the bf16 time). Times are
medians of CUDA-graph replays cycling input copies (so a small KV does not sit in L2); "GB/s" is the
fewest bytes the step must read over the time, beside the read-only ceiling.

`--sweep` also times the `SWEEP` configs per shape (compiled first in parallel) and prints each
batch's winner; `--write-table` merges those into `kernels/tuned/attention_decode.json`.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from shoal.bench.gemm import memory_ceilings, precompile
from shoal.bench.timing import time_graph_ms
from shoal.kernels.attention import (
    PAGE_SIZE,
    AttentionConfig,
    choose_num_splits,
    decode_config,
    paged_decode_attention,
    write_decode_table,
)
from shoal.kernels.reference import dequantize_kv, quantize_kv

HQ, HKV, HEAD_DIM = 32, 8, 128
BATCHES = (1, 16, 64)
CONTEXTS = (1024, 4096, 8192)
SHORT_CONTEXTS = (332, 512)  # S2 prompts with a voice prompt and a few seconds of audio
L2_FLUSH_BYTES = 256 << 20  # inputs cycled until at least this much is touched per replay
REPEATS = 50  # timed replays per case (`bench/timing.py`)
# Split-KV sizing (target programs, shortest split) x keys per iteration x warps x stages x merge.
SPLITS = ((264, 256), (264, 128), (528, 128), (528, 64))
SWEEP = [
    AttentionConfig(
        block_n=n, num_warps=w, num_stages=st, target_programs=t, min_split_tokens=m, fused_merge=f
    )
    for (t, m), n, w, st, f in itertools.product(SPLITS, (64, 128), (4, 8), (2, 3), (False, True))
]


def _compile_job(config: AttentionConfig) -> str | None:
    """In a worker process: small launches with this config at the benchmark's specializations
    (block-table widths), so Triton's on-disk cache holds every variant the timing pass needs
    (split counts are run-time arguments)."""
    try:
        case = DecodeCase([1024], contiguous=False)
        q, k, v, tables, _ = case.inputs[0]
        for splits in (4, 1):
            paged_decode_attention(q, k, v, tables, case.seq_lens, num_splits=splits, config=config)
        torch.cuda.synchronize()
        return None
    except Exception as error:  # noqa: BLE001 - reported; the timing pass skips it too
        return f"{type(error).__name__}: {str(error)[:80]}"


def kv_bytes(tokens: int) -> int:
    return tokens * HKV * HEAD_DIM * 2 * 2


def fp8_kv(k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """A bf16 page pool pair as the FP8 KV cache holds it: the keyword arguments of the kernels
    (`k_pages`/`v_pages` e4m3, `k_scales`/`v_scales` fp32 [num_pages, page_size, Hkv])."""
    (k8, k_scales), (v8, v_scales) = quantize_kv(k), quantize_kv(v)
    return {"k_pages": k8, "v_pages": v8, "k_scales": k_scales, "v_scales": v_scales}


class DecodeCase:
    """`copies` independent inputs for one (batch, lens) shape, paged and contiguous."""

    def __init__(self, seq_lens: list[int], contiguous: bool = True, capacity: int = 0) -> None:
        """`capacity`: block tables this many keys wide (the engine sizes them for its longest
        sequence, and the split count follows the width), the columns past each row's pages
        unused."""
        batch, longest = len(seq_lens), max(seq_lens)
        touched = kv_bytes(sum(seq_lens))
        self.copies = max(1, min(64, math.ceil(L2_FLUSH_BYTES / touched)))
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        pages_per_seq = -(-longest // PAGE_SIZE)
        num_pages = batch * pages_per_seq
        self.inputs = []
        for _ in range(self.copies):
            perm = torch.randperm(num_pages, device="cuda").to(torch.int32)
            width = max(pages_per_seq, -(-capacity // PAGE_SIZE))
            tables = torch.zeros(batch, width, dtype=torch.int32, device="cuda")
            tables[:, :pages_per_seq] = perm.view(batch, pages_per_seq)
            shape = (num_pages, PAGE_SIZE, HKV, HEAD_DIM)
            k = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
            v = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
            q = torch.randn(batch, HQ, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
            dense = None
            if contiguous:  # SDPA's [B, H, L, D] layout, all rows at the longest length
                dense = (
                    torch.randn(batch, HKV, longest, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                    torch.randn(batch, HKV, longest, HEAD_DIM, dtype=torch.bfloat16, device="cuda"),
                )
            self.inputs.append((q, k, v, tables, dense))
        self._fp8_inputs: list[tuple] | None = None

    def fp8_inputs(self) -> list[tuple]:
        """(q, FP8 KV kwargs, tables) per copy: the same pools quantized, built on first use."""
        if self._fp8_inputs is None:
            self._fp8_inputs = [(q, fp8_kv(k, v), tables) for q, k, v, tables, _ in self.inputs]
        return self._fp8_inputs

    def paged(self, config: AttentionConfig) -> float:
        def step() -> None:
            for q, k, v, tables, _ in self.inputs:
                paged_decode_attention(q, k, v, tables, self.seq_lens, config=config)

        return time_graph_ms(step, repeats=REPEATS, calls_per_replay=self.copies)

    def paged_fp8(self, config: AttentionConfig) -> float:
        """`paged` with the FP8 KV cache (same copies, so the same L2 flushing or more)."""
        inputs = self.fp8_inputs()

        def step() -> None:
            for q, kv, tables in inputs:
                paged_decode_attention(q, block_tables=tables, seq_lens=self.seq_lens, config=config, **kv)

        return time_graph_ms(step, repeats=REPEATS, calls_per_replay=self.copies)

    def sdpa(self) -> float:
        def step() -> None:
            for q, _, _, _, (k, v) in self.inputs:
                F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)

        return time_graph_ms(step, repeats=REPEATS, calls_per_replay=self.copies)


def check_against_sdpa() -> None:
    """A quick correctness guard before timing: paged kernel vs SDPA on the same values."""
    case = DecodeCase([777, 1500], contiguous=False)
    q, k, v, tables, _ = case.inputs[0]
    out = paged_decode_attention(q, k, v, tables, case.seq_lens)
    for b, length in enumerate([777, 1500]):
        positions = torch.arange(length, device="cuda")
        pages = tables[b].long()[positions // PAGE_SIZE]
        keys = k[pages, positions % PAGE_SIZE].permute(1, 0, 2)[None]
        values = v[pages, positions % PAGE_SIZE].permute(1, 0, 2)[None]
        ref = F.scaled_dot_product_attention(q[b : b + 1, :, None], keys, values, enable_gqa=True)[:, :, 0]
        error = ((out[b : b + 1].float() - ref.float()).norm() / ref.float().norm()).item()
        assert error < 1e-2, f"paged decode attention disagrees with SDPA: {error:.2e}"
    kv = case.fp8_inputs()[0][1]  # FP8 KV: as the bf16 kernel on the dequantized pools
    out = paged_decode_attention(q, block_tables=tables, seq_lens=case.seq_lens, **kv)
    k_deq, v_deq = (dequantize_kv(kv[f"{x}_pages"], kv[f"{x}_scales"], torch.bfloat16) for x in "kv")
    ref = paged_decode_attention(q, k_deq, v_deq, tables, case.seq_lens)
    error = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    assert error < 1e-2, f"FP8-KV decode attention disagrees with bf16 on the dequantized pools: {error:.2e}"


def _launch_key(config: AttentionConfig, batch: int, context: int) -> tuple:
    """What a config launches at this shape: configs with one key time the same."""
    splits = choose_num_splits(batch, HKV, context, config)
    return (config.block_n, config.num_warps, config.num_stages, splits, config.fused_merge and splits > 1)


def sweep_case(case: DecodeCase, batch: int, context: int) -> dict[AttentionConfig, float]:
    """ms of every `SWEEP` config at this case, each distinct launch timed once."""
    by_key: dict[tuple, float] = {}
    for config in SWEEP:
        key = _launch_key(config, batch, context)
        if key not in by_key:
            try:
                by_key[key] = case.paged(config)
            except Exception as error:  # a config the compiler rejects (e.g. out of shared memory)
                print(f"  skipped {config}: {type(error).__name__}")
                by_key[key] = math.inf
    return {config: by_key[_launch_key(config, batch, context)] for config in SWEEP}


def per_batch_winners(sweeps: dict[int, list[dict]]) -> dict[int, AttentionConfig]:
    """Per batch: the config with the smallest sum over contexts of (time / that context's best)."""
    winners = {}
    for batch, per_context in sweeps.items():
        score: dict[AttentionConfig, float] = {}
        for timings in per_context:
            best = min(timings.values())
            for config, t in timings.items():
                score[config] = score.get(config, 0.0) + t / best
        winners[batch] = min(score, key=score.get)
    return winners


def run_attention_bench(
    sweep: bool = False, precompile_only: bool = False, write_table: bool = False
) -> list[dict]:
    """Print the table; return its rows (times in µs)."""
    if sweep:
        precompile(SWEEP, _compile_job)
        if precompile_only:
            return []
    check_against_sdpa()
    ceilings = memory_ceilings()
    copy_gbs, read_gbs = ceilings["copy"] / 1e9, ceilings["read"] / 1e9
    print(f"device: {torch.cuda.get_device_name()}")
    rows = []
    sweeps: dict[int, list[dict]] = {}
    for batch, context in itertools.product(BATCHES, CONTEXTS):
        case = DecodeCase([context] * batch)
        # The config the engine launches at this batch (the tuned table), not DEFAULT_CONFIG.
        ours, sdpa = case.paged(decode_config(batch)), case.sdpa()
        row = {"case": f"decode b={batch} ctx={context}", "bytes": kv_bytes(batch * context)}
        row.update(
            ours_us=ours * 1e3, sdpa_us=sdpa * 1e3,
            fp8_kv_us=case.paged_fp8(decode_config(batch, kv_fp8=True)) * 1e3,
        )  # fmt: skip
        if sweep:
            timings = sweep_case(case, batch, context)
            config = min(timings, key=timings.get)
            row.update(tuned_us=timings[config] * 1e3, config=config)
            row["splits"] = choose_num_splits(batch, HKV, context, config)
            sweeps.setdefault(batch, []).append(timings)
            print(
                f"{row['case']}: default {ours * 1e3:.1f} us, best {timings[config] * 1e3:.1f} us, "
                f"SDPA {sdpa * 1e3:.1f} us, {row['splits']} splits, {config!r}"
            )
        rows.append(row)
        del case
    # Engine-like short rows in tables 32k keys wide (`shoal serve` sizes them for the model's
    # max_seq_len): the split count is then the largest.
    for batch, context in itertools.product((1, 16), SHORT_CONTEXTS):
        case = DecodeCase([context] * batch, capacity=32768)
        config = decode_config(batch)
        row = {"case": f"decode b={batch} ctx={context} (32k table)", "bytes": kv_bytes(batch * context)}
        row.update(ours_us=case.paged(config) * 1e3, sdpa_us=case.sdpa() * 1e3)
        row["fp8_kv_us"] = case.paged_fp8(config) * 1e3
        rows.append(row)
        del case
    print(f"ceilings: copy {copy_gbs:.0f} GB/s (read+write), read {read_gbs:.0f} GB/s")
    print("\n".join(table_lines(rows, read_gbs)))
    if sweeps:
        winners = per_batch_winners(sweeps)
        print("winners (best summed over contexts, relative to each context's best):")
        for batch, config in winners.items():
            print(f"    {batch}: {config!r}")
        if write_table:
            print(f"wrote {write_decode_table(winners)}")
    return rows


def table_lines(rows: list[dict], read_gbs: float) -> list[str]:
    """The table of `run_attention_bench`'s rows (times in µs): bf16 paged ("ours") against SDPA,
    its bandwidth, and where timed the FP8-KV time and its ratio to the bf16 paged time."""
    header = f"{'case':34} {'min bytes':>10} {'ours µs':>9} {'SDPA µs':>9} {'speedup':>8}"
    lines = [f"{header} {'GB/s':>7} {'of read':>8} {'FP8-KV µs':>10} {'x bf16':>7}"]
    for row in rows:
        gbs = row["bytes"] / row["ours_us"] / 1e3
        line = (
            f"{row['case']:34} {row['bytes'] / 1e6:9.1f}M {row['ours_us']:9.1f} {row['sdpa_us']:9.1f} "
            f"{row['sdpa_us'] / row['ours_us']:7.2f}x {gbs:7.0f} {gbs / read_gbs:7.0%}"
        )
        if "fp8_kv_us" in row:
            line += f" {row['fp8_kv_us']:10.1f} {row['fp8_kv_us'] / row['ours_us']:6.2f}x"
        lines.append(line)
        if "tuned_us" in row:
            c = row["config"]
            gbs = row["bytes"] / row["tuned_us"] / 1e3
            lines.append(
                f"{'  best swept':34} {'':10} {row['tuned_us']:9.1f} {'':9} "
                f"{row['sdpa_us'] / row['tuned_us']:7.2f}x {gbs:7.0f} {gbs / read_gbs:7.0%}  "
                f"n={c.block_n} w={c.num_warps} st={c.num_stages} tp={c.target_programs} "
                f"min={c.min_split_tokens} fused={c.fused_merge} splits={row['splits']}"
            )
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", action="store_true", help="also time the SWEEP configs per shape")
    parser.add_argument("--precompile-only", action="store_true", help="sweep: only fill the compile cache")
    parser.add_argument(
        "--write-table", action="store_true", help="sweep: merge the winners into the tuned decode table"
    )


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("the attention benchmark needs a CUDA GPU")
        return 2
    run_attention_bench(args.sweep, args.precompile_only, args.write_table)
    return 0
