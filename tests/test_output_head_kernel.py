"""`kernels/output_head.py`: the batch-1 output heads, against `F.linear`."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from shoal.bench.timing import capture_graph  # noqa: E402
from shoal.kernels.output_head import output_head  # noqa: E402
from shoal.kernels.reference import dequantize_weight  # noqa: E402
from shoal.quant.fp8_head import round_to_e4m3_blocks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(x: torch.Tensor, weight: torch.Tensor, rows: int) -> torch.Tensor:
    """fp32 products summed in fp64, rounded once: what any summation order approximates."""
    return F.linear(x.double(), weight[:rows].double()).to(x.dtype)


def assert_one_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rows: int) -> None:
    """Within one unit of the output dtype's last place of the exact sum, plus the fp32
    summation's worst-case error (K * eps32 * sum |x w|): the kernel's summation order differs
    from any reference's, so the rounding can land on either neighbour, but nothing worse."""
    exact = F.linear(x.double(), weight[:rows].double())
    magnitude = F.linear(x.double().abs(), weight[:rows].double().abs())
    bound = torch.finfo(got.dtype).eps * exact.abs() + x.shape[1] * torch.finfo(torch.float32).eps * magnitude
    assert got.shape == exact.shape and got.dtype == x.dtype
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,ahead", [(64, 2), (100, 2), (1100, 1), (1100, 2), (2560, 2)])
def test_batch_one_row_against_linear(dtype: torch.dtype, k: int, ahead: int) -> None:
    """One chunk (a power of two, or masked), three chunks the last masked (one or two chunks
    ahead), S2's five; rows not a multiple of the program's; the first `rows` rows of a padded
    weight (S2's restricted main head)."""
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(1, k, generator=gen).to(dtype).to(DEVICE)
    weight = torch.randn(45, k, generator=gen).to(dtype).to(DEVICE)
    got = output_head(x, weight, rows=37, ahead=ahead)
    assert_one_rounding(got, x, weight, 37)
    if dtype == torch.bfloat16:  # nearly every logit is exactly the rounded sum
        assert (got == reference(x, weight, 37)).float().mean() > 0.9


def test_several_strided_rows_into_out() -> None:
    """The fast pass 0's input is every second row of the normed tensor; rows_per_program 4 so
    several programs and a partial last one run in the interpreter."""
    gen = torch.Generator().manual_seed(1)
    normed = torch.randn(6, 96, generator=gen).to(torch.bfloat16).to(DEVICE)
    x = normed[1::2]
    weight = torch.randn(30, 96, generator=gen).to(torch.bfloat16).to(DEVICE)
    out = torch.full((3, 30), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert output_head(x, weight, out=out, rows_per_program=4) is out
    assert_one_rounding(out, x, weight, 30)


@pytest.mark.parametrize("rows_per_program", [16, 128])
def test_e4m3_weight_with_block_scales_is_its_dequantized_weight(rows_per_program: int) -> None:
    """The rounded fast head's codes and power-of-two scales (`quant/fp8_head.py`): the logits of
    the dequantized weight (exact in bf16), for two row blocks (the second partial), three chunks
    of columns (the last masked, mid-block) and bf16 or fp32 activations."""
    gen = torch.Generator().manual_seed(rows_per_program)
    weight = torch.randn(200, 1100, generator=gen) / 30
    weight[:, 640:768] *= 40  # blocks of very different scales
    codes, scales = round_to_e4m3_blocks(weight)
    dequantized = dequantize_weight(codes, scales)
    codes, scales = codes.to(DEVICE), scales.to(DEVICE)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(1, 1100, generator=gen).to(dtype)
        got = output_head(x.to(DEVICE), codes, rows=190, rows_per_program=rows_per_program, scales=scales)
        assert got.dtype == dtype
        assert_one_rounding(got.cpu(), x, dequantized.to(dtype), 190)


def test_bad_scales_are_refused() -> None:
    x = torch.zeros(1, 256, dtype=torch.bfloat16, device=DEVICE)
    codes, scales = (t.to(DEVICE) for t in round_to_e4m3_blocks(torch.randn(384, 256)))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        output_head(x, codes.to(torch.bfloat16), scales=scales)
    with pytest.raises(ValueError, match=r"scales must be float32 \[3, 2\]"):
        output_head(x, codes, scales=scales.t().contiguous())  # transposed: [2, 3]
    with pytest.raises(ValueError, match="contiguous rows"):
        output_head(x, codes, scales=torch.zeros(2, 3, device=DEVICE).t())  # [3, 2], re-strided
    with pytest.raises(ValueError, match="float32"):
        output_head(x, codes, scales=scales.double())
    with pytest.raises(ValueError, match="divide 128"):
        output_head(x, codes, scales=scales, rows_per_program=256)


def test_bad_inputs_are_refused() -> None:
    x = torch.zeros(1, 8, dtype=torch.bfloat16, device=DEVICE)
    weight = torch.zeros(4, 8, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="need x"):
        output_head(x, torch.zeros(4, 9, dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(ValueError, match="must match"):
        output_head(x.float(), weight)
    with pytest.raises(ValueError, match="contiguous"):
        output_head(x, torch.zeros(8, 4, dtype=torch.bfloat16, device=DEVICE).t())
    with pytest.raises(ValueError, match="rows must lie"):
        output_head(x, weight, rows=5)
    with pytest.raises(ValueError, match="power of two"):
        output_head(x, weight, rows_per_program=3)
    with pytest.raises(ValueError, match="ahead"):
        output_head(x, weight, ahead=3)
    with pytest.raises(ValueError, match="out must be"):
        output_head(x, weight, out=torch.zeros(1, 4, device=DEVICE))
    assert output_head(x[:0], weight).shape == (0, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 2])
def test_s2_heads_in_a_graph_behind_the_writer_gpu(batch: int) -> None:
    """S2-Pro's restricted main head (4,097 rows of a 4,160-row padded slice) and a codebook head,
    captured in a CUDA graph behind the copy that writes the activations: each replay reads that
    replay's activations (the weights are read before the PDL wait, the activations after)."""
    gen = torch.Generator().manual_seed(batch)
    main = (torch.randn(4160, 2560, generator=gen) / 50).to(torch.bfloat16).to(DEVICE)
    codebook = (torch.randn(4096, 2560, generator=gen) / 50).to(torch.bfloat16).to(DEVICE)
    source = torch.zeros(batch, 2560, dtype=torch.bfloat16, device=DEVICE)
    x = torch.zeros_like(source)
    main_out = torch.empty(batch, 4097, dtype=torch.bfloat16, device=DEVICE)
    codebook_out = torch.empty(batch, 4096, dtype=torch.bfloat16, device=DEVICE)
    codes, scales = round_to_e4m3_blocks(codebook)  # the rounded fast head, read as e4m3
    rounded = dequantize_weight(codes, scales).to(torch.bfloat16)
    rounded_out = torch.empty(batch, 4096, dtype=torch.bfloat16, device=DEVICE)

    def step() -> None:
        x.copy_(source)
        output_head(x, main, rows=4097, out=main_out)
        output_head(x, codebook, out=codebook_out)
        output_head(x, codes, out=rounded_out, scales=scales)

    graph = capture_graph(step)  # warm-up calls outside the capture
    for seed in range(3):
        source.copy_(torch.randn(source.shape, generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert_one_rounding(main_out, source, main, 4097)
        assert_one_rounding(codebook_out, source, codebook, 4096)
        assert_one_rounding(rounded_out, source, rounded, 4096)
        assert (rounded_out == F.linear(source, rounded)).float().mean() > 0.9
        assert (main_out == F.linear(source, main)[:, :4097]).float().mean() > 0.9
