"""The slow layers' fused decode attention (`kernels/decode_rope_attention.py`) against the two
kernels it replaces (`qk_norm_rope_kv_write` + `paged_decode_attention`): the same page writes,
the same outputs within bf16 rounding, split or not, from split-K partials or a reduced qkv."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from shoal.kernels.attention import decode_config, paged_decode_attention  # noqa: E402
from shoal.kernels.decode_rope_attention import decode_rope_attention  # noqa: E402
from shoal.kernels.fp8_gemm import SplitKPartials  # noqa: E402
from shoal.kernels.norm_rope import qk_norm_rope_kv_write  # noqa: E402
from shoal.kernels.quant import new_activation_scales  # noqa: E402
from shoal.models.layers import rope_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PAGE = 16


def make_case(lens: list[int], hq: int, hkv: int, d: int, seed: int = 0, partials: int = 0) -> dict:
    """A decode step of rows with `lens` keys (the new token included), pages scattered over a
    pool, random cached keys, qkv (or its split-K partials), QK-norm weights, a padding row last."""
    gen = torch.Generator().manual_seed(seed)
    bs = len(lens)
    width = max(lens) // PAGE + 2  # pages per row in the block table
    num_pages = bs * width + 3
    tables = torch.randperm(num_pages, generator=gen)[: bs * width].view(bs, width).to(torch.int32)
    k_pages = torch.randn(num_pages, PAGE, hkv, d, generator=gen).to(torch.bfloat16)
    v_pages = torch.randn(num_pages, PAGE, hkv, d, generator=gen).to(torch.bfloat16)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    positions = (seq_lens - 1).clamp_min(0).long()
    slots = torch.stack([tables[b, p // PAGE].long() * PAGE + p % PAGE for b, p in enumerate(positions)])
    slots[-1] = -1  # the padding row of a graph batch writes nothing
    if partials:  # fp32 parts, summed in split order and rounded once, as the GEMM would
        qkv = SplitKPartials(torch.randn(partials, bs, (hq + 2 * hkv) * d, generator=gen).to(DEVICE))
    else:
        qkv = (torch.randn(bs, (hq + 2 * hkv) * d, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
    weights = tuple((torch.rand(d, generator=gen) + 0.5).to(torch.bfloat16).to(DEVICE) for _ in range(2))
    tensors = dict(
        positions=positions, slots=slots, tables=tables, seq_lens=seq_lens, k_pages=k_pages,
        v_pages=v_pages, table=rope_table(PAGE * width, d, 10000.0),
    )  # fmt: skip
    return {key: value.to(DEVICE) for key, value in tensors.items()} | {"qkv": qkv, "weights": weights}


def run_both(case: dict, hq: int, hkv: int, num_splits: int, config, out_fp8: bool = False):
    """(two-kernel output, its pages), (fused output, its pages) on copies of the same pages."""
    results = []
    for fused in (False, True):
        k, v = case["k_pages"].clone(), case["v_pages"].clone()
        target = None
        if out_fp8:
            bs = case["seq_lens"].shape[0]
            target = (
                torch.empty(bs, hq * k.shape[-1], dtype=torch.float8_e4m3fn, device=DEVICE),
                new_activation_scales(bs, hq * k.shape[-1], DEVICE),
            )
        common = dict(config=config, num_splits=num_splits, out_fp8=target)
        if fused:
            out = decode_rope_attention(
                case["qkv"], case["positions"], case["slots"], case["table"], k, v, case["tables"],
                case["seq_lens"], hq, hkv, *case["weights"], **common,
            )  # fmt: skip
        else:
            q = qk_norm_rope_kv_write(
                case["qkv"], case["positions"], case["table"], k, v, case["slots"], hq, hkv, *case["weights"]
            )
            out = paged_decode_attention(q, k, v, case["tables"], case["seq_lens"], **common)
        if out_fp8:
            values, scales = out
            d = k.shape[-1]
            out = (values.float().view(values.shape[0], hq, d) * scales[:, :, None]).to(torch.bfloat16)
        results.append((out, k, v))
    return results


def assert_close_outputs(
    got: torch.Tensor, want: torch.Tensor, rows: int, v_max: float, mantissa_bits: int = 7
) -> None:
    """The rows that are not padding: both paths compute the same softmax, the new key joining
    first here (its weight kept in fp32) and inside its block there (rounded to bf16 before the PV
    product, moving its row by up to 2**-7 * max|v| / l), so the output may land a value or two
    away in its format (bf16, or e4m3: `mantissa_bits` 3): at least 95% of elements within one
    ulp, all within that plus 2**-7 * max|v|. A 1% error in the normalizer fails the first rule
    (bf16's ulp is 0.4-0.8% of a value)."""
    got, want = got[:rows].float(), want[:rows].float()
    assert not torch.isnan(got).any()
    diff = (got - want).abs()
    magnitude = torch.maximum(got.abs(), want.abs()).clamp_min(2.0**-126)
    ulp = torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa_bits)
    assert (diff <= ulp).float().mean() >= 0.95, diff.max()
    assert (diff <= ulp + 2.0**-7 * v_max).all(), diff.max()


def v_max(case: dict) -> float:
    """The largest |v| any row attends (cached values and the new tokens')."""
    qkv = case["qkv"].reduce() if isinstance(case["qkv"], SplitKPartials) else case["qkv"]
    return max(case["v_pages"].float().abs().max().item(), qkv.float().abs().max().item())


@pytest.mark.parametrize("num_splits,fused_merge", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("partials", [0, 2], ids=["reduced", "partials"])
def test_same_pages_and_outputs_as_the_two_kernels(num_splits: int, fused_merge: bool, partials: int) -> None:
    hq, hkv, d = 8, 2, 32
    case = make_case([1, 17, 70, 100, 33], hq, hkv, d, partials=partials)
    config = replace(decode_config(5), block_n=16, fused_merge=fused_merge, split_block_n=0)
    (want, k_want, v_want), (got, k_got, v_got) = run_both(case, hq, hkv, num_splits, config)
    assert torch.equal(k_got.view(torch.int16), k_want.view(torch.int16))  # the same writes, bit for bit
    assert torch.equal(v_got.view(torch.int16), v_want.view(torch.int16))
    assert_close_outputs(got, want, rows=4, v_max=v_max(case))


def test_fills_the_fp8_o_projection_input() -> None:
    """`out_fp8` (head_dim 128): the quantized rows dequantize to the two-kernel path's within
    e4m3's rounding."""
    hq, hkv, d = 4, 1, 128
    case = make_case([9, 40, 2], hq, hkv, d, seed=3)
    config = replace(decode_config(3), block_n=16, fused_merge=True, split_block_n=0)
    (want, _, _), (got, _, _) = run_both(case, hq, hkv, 2, config, out_fp8=True)
    assert_close_outputs(got, want, rows=2, v_max=v_max(case), mantissa_bits=3)


def test_refuses_what_it_cannot_take() -> None:
    hq, hkv, d = 8, 2, 32
    case = make_case([5, 6], hq, hkv, d)
    args = (case["qkv"], case["positions"], case["slots"], case["table"])
    pages = case["k_pages"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="e4m3 cache keeps the two kernels"):
        decode_rope_attention(*args, pages, pages, case["tables"], case["seq_lens"], hq, hkv)
    with pytest.raises(ValueError, match="does not split"):
        pools = (case["k_pages"], case["v_pages"], case["tables"], case["seq_lens"])
        decode_rope_attention(*args, *pools, 7, hkv)
    with pytest.raises(ValueError, match=r"must be \[2\]"):
        decode_rope_attention(
            case["qkv"], case["positions"][:1], case["slots"], case["table"], case["k_pages"],
            case["v_pages"], case["tables"], case["seq_lens"], hq, hkv,
        )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_s2_shapes_on_the_gpu(batch: int) -> None:
    """S2-Pro's slow layer (32 q heads, 8 kv heads, head_dim 128, QK-norm) at the engine's split
    choices for 332-key rows in 32k tables: pages equal bit for bit except where a head's norm
    reduction order moves a key by one bf16 ulp; outputs within bf16 rounding."""
    hq, hkv, d = 32, 8, 128
    gen = torch.Generator().manual_seed(batch)
    lens = torch.randint(300, 360, (batch,), generator=gen).tolist()
    case = make_case(lens + [1], hq, hkv, d, seed=batch, partials=2)
    config = decode_config(batch + 1)
    for num_splits in sorted({1, 3}):
        (want, k_want, _), (got, k_got, _) = run_both(case, hq, hkv, num_splits, config)
        differ = (k_got.float() - k_want.float()).abs()
        ulp = torch.exp2(torch.floor(torch.log2(k_want.float().abs().clamp_min(2.0**-126))) - 7)
        assert bool((differ <= ulp).all())
        assert_close_outputs(got, want, rows=batch, v_max=v_max(case))
