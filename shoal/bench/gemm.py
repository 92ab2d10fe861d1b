"""`shoal bench gemm`: the FP8 GEMM at S2-Pro decode shapes against torch baselines (GPU only).

Every variant is timed as CUDA-graph replays of one launch per weight set, rotating over enough
weight sets that L2 (50 MB on the H200) cannot serve them. Bandwidth counts weight bytes only, and
is compared with a device-to-device copy measured in the same run (bytes read + written).

Variants: ours W8A16 (bf16 activations), ours W8A8 with in-GEMM activation quantization, ours W8A8
after the separate quant launch, `torch._scaled_mm` (block-wise scales where this torch accepts
them, else row-wise) with its activation quantization in torch ops, bf16 cuBLAS; plus the whole
MLP (gate+up, SwiGLU, down) in bf16 eager, `torch.compile`d, and ours with SwiGLU fused.
`--sweep` times every candidate config per (N, K, M) and prints the best, to paste into
`kernels/fp8_gemm.py: TUNED_CONFIGS`. Needs only torch and triton.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
M_VALUES = (1, 4, 16, 64, 128)
ROTATION_BYTES = 400 * 2**20  # well past the 50 MB L2


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.randn(2**28, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time_graph(lambda: dst.copy_(src), replays=20)
    return 2 * src.numel() * 4 / seconds


def _time_graph(fn: Callable[[], object], replays: int = 50) -> float:
    """Seconds per call of `fn`, captured once into a CUDA graph and replayed (median of batches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays)
    return sorted(times)[len(times) // 2]


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


def _scaled_mm_rowwise(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12)
    q = (x.float() * (448.0 / amax)).to(torch.float8_e4m3fn)
    # Timing only: the block-quantized weight with a unit per-row scale moves the same bytes.
    w_rowscale = torch.ones(1, weights["w_q"].shape[0], device=x.device)
    return torch._scaled_mm(q, weights["w_q"].t(), amax / 448.0, w_rowscale, out_dtype=torch.bfloat16)


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
        "scaled_mm": lambda x, w: _SCALED_MM(x[:, : w["w_q"].shape[1]], w),
    }
    return variants


_SCALED_MM: Callable = _scaled_mm_blockwise


def _pick_scaled_mm() -> str:
    """Use block-wise scales if this torch build accepts them, else row-wise."""
    global _SCALED_MM
    try:
        w = _weight_sets(256, 256, 1)[0]
        _scaled_mm_blockwise(torch.randn(16, 256, device="cuda", dtype=torch.bfloat16), w)
        _SCALED_MM = _scaled_mm_blockwise
        return "blockwise"
    except (RuntimeError, ValueError):
        _SCALED_MM = _scaled_mm_rowwise
        return "rowwise"


def time_variant(fn: Callable, x: torch.Tensor, sets: list[dict[str, torch.Tensor]]) -> float:
    """Seconds per GEMM, rotating over the weight sets inside one graph."""
    return _time_graph(lambda: [fn(x, w) for w in sets]) / len(sets)


def run_gemm_bench(shapes: dict[str, tuple[int, int]] = SHAPES, m_values=M_VALUES) -> list[dict]:
    """Times every variant; prints and returns one row per (shape, M, variant)."""
    copy_bw = copy_bandwidth()
    mode = _pick_scaled_mm()
    print(f"copy bandwidth {copy_bw / 1e12:.2f} TB/s; torch._scaled_mm {mode}")
    print(f"{'shape':>8} {'M':>4} {'variant':>18} {'us':>8} {'TB/s':>6} {'%copy':>6}")
    rows = []
    for name, (n, k) in shapes.items():
        count = max(2, -(-ROTATION_BYTES // (n * k)))
        sets = _weight_sets(n, k, count)
        for m in m_values:
            width = 2 * k if name == "down" else k
            x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)
            for variant, fn in _variants(name).items():
                try:
                    seconds = time_variant(fn, x, sets)
                except RuntimeError as error:  # e.g. a torch baseline that rejects this shape
                    print(f"{name:>8} {m:>4} {variant:>18}  failed: {str(error).splitlines()[0][:60]}")
                    continue
                fp8 = variant.startswith("ours") or variant == "scaled_mm"
                bandwidth = n * k * (1 if fp8 else 2) / seconds
                rows.append(
                    {"shape": name, "m": m, "variant": variant, "us": seconds * 1e6, "tb_s": bandwidth / 1e12}
                )
                print(
                    f"{name:>8} {m:>4} {variant:>18} {seconds * 1e6:8.1f} "
                    f"{bandwidth / 1e12:6.2f} {100 * bandwidth / copy_bw:6.1f}"
                )
    _mlp_rows(m_values, rows)
    return rows


def _mlp_rows(m_values, rows: list[dict]) -> None:
    """The whole SwiGLU MLP: bf16 eager, torch.compile, ours (W8A16, SwiGLU fused into down)."""
    from shoal.kernels import fp8_gemm

    (n_up, k_up), (n_down, k_down) = SHAPES["gate_up"], SHAPES["down"]
    up, down = _weight_sets(n_up, k_up, 2), _weight_sets(n_down, k_down, 2)

    def eager(x, i):
        gate, upv = F.linear(x, up[i]["bf16"]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * upv, down[i]["bf16"])

    compiled = torch.compile(eager, mode="max-autotune-no-cudagraphs", dynamic=False)

    def ours(x, i):
        gate_up = fp8_gemm.fp8_linear(x, up[i]["w_q"], up[i]["w_scale"], False)
        return fp8_gemm.fp8_linear(gate_up, down[i]["w_q"], down[i]["w_scale"], False, True)

    for m in m_values:
        x = torch.randn(m, k_up, device="cuda", dtype=torch.bfloat16)
        for variant, fn in (
            ("mlp_bf16_eager", eager),
            ("mlp_bf16_compile", compiled),
            ("mlp_ours_w8a16", ours),
        ):
            seconds = _time_graph(lambda fn=fn, x=x: [fn(x, i) for i in range(2)]) / 2
            rows.append({"shape": "mlp", "m": m, "variant": variant, "us": seconds * 1e6})
            print(f"{'mlp':>8} {m:>4} {variant:>18} {seconds * 1e6:8.1f}")


def candidate_configs(n: int, k: int, m: int) -> list:
    from shoal.kernels.fp8_gemm import GemmConfig

    block_ms = [bm for bm in (16, 32, 64, 128) if bm // 2 < max(m, 16) or bm == 16]
    configs = []
    for bm, bn, split, warps, stages in itertools.product(
        block_ms, (32, 64, 128), (1, 2, 4, 8, 16), (4, 8), (3, 4, 6)
    ):
        if split <= max(1, k // 128 // 2):
            configs.append(GemmConfig(bm, bn, split, warps, stages))
    return configs


def sweep(
    shapes: dict[str, tuple[int, int]] = SHAPES, m_values=M_VALUES, quantize_input: bool = False
) -> None:
    """Print the fastest config per (N, K, M) as TUNED_CONFIGS entries."""
    from shoal.kernels import fp8_gemm

    for name, (n, k) in shapes.items():
        sets = _weight_sets(n, k, max(2, -(-ROTATION_BYTES // (n * k))))
        for m in m_values:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            best = None
            for config in candidate_configs(n, k, m):

                def fn(x, w, config=config):
                    return fp8_gemm.fp8_linear(x, w["w_q"], w["w_scale"], quantize_input, config=config)

                try:
                    seconds = time_variant(fn, x, sets)
                except Exception as error:  # noqa: BLE001 - out of shared memory, etc.
                    print(f"  skip {config}: {type(error).__name__}")
                    continue
                if best is None or seconds < best[0]:
                    best = (seconds, config)
            if best:
                print(
                    f"    ({n}, {k}, {fp8_gemm.m_bucket(m)}): {best[1]},  # {name} {best[0] * 1e6:.1f} us, "
                    f"{n * k / best[0] / 1e12:.2f} TB/s"
                )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", action="store_true", help="search configs and print the best per shape")
    parser.add_argument("--quantize-activations", action="store_true", help="sweep the W8A8 inline mode")
    parser.add_argument("--shapes", nargs="*", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--m", nargs="*", type=int, default=list(M_VALUES))


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("shoal bench gemm needs a CUDA GPU")
        return 2
    shapes = {name: SHAPES[name] for name in args.shapes}
    if args.sweep:
        sweep(shapes, args.m, args.quantize_activations)
    else:
        run_gemm_bench(shapes, args.m)
    return 0
