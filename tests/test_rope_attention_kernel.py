"""The slow layers' fused decode attention (QK-norm + RoPE + KV write + paged attention) against
the two launches it replaces (`qk_norm_rope_kv_write` then `paged_decode_attention`)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402

from shoal.kernels import attention  # noqa: E402
from shoal.kernels.attention import AttentionConfig, paged_decode_attention  # noqa: E402
from shoal.kernels.fp8_gemm import SplitKPartials  # noqa: E402
from shoal.kernels.norm_rope import qk_norm_rope_kv_write  # noqa: E402
from shoal.kernels.quant import new_activation_scales  # noqa: E402
from shoal.kernels.reference import dequantize_activations, quantize_kv  # noqa: E402
from shoal.kernels.rope_attention import rope_decode_attention  # noqa: E402
from shoal.models.layers import rope_table  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PAGE = 16
SMALL = AttentionConfig(block_n=16, fused_merge=True, min_split_tokens=16)


def random_bf16(*shape: int, generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16).to(DEVICE)


def decode_case(seq_lens: list[int], hq: int, hkv: int, d: int, gen: torch.Generator, kv: str = "bf16"):
    """Pages holding every row's earlier keys (the step's slot NaN: it must be written, never read
    before), the row's block table, slots, positions and lengths of a decode step, and its qkv."""
    pages_per_row = [-(-n // PAGE) for n in seq_lens]
    num_pages = sum(pages_per_row) + 2
    order = torch.randperm(num_pages, generator=gen)
    tables = torch.zeros(len(seq_lens), max(pages_per_row), dtype=torch.int32)
    cursor = 0
    for b, count in enumerate(pages_per_row):
        tables[b, :count] = order[cursor : cursor + count]
        cursor += count
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    positions = lens.long() - 1
    slots = tables[torch.arange(len(seq_lens)), positions // PAGE].long() * PAGE + positions % PAGE
    k = random_bf16(num_pages, PAGE, hkv, d, generator=gen).cpu()
    v = random_bf16(num_pages, PAGE, hkv, d, generator=gen).cpu()
    flat_k, flat_v = k.view(-1, hkv, d), v.view(-1, hkv, d)
    flat_k[slots] = float("nan")
    flat_v[slots] = float("nan")
    pools: dict = {"k_pages": k.to(DEVICE), "v_pages": v.to(DEVICE)}
    if kv == "fp8":
        (k8, ks), (v8, vs) = quantize_kv(torch.nan_to_num(k)), quantize_kv(torch.nan_to_num(v))
        pools = {"k_pages": k8.to(DEVICE), "v_pages": v8.to(DEVICE), "k_scales": ks.to(DEVICE),
                 "v_scales": vs.to(DEVICE)}  # fmt: skip
    qkv = random_bf16(len(seq_lens), (hq + 2 * hkv) * d, generator=gen, scale=2.0)
    meta = {
        "positions": positions.to(DEVICE), "slot_mapping": slots.to(DEVICE),
        "block_tables": tables.to(DEVICE), "seq_lens": lens.to(DEVICE),
    }  # fmt: skip
    return pools, meta, qkv


def clone_pools(pools: dict) -> dict:
    return {name: tensor.clone() for name, tensor in pools.items()}


def two_launches(qkv, pools, meta, table, hq, hkv, weights, config, num_splits, out_fp8=None):
    scales = {name: pools[name] for name in ("k_scales", "v_scales") if name in pools}
    q = qk_norm_rope_kv_write(
        qkv, meta["positions"], table, pools["k_pages"], pools["v_pages"], meta["slot_mapping"], hq, hkv,
        *weights, **scales,
    )  # fmt: skip
    return paged_decode_attention(
        q, pools["k_pages"], pools["v_pages"], meta["block_tables"], meta["seq_lens"],
        num_splits=num_splits, config=config, out_fp8=out_fp8, **scales,
    )  # fmt: skip


def fused(qkv, pools, meta, table, hq, hkv, weights, config, num_splits, out_fp8=None):
    return rope_decode_attention(
        qkv, meta["positions"], table, pools["k_pages"], pools["v_pages"], meta["slot_mapping"],
        meta["block_tables"], meta["seq_lens"], hq, hkv, *weights, out_fp8=out_fp8,
        k_scales=pools.get("k_scales"), v_scales=pools.get("v_scales"), config=config,
        num_splits=num_splits,
    )  # fmt: skip


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    width = {1: torch.int8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return torch.equal(a.view(width), b.view(width))


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN: a row read the step's slot before it was written"
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


SEQ_LENS = [1, 15, 16, 17, 40, 70]


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("with_norm", [False, True], ids=["plain", "norm"])
@pytest.mark.parametrize(
    "num_splits,fused_merge,preload",
    [(1, False, 0), (3, True, 0), (3, False, 16), (3, True, 32)],
    ids=["1", "3-fused", "3-merge-preload", "3-fused-preload"],
)
def test_matches_two_launches(
    num_splits: int, fused_merge: bool, preload: int, with_norm: bool, kv: str
) -> None:
    """Pages bit for bit (the step's key and value included: the two-launch path writes the
    same bits), the attention within bf16 rounding of the two-launch output."""
    gen = torch.Generator().manual_seed(num_splits + 10 * with_norm + preload + (kv == "fp8"))
    hq, hkv, d = 8, 2, 32
    pools, meta, qkv = decode_case(SEQ_LENS, hq, hkv, d, gen, kv)
    table = rope_table(128, d, 1e6).to(DEVICE)
    weights = (random_bf16(d, generator=gen), random_bf16(d, generator=gen)) if with_norm else (None, None)
    config = replace(SMALL, fused_merge=fused_merge, preload_keys=preload)
    ref_pools = clone_pools(pools)
    ref = two_launches(qkv, ref_pools, meta, table, hq, hkv, weights, config, num_splits)
    out = fused(qkv, pools, meta, table, hq, hkv, weights, config, num_splits)
    for name in pools:
        assert same_bits(pools[name], ref_pools[name]), name
    error = relative_error(out, ref)
    assert error < 2e-3  # measured at most 6.6e-4 (interpreter)


def test_takes_split_k_partials_and_fills_fp8_output() -> None:
    """qkv as the GEMM's unreduced partials (summed while loading, as the two-launch path sums
    them), the output quantized for the o projection."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d = 8, 2, 128
    pools, meta, qkv = decode_case([3, 40], hq, hkv, d, gen)
    parts = torch.randn(3, *qkv.shape, generator=gen).to(DEVICE)
    partials = SplitKPartials(parts)
    table = rope_table(64, d, 1e6).to(DEVICE)
    weights = (random_bf16(d, generator=gen), random_bf16(d, generator=gen))
    ref_pools = clone_pools(pools)
    outputs = []
    for run, target in ((fused, pools), (two_launches, ref_pools)):
        q8 = torch.zeros(2, hq * d, dtype=torch.float8_e4m3fn, device=DEVICE)
        out_fp8 = (q8, new_activation_scales(2, hq * d, DEVICE))
        result = run(partials, target, meta, table, hq, hkv, weights, SMALL, 3, out_fp8=out_fp8)
        assert result is out_fp8
        outputs.append(dequantize_activations(q8, result[1]))
    for name in pools:
        assert same_bits(pools[name], ref_pools[name]), name
    assert relative_error(outputs[0], outputs[1]) < 0.05  # e4m3 steps of the same bf16 values


def test_negative_slot_writes_nothing() -> None:
    """A padding row (slot -1) still attends, but leaves the pages as they were."""
    gen = torch.Generator().manual_seed(8)
    pools, meta, qkv = decode_case([17], 4, 2, 32, gen)
    meta["slot_mapping"] = torch.full_like(meta["slot_mapping"], -1)
    before = clone_pools(pools)
    table = rope_table(64, 32, 1e6).to(DEVICE)
    fused(qkv, pools, meta, table, 4, 2, (None, None), SMALL, 2)
    for name in pools:
        assert same_bits(pools[name], before[name]), name


def test_rejects_mismatched_heads() -> None:
    gen = torch.Generator().manual_seed(9)
    pools, meta, qkv = decode_case([5], 4, 2, 32, gen)
    table = rope_table(64, 32, 1e6).to(DEVICE)
    with pytest.raises(ValueError, match="kv heads"):
        fused(qkv, pools, meta, table, 6, 1, (None, None), SMALL, 1)  # 2 kv heads in the pages


def s2_decode_case(batch: int, context: int, gen: torch.Generator, kv: str):
    """S2-Pro's slow layer (32 q heads, 8 kv heads of 128) at `batch` rows of about `context` keys."""
    lens = [context - (37 * i) % (context // 2) for i in range(batch)]
    return decode_case(lens, 32, 8, 128, gen, kv)


@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("batch,context", [(1, 300), (1, 4096), (16, 500), (64, 300), (64, 2048)])
def test_full_s2_shapes_match_two_launches(batch: int, context: int, kv: str) -> None:
    """On the GPU, with the qkv GEMM's bf16 partials and the tuned entry (with and without keys
    loaded before the wait): the keys written may differ from the two-launch path's in the last bit
    where the 4-warp program sums a head's squares in another order than that kernel's single warp
    (a few elements at most), the output within bf16 rounding."""
    gen = torch.Generator().manual_seed(batch + context)
    pools, meta, qkv = s2_decode_case(batch, context, gen, kv)
    parts = SplitKPartials((torch.randn(4, *qkv.shape, generator=gen) * 0.7).to(torch.bfloat16).to(DEVICE))
    table = rope_table(8192, 128, 1e6).to(DEVICE)
    weights = (random_bf16(128, generator=gen), random_bf16(128, generator=gen))
    tuned = attention.decode_config(batch, kv_fp8=kv == "fp8")
    for config in (tuned, replace(tuned, preload_keys=32), replace(tuned, preload_keys=64)):
        fused_pools, ref_pools = clone_pools(pools), clone_pools(pools)
        ref = two_launches(parts, ref_pools, meta, table, 32, 8, weights, config, None)
        out = fused(parts, fused_pools, meta, table, 32, 8, weights, config, None)
        for name in pools:
            got, want = fused_pools[name].float(), ref_pools[name].float()
            differing = (got != want).sum().item()
            assert differing <= 0.001 * got.numel() + 8 * batch, (name, differing)
        assert relative_error(out, ref) < 5e-3
