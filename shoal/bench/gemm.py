"""`shoal bench gemm`: the FP8 GEMM at S2-Pro decode shapes against torch baselines (GPU only).

Every variant is timed as CUDA-graph replays rotating over enough weight sets that L2 cannot serve
them. Bandwidth counts weight bytes only, beside two ceilings measured in the same run
(`memory_ceilings`): a device-to-device copy and a pure read (a GEMM's weight stream's limit).

Variants: ours W8A16, ours W8A8 quantizing inline, ours W8A8 after the quant launch,
`torch._scaled_mm` with block-wise scales (M zero-padded where cuBLAS rejects it, and the row
says so), bf16 cuBLAS; and the whole SwiGLU MLP in bf16 eager,
`torch.compile`d and ours. `--sweep` times candidate configs per (N, K, M) for pre-quantized (W8A8)
and bf16 (W8A16) activations, compiled first in parallel processes, and prints the best per shape;
`--write-table` merges them into `kernels/tuned/fp8_gemm.json`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from shoal.bench.timing import cuda_elapsed_ms, per_call_ms, sample_ms, time_graph_ms

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
M_VALUES = (1, 4, 16, 64, 128)
ROTATION_BYTES = 400 * 2**20  # well past the 50 MB L2
PROBE_BYTES = 2 * 2**30  # 2 GiB buffers for the bandwidth ceilings
SCALED_MM_PAD = (1, 2, 4, 8, 16)  # M sizes tried, smallest first, when cuBLAS rejects a small M


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Grid-stride sum of x: every byte read once, 16-byte loads, one float written per program."""
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(acc))


def _time_events(fn: Callable[[], object], reps: int, trials: int = 5) -> float:
    """Median seconds per call over `trials` batches of `reps` back-to-back eager calls (eager on
    purpose: `memory_ceilings` explains why not a graph)."""
    fn()
    torch.cuda.synchronize()
    return per_call_ms(sample_ms(fn, trials, reps, cuda_elapsed_ms), reps) / 1e3


def memory_ceilings(verbose: bool = True) -> dict[str, float]:
    """Bytes/s: 'copy' (device-to-device, read + write counted) and 'read' (read-only), each the
    best of two methods on 2 GiB buffers, 20 back-to-back calls of about 1 ms each (launch cost
    under 1%). Eager launches, not a graph: captured in a CUDA graph the copy becomes a memcpy
    node, which reads about 30% slower than the kernels do."""
    n = PROBE_BYTES // 4
    src = torch.empty(n, dtype=torch.float32, device="cuda").uniform_(-1, 1)
    dst = torch.empty_like(src)
    copies = {
        "copy_": _time_events(lambda: dst.copy_(src), 20),
        "mul-kernel": _time_events(lambda: torch.mul(src, 1.0, out=dst), 20),
    }
    programs = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    partial = torch.empty(programs, dtype=torch.float32, device="cuda")
    reads = {
        "triton-sum": _time_events(
            lambda: _read_kernel[(programs,)](src, partial, n, BLOCK=4096, num_warps=8), 20
        ),
        "torch.sum": _time_events(lambda: src.sum(), 20),
    }
    result = {
        "copy": max(2 * PROBE_BYTES / t for t in copies.values()),
        "read": max(PROBE_BYTES / t for t in reads.values()),
    }
    if verbose:
        detail = ", ".join(f"{k} {2 * PROBE_BYTES / t / 1e12:.2f}" for k, t in copies.items())
        detail += "; " + ", ".join(f"{k} {PROBE_BYTES / t / 1e12:.2f}" for k, t in reads.items())
        print(
            f"ceilings on 2 GiB: copy {result['copy'] / 1e12:.2f} TB/s (read+write), "
            f"read {result['read'] / 1e12:.2f} TB/s  [{detail}]"
        )
    return result


def _weight_sets(n: int, k: int, count: int) -> list[dict[str, torch.Tensor]]:
    from shoal.kernels import reference

    sets = []
    for _ in range(count):
        w = torch.randn(n, k, device="cuda") * 0.02
        w_q, w_scale = reference.quantize_weight(w)
        sets.append({"bf16": w.to(torch.bfloat16), "w_q": w_q, "w_scale": w_scale})
    return sets


def _torch_act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group quantization in plain torch ops, scales outer-dim-major as _scaled_mm wants."""
    m, k = x.shape
    groups = x.float().view(m, k // 128, 128)
    scale = groups.abs().amax(dim=2).clamp_min(1e-12) / 448.0
    q = (groups / scale[:, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    return q, scale.t().contiguous().t()


def _scaled_mm_blockwise(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    q, scale = _torch_act_quant(x)
    w_scale = weights["w_scale"].t()  # (K/128, N/128), outer-dim-major
    return torch._scaled_mm(q, weights["w_q"].t(), scale, w_scale, out_dtype=torch.bfloat16)


def scaled_mm_rows(m: int, k: int, n: int = 256) -> int | None:
    """The smallest M >= m in SCALED_MM_PAD (or m itself) that block-wise `_scaled_mm` accepts."""
    w = _weight_sets(n, k, 1)[0]
    for rows in [r for r in SCALED_MM_PAD if r >= m] or [m]:
        try:
            _scaled_mm_blockwise(torch.randn(rows, k, device="cuda", dtype=torch.bfloat16), w)
            torch.cuda.synchronize()
            return rows
        except RuntimeError:
            continue
    return None


def _padded(fn: Callable, rows: int) -> Callable:
    """fn on x zero-padded to `rows` rows (the pad is built once, outside the timed graph)."""
    cache: dict[int, torch.Tensor] = {}

    def call(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        if x.data_ptr() not in cache:
            cache.clear()
            cache[x.data_ptr()] = torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])
        return fn(cache[x.data_ptr()], w)[: x.shape[0]]

    return call


def _variants(shape: str) -> dict[str, Callable]:
    from shoal.kernels import fp8_gemm, quant

    k_mult = 2 if shape == "down" else 1  # down reads the gate|up output: SwiGLU fused in
    variants = {
        "ours_w8a16": lambda x, w: fp8_gemm.fp8_linear(x, w["w_q"], w["w_scale"], False, k_mult == 2),
        "ours_w8a8_inline": lambda x, w: fp8_gemm.fp8_linear(x, w["w_q"], w["w_scale"], True, k_mult == 2),
        "ours_w8a8_quant": lambda x, w: fp8_gemm.fp8_gemm(
            *(quant.swiglu_quantize(x) if k_mult == 2 else quant.quantize_activations(x)),
            w["w_q"],
            w["w_scale"],
        ),
        "bf16_cublas": lambda x, w: F.linear(x[:, : w["bf16"].shape[1]], w["bf16"]),
        "scaled_mm": lambda x, w: _scaled_mm_blockwise(x[:, : w["w_q"].shape[1]], w),
    }
    return variants


def time_variant(
    fn: Callable, x, sets: list[dict[str, torch.Tensor]], replays: int = 50, trials: int = 5
) -> float:
    """Seconds per GEMM, rotating over the weight sets inside one graph; each of the `trials`
    samples times `replays` back-to-back replays (`bench/timing.py`)."""

    def call() -> list:
        return [fn(x, w) for w in sets]  # outputs held to the end, as before the shared helper

    ms = time_graph_ms(call, repeats=trials, replays_per_sample=replays, calls_per_replay=len(sets))
    return ms / 1e3


def run_gemm_bench(
    shapes: dict[str, tuple[int, int]] = SHAPES, m_values=M_VALUES, mlp: bool = True,
    only: list[str] | None = None,
) -> list[dict]:  # fmt: skip
    """Times every variant (or those whose names start with one of `only`); prints and returns
    one row per (shape, M, variant)."""
    ceilings = memory_ceilings()
    print(f"{'shape':>8} {'M':>4} {'variant':>22} {'us':>8} {'TB/s':>6} {'%copy':>6} {'%read':>6}")
    rows = []
    for name, (n, k) in shapes.items():
        count = max(2, -(-ROTATION_BYTES // (n * k)))
        sets = _weight_sets(n, k, count)
        for m in m_values:
            width = 2 * k if name == "down" else k
            x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
            variants = _variants(name)
            pad = scaled_mm_rows(m, k)
            if pad is None:
                variants.pop("scaled_mm")
            elif pad != m:  # cuBLAS rejects this M: time it on zero-padded rows, and say so
                variants[f"scaled_mm(M pad->{pad})"] = _padded(variants.pop("scaled_mm"), pad)
            for variant, fn in variants.items():
                if only and not any(variant.startswith(prefix) for prefix in only):
                    continue
                try:
                    seconds = time_variant(fn, x, sets)
                except RuntimeError as error:  # e.g. a torch baseline that rejects this shape
                    print(f"{name:>8} {m:>4} {variant:>22}  failed: {str(error).splitlines()[0][:60]}")
                    continue
                fp8 = variant.startswith("ours") or variant.startswith("scaled_mm")
                bandwidth = n * k * (1 if fp8 else 2) / seconds
                rows.append(
                    {"shape": name, "m": m, "variant": variant, "us": seconds * 1e6, "tb_s": bandwidth / 1e12}
                )
                print(
                    f"{name:>8} {m:>4} {variant:>22} {seconds * 1e6:8.1f} {bandwidth / 1e12:6.2f} "
                    f"{100 * bandwidth / ceilings['copy']:6.1f} {100 * bandwidth / ceilings['read']:6.1f}"
                )
    if mlp:
        _mlp_rows(m_values, rows, ceilings, only)
    return rows


def _mlp_rows(m_values, rows: list[dict], ceilings: dict[str, float], only: list[str] | None = None) -> None:
    """The whole SwiGLU MLP: bf16 eager, torch.compile, ours W8A16 (SwiGLU fused into down), and
    at decode sizes (M <= 16) ours W8A8 as the engine runs it (gate+up, `swiglu_quantize`, down
    leaving its split-K partials: three launches). FP8 rows also report bandwidth on the FP8
    weight bytes of both projections."""
    from shoal.kernels import fp8_gemm, quant

    (n_up, k_up), (n_down, k_down) = SHAPES["gate_up"], SHAPES["down"]
    up, down = _weight_sets(n_up, k_up, 2), _weight_sets(n_down, k_down, 2)
    fp8_bytes = n_up * k_up + n_down * k_down

    def eager(x, i):
        gate, upv = F.linear(x, up[i]["bf16"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * upv, down[i]["bf16"])

    def ours(x, i):
        gate_up = fp8_gemm.fp8_linear(x, up[i]["w_q"], up[i]["w_scale"], False)
        return fp8_gemm.fp8_linear(gate_up, down[i]["w_q"], down[i]["w_scale"], False, True)

    def chain(x, i):
        x_q, x_s = x
        gate_up = fp8_gemm.fp8_gemm(x_q, x_s, up[i]["w_q"], up[i]["w_scale"])
        h_q, h_s = quant.swiglu_quantize(gate_up)
        return fp8_gemm.fp8_gemm(h_q, h_s, down[i]["w_q"], down[i]["w_scale"], unreduced=True)

    variants: dict[str, Callable] = {"mlp_bf16_eager": eager, "mlp_ours_w8a16": ours}
    if not only or any("mlp_bf16_compile".startswith(prefix) for prefix in only):
        variants["mlp_bf16_compile"] = torch.compile(eager, mode="max-autotune-no-cudagraphs", dynamic=False)
    fp8_variants = {"mlp_ours_w8a8_chain": chain}
    for m in m_values:
        x = torch.randn(m, k_up, device="cuda", dtype=torch.bfloat16)
        x_quantized = quant.quantize_activations(x)
        chosen = dict(variants)
        if m <= 16:
            chosen.update(fp8_variants)
        for variant, fn in chosen.items():
            if only and not any(variant.startswith(prefix) for prefix in only):
                continue
            quantized = variant in fp8_variants
            arg = x_quantized if quantized else x
            ms = time_graph_ms(
                lambda fn=fn, arg=arg: [fn(arg, i) for i in range(2)], repeats=5, replays_per_sample=50,
                calls_per_replay=2,
            )  # fmt: skip
            seconds = ms / 1e3
            rows.append({"shape": "mlp", "m": m, "variant": variant, "us": seconds * 1e6})
            line = f"{'mlp':>8} {m:>4} {variant:>30} {seconds * 1e6:8.1f}"
            if quantized:
                bandwidth = fp8_bytes / seconds
                copy, read = (100 * bandwidth / ceilings[key] for key in ("copy", "read"))
                line += f" {bandwidth / 1e12:6.2f} {copy:6.1f} {read:6.1f}"
            print(line)


SWEEP_MODES = ("w8a8", "w8a16")  # pre-quantized activations; bf16 activations (dequant in registers)
H200_SMS = 132


def add_gemm_case_arguments(parser: argparse.ArgumentParser) -> None:
    """N K M of one FP8 GEMM and an optional launch config (the developer scripts' arguments)."""
    parser.add_argument("n", type=int)
    parser.add_argument("k", type=int)
    parser.add_argument("m", type=int)
    parser.add_argument("--config", help="a GemmConfig(...) expression; default: the tuned table's")


def gemm_case_config(args: argparse.Namespace, device: torch.device | None = None):
    """The `--config` expression's GemmConfig, else the tuned table's for (N, K, M) with
    pre-quantized activations."""
    from shoal.kernels import fp8_gemm

    if args.config:
        return eval(args.config, {"GemmConfig": fp8_gemm.GemmConfig})  # a developer's own expression
    return fp8_gemm.pick_config(args.n, args.k, args.m, device, fp8_activations=True)


def candidate_configs(n: int, k: int, m: int, sms: int = H200_SMS, tma: bool = False) -> list:
    """The plausible winners, not a grid: per tile width (32/64/128 weight rows, each dividing the
    128-row scale block), split-K counts that put about 2 and 4 programs on every SM (one per SM
    leaves too few loads in flight; at least 2 K steps per split); A/B swapped or not; 4 or 6
    pipeline stages (8 warps instead of 6 stages for 64+ row M tiles). With `tma` (W8A8), each
    also with TMA descriptor loads; the Gluon kernel (`kernels/fp8_gemm_gluon.py`, one weight tile
    before the PDL wait: timed alone there is no kernel before it to overlap, so only `shoal bench
    ab` in the step shows that part of its gain), swapped at M <= 32 and unswapped at M >= 64."""
    from shoal.kernels.fp8_gemm import BLOCK_K, GemmConfig

    k_blocks = -(-k // BLOCK_K)

    def split_counts(block_m: int, block_n: int, programs_per_sm: tuple[int, ...]) -> list[int]:
        """Split-K counts that put about that many programs on every SM (at least 2 K steps each)."""
        tiles = -(-m // block_m) * -(-n // block_n)
        return sorted({max(1, min(k_blocks // 2, math.ceil(t * sms / tiles))) for t in programs_per_sm})

    block_ms = (16,) if m <= 16 else (32,) if m <= 32 else (64,) if m <= 64 else (64, 128)
    configs = []
    for bm in block_ms:
        for bn in (32, 64, 128):
            for split in split_counts(bm, bn, (2, 4)):
                for swap in (False, True):
                    for warps, stages in ((4, 4), (4, 6)) if bm <= 32 else ((4, 4), (8, 4)):
                        for use_tma in (False, True) if tma else (False,):
                            configs.append(
                                GemmConfig(bm, bn, split, warps, stages, swap_ab=swap, tma=use_tma)
                            )
    if tma and m <= 32:  # the Gluon kernel, swapped (pre-quantized activations; 64 or 128 weight rows)
        for bn in (64, 128):
            for split in split_counts(block_ms[0], bn, (2, 4)):
                for stages in (3, 4):
                    configs.append(
                        GemmConfig(
                            block_ms[0], bn, split, 4, stages, swap_ab=True, gluon=True, tiles_before_wait=1
                        )
                    )
    if tma and m >= 64:  # the Gluon kernel unswapped: 64 activation rows, 32 or 64 weight columns
        for bn in (32, 64):
            for split in split_counts(64, bn, (1, 2, 3)):
                for stages in (4, 6):
                    configs.append(GemmConfig(64, bn, split, 4, stages, gluon=True, tiles_before_wait=1))
    return configs


def _sweep_fn(mode: str, config) -> Callable:
    from shoal.kernels import fp8_gemm

    if mode == "w8a8":
        return lambda x, w: fp8_gemm.fp8_gemm(x[0], x[1], w["w_q"], w["w_scale"], config=config)
    return lambda x, w: fp8_gemm.fp8_linear(x, w["w_q"], w["w_scale"], False, config=config)


def _sweep_input(mode: str, m: int, k: int):
    from shoal.kernels import quant

    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    return quant.quantize_activations(x) if mode == "w8a8" else x


_WORKER_WEIGHTS: dict[tuple[int, int], dict[str, torch.Tensor]] = {}


def _compile_job(job: tuple) -> str | None:
    """In a worker process: one launch of (mode, n, k, m, config), so Triton's on-disk cache holds
    the binary the timing process will load (the kernel does not specialize on M)."""
    mode, n, k, m, config = job
    try:
        if (n, k) not in _WORKER_WEIGHTS:
            _WORKER_WEIGHTS[(n, k)] = _weight_sets(n, k, 1)[0]
        _sweep_fn(mode, config)(_sweep_input(mode, m, k), _WORKER_WEIGHTS[(n, k)])
        torch.cuda.synchronize()
        return None
    except Exception as error:  # noqa: BLE001 - reported, and the timing pass skips it too
        return f"{type(error).__name__}: {str(error).splitlines()[0][:80] if str(error) else ''}"


def precompile(jobs: list, job_fn: Callable = _compile_job, workers: int | None = None) -> None:
    """Run `job_fn(job)` (one small launch per kernel variant) in parallel processes, filling
    Triton's on-disk cache: compilation, not the GPU, is what a sweep mostly waits for."""
    import concurrent.futures
    import multiprocessing

    workers = workers or max(1, min(14, (os.cpu_count() or 2) - 2))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context) as pool:
        for job, error in zip(jobs, pool.map(job_fn, jobs, chunksize=1), strict=True):
            if error:
                print(f"  compile failed for {job}: {error}")


def sweep(
    shapes: dict[str, tuple[int, int]] = SHAPES, m_values=M_VALUES, modes=SWEEP_MODES,
    precompile_only: bool = False, json_path: str | None = None, write_table: bool = False,
) -> list[dict]:  # fmt: skip
    """Time the candidates per (shape, M, mode); print the best per shape and a summary against
    the default config, bf16 cuBLAS and `_scaled_mm`; `write_table` merges the winners into the
    tuned tables."""
    from shoal.kernels import fp8_gemm

    jobs = []
    for n, k in shapes.values():
        for mode in modes:
            seen = set()
            for m in m_values:
                for config in candidate_configs(n, k, m, tma=mode == "w8a8"):
                    if config not in seen:
                        seen.add(config)
                        jobs.append((mode, n, k, m, config))
    print(f"compiling {len(jobs)} kernels in parallel")
    precompile(jobs)
    if precompile_only:
        return []
    ceilings = memory_ceilings()
    results = []
    winners: dict[str, dict] = {mode: {} for mode in modes}
    for name, (n, k) in shapes.items():
        sets = _weight_sets(n, k, max(2, -(-ROTATION_BYTES // (n * k))))
        for m in m_values:
            row = {"shape": name, "n": n, "k": k, "m": m}
            for mode in modes:
                x = _sweep_input(mode, m, k)
                timed = []
                for config in [None, *candidate_configs(n, k, m, tma=mode == "w8a8")]:
                    try:
                        t = time_variant(_sweep_fn(mode, config), x, sets, 20, 3)
                    except Exception:  # noqa: BLE001 - out of shared memory, etc.: already reported
                        continue
                    timed.append((t, config))
                default = next((t for t, c in timed if c is None), math.nan)
                best_t, best_c = min((item for item in timed if item[1] is not None), key=lambda i: i[0])
                row[mode] = {"best_us": best_t * 1e6, "config": repr(best_c), "default_us": default * 1e6}
                winners[mode][(n, k, fp8_gemm.m_bucket(m))] = best_c
                print(
                    f"    {mode} ({n}, {k}, {fp8_gemm.m_bucket(m)}): {best_c!r},  # {name} "
                    f"{best_t * 1e6:.1f} us {n * k / best_t / 1e12:.2f} TB/s (default {default * 1e6:.1f})"
                )
            xb = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row["bf16_us"] = time_variant(lambda x, w: F.linear(x, w["bf16"]), xb, sets, 20, 3) * 1e6
            pad = scaled_mm_rows(m, k)
            fn = _scaled_mm_blockwise if pad == m else _padded(_scaled_mm_blockwise, pad)
            row["scaled_mm_us"] = time_variant(fn, xb, sets, 20, 3) * 1e6 if pad else math.nan
            row["scaled_mm_rows"] = pad
            results.append(row)
    _print_sweep_summary(results, ceilings, modes)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"ceilings": ceilings, "rows": results}, f, indent=1)
    if write_table:
        for mode, found in winners.items():
            print(f"wrote {fp8_gemm.write_tuned_table(found, fp8_activations=mode == 'w8a8')}")
    return results


def _print_sweep_summary(results: list[dict], ceilings: dict[str, float], modes) -> None:
    print(
        f"copy {ceilings['copy'] / 1e12:.2f} TB/s, read {ceilings['read'] / 1e12:.2f} TB/s; "
        "us per GEMM (best swept / default config), TB/s on weight bytes, % of copy / read"
    )
    header = f"{'shape':>8} {'M':>4}"
    for mode in modes:
        header += f" {mode + ' best/dflt':>18} {'TB/s':>5} {'%cp':>4} {'%rd':>4}"
    print(header + f" {'bf16':>6} {'scaled_mm':>16}")
    for row in results:
        line = f"{row['shape']:>8} {row['m']:>4}"
        for mode in modes:
            best, default = row[mode]["best_us"], row[mode]["default_us"]
            bw = row["n"] * row["k"] / best / 1e6
            line += f" {best:8.1f}/{default:8.1f} {bw:5.2f} {100 * bw * 1e12 / ceilings['copy']:4.0f}"
            line += f" {100 * bw * 1e12 / ceilings['read']:4.0f}"
        pad = row["scaled_mm_rows"]
        note = "" if pad == row["m"] else f" (M pad {pad})"
        print(line + f" {row['bf16_us']:6.1f} {row['scaled_mm_us']:6.1f}{note:>10}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", action="store_true", help="search configs and print the best per shape")
    parser.add_argument("--modes", nargs="*", choices=SWEEP_MODES, default=list(SWEEP_MODES))
    parser.add_argument("--precompile-only", action="store_true", help="sweep: only fill the compile cache")
    parser.add_argument("--json", help="sweep: also write the results here")
    parser.add_argument("--write-table", action="store_true", help="sweep: merge the winners into the tables")
    parser.add_argument("--no-mlp", action="store_true", help="table: skip the whole-MLP rows")
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--m", nargs="*", type=int, default=list(M_VALUES))
    parser.add_argument("--variants", nargs="*", help="table: only variants whose names start so")


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("shoal bench gemm needs a CUDA GPU")
        return 2
    shapes = {name: SHAPES[name] for name in args.shapes}
    if args.sweep:
        sweep(shapes, args.m, args.modes, args.precompile_only, args.json, args.write_table)
    else:
        run_gemm_bench(shapes, args.m, mlp=not args.no_mlp, only=args.variants)
    return 0
