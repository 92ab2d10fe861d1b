"""Would the prefill's FP8 GEMMs run faster with row-wise scales, and what would that cost in error?

Why: in a concurrency-64 wave of 64 different 300-token prompts, cuBLAS's block-scaled FP8 GEMMs
(activations 1 x 128, weights 128 x 128, the checkpoint's format) take 117 of about 161 ms of GPU
time (docs/performance.md runs 208 and 213), about 1,190 TFLOP/s: 60% of the H200's dense FP8
peak (run 215, this probe's first run; row-wise was 0.92-1.06x of its time, not adopted).
cuBLAS's row-wise FP8 path (one scale per token, one per output channel, applied once in the
epilogue) is its most tuned FP8 GEMM. Before building a prefill on it, this measures at the
prefill's sizes and S2-Pro's four projections: bf16 cuBLAS, block-scaled `_scaled_mm` (what the
engine runs) and row-wise `_scaled_mm` (the weights requantized per output channel from the
block-scaled checkpoint's values, the activations per token), the GEMM alone with its inputs
quantized outside the timed graph, and each FP8 path's relative error against the fp32 product
of the same (dequantized) weights on activations with outlier channels.

Usage (GPU): python scripts/probe_prefill_gemm_scaling.py [--rows 384 3840 8192] [--shapes qkv o gate_up down]
CPU (numerics only, small shapes): python scripts/probe_prefill_gemm_scaling.py --check
"""

from __future__ import annotations

import argparse

import torch

from shoal.bench.gemm import SHAPES
from shoal.kernels import reference as ref


def make_weight(n: int, k: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled checkpoint weight (codes, 128 x 128 scales) whose blocks differ in magnitude
    (about 2x either way), as trained weights' do."""
    w = torch.randn(n, k, generator=generator) * 0.02
    blocks = torch.exp(0.7 * torch.randn(-(-n // 128), -(-k // 128), generator=generator))
    w *= blocks.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return ref.quantize_weight(w)


def make_activations(m: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """bf16 rows with outlier channels (a per-column log-normal spread), like real hidden states."""
    spread = torch.exp(torch.randn(1, k, generator=generator))
    return (torch.randn(m, k, generator=generator) * spread).to(torch.bfloat16)


def rowwise_weight(w_q: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block-scaled weight's values requantized with one scale per output channel:
    (e4m3 [N, K], fp32 [N])."""
    return quantize_rows(ref.dequantize_weight(w_q, w_scale))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (amax / 448), values divided and rounded to e4m3: (e4m3, fp32 [rows]);
    the reference's per-vector rule (`reference.quantize_kv`), applied to whole rows."""
    return ref.quantize_kv(x)


def rowwise_product(x_q, x_scale, w_q, w_scale) -> torch.Tensor:
    """fp32 (x_q * x_scale) @ (w_q * w_scale).T: what row-wise `_scaled_mm` computes."""
    return (x_q.float() * x_scale[:, None]) @ (w_q.float() * w_scale[:, None]).t()


def errors(x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor) -> dict[str, float]:
    """Relative Frobenius error of each FP8 path against the fp32 product of x and the
    dequantized checkpoint weight (what the bf16 model would compute, before its rounding)."""
    exact = x.float() @ ref.dequantize_weight(w_q, w_scale).t()
    block = ref.fp8_gemm(*ref.quantize_activations(x), w_q, w_scale, torch.float32)
    row = rowwise_product(*quantize_rows(x), *rowwise_weight(w_q, w_scale))
    norm = exact.norm()
    return {"block": ((block - exact).norm() / norm).item(), "row": ((row - exact).norm() / norm).item()}


def check() -> None:
    """CPU: the row-wise requantization and product are right and the error report runs."""
    g = torch.Generator().manual_seed(0)
    w_q, w_scale = make_weight(256, 384, g)
    x = make_activations(8, 384, g)
    q, s = rowwise_weight(w_q, w_scale)
    restored = q.float() * s[:, None]
    dequantized = ref.dequantize_weight(w_q, w_scale)
    assert ((restored - dequantized).norm() / dequantized.norm()).item() < 0.05
    x_q, x_s = quantize_rows(x)
    torch.testing.assert_close(x_q.float() * x_s[:, None], x.float(), rtol=0.07, atol=1e-3)
    found = errors(x, w_q, w_scale)
    assert 0 < found["block"] < found["row"] < 0.2, found
    print(f"check OK: relative error block-scaled {found['block']:.4f}, row-wise {found['row']:.4f}")


def gemm_variants(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> dict[str, object]:
    """The three GEMMs of x [M, K] (CUDA, bf16) as capturable calls, x quantized beforehand."""
    from shoal.kernels.quant import quantize_activations

    xq_block, xs_block = quantize_activations(x, pad_rows_to=16)
    xq_row, xs_row = (t.to(x.device) for t in quantize_rows(x.cpu()))
    xs_row = xs_row[:, None].contiguous()
    w_row_scale = weights["row_scale"][None, :].contiguous()
    return {
        "bf16": lambda: torch.mm(x, weights["dense"].t()),
        "block": lambda: torch._scaled_mm(
            xq_block, weights["q"].t(), xs_block, weights["scale"].t(), out_dtype=torch.bfloat16
        ),
        "row": lambda: torch._scaled_mm(
            xq_row, weights["row"].t(), xs_row, w_row_scale, out_dtype=torch.bfloat16
        ),
    }


def time_shapes(rows: list[int], shapes: list[str]) -> None:
    """GPU: µs and TFLOP/s of the three GEMMs per (shape, rows), inputs quantized beforehand."""
    from shoal.bench.timing import time_graph_ms

    g = torch.Generator().manual_seed(1)
    print("shape     rows   bf16 µs  block µs  row µs  TFLOP/s bf16/block/row  row/block  err block  err row")
    for name in shapes:
        n, k = SHAPES[name]
        w_q, w_scale = make_weight(n, k, g)
        w_row, w_row_scale = rowwise_weight(w_q, w_scale)
        found = errors(make_activations(64, k, g), w_q, w_scale)
        weights = {
            "q": w_q, "scale": w_scale, "row": w_row, "row_scale": w_row_scale,
            "dense": ref.dequantize_weight(w_q, w_scale).to(torch.bfloat16),
        }  # fmt: skip
        weights = {key: t.cuda() for key, t in weights.items()}
        for m in rows:
            calls = gemm_variants(make_activations(m, k, g).cuda(), weights)
            us = {key: time_graph_ms(fn, repeats=10, replays_per_sample=5) * 1e3 for key, fn in calls.items()}
            tflops = {key: 2 * m * n * k / (t * 1e-6) / 1e12 for key, t in us.items()}
            print(
                f"{name:8} {m:5}  {us['bf16']:8.1f}  {us['block']:8.1f}  {us['row']:6.1f}  "
                f"{tflops['bf16']:5.0f} / {tflops['block']:5.0f} / {tflops['row']:5.0f}  "
                f"{us['row'] / us['block']:9.3f}  {found['block']:9.4f}  {found['row']:7.4f}",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[384, 3840, 8192])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--check", action="store_true", help="CPU: the numerics only")
    args = parser.parse_args()
    if args.check:
        check()
    else:
        time_shapes(args.rows, args.shapes)


if __name__ == "__main__":
    main()
