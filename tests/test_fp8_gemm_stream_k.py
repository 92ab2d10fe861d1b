"""Stream-K FP8 GEMM (`kernels/fp8_gemm_stream_k.py`): the plan deals every unit out once, the
launch matches the split-K kernel to rounding, its partials reduce to its own result bit for bit,
unused slots read zero, and the workspace comes back reusable. Interpreter on the CPU; S2 shapes
on the GPU."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from fp8_testing import DEVICE, S2_SHAPES, fp8_weight, rel_err  # noqa: E402

from shoal.kernels import fp8_gemm as gemm  # noqa: E402
from shoal.kernels import quant  # noqa: E402
from shoal.kernels import reference as ref  # noqa: E402
from shoal.kernels.fp8_gemm_stream_k import StreamKPlan  # noqa: E402


@pytest.mark.parametrize(
    "n,k,block_n,programs",
    [
        (2560, 9728, 64, 132),
        (19456, 2560, 64, 132),
        (19456, 2560, 128, 264),
        (256, 640, 32, 6),
        (64, 128, 32, 9),
    ],
)
def test_plan_deals_every_unit_to_one_program_and_counts_slots(n, k, block_n, programs) -> None:
    plan = StreamKPlan.make(n, k, block_n, 128, programs)
    assert plan.programs <= programs and plan.programs * plan.units_per_program >= plan.units
    assert (plan.programs - 1) * plan.units_per_program < plan.units  # no program without work
    owners = [unit // plan.units_per_program for unit in range(plan.units)]
    for tile in range(plan.n_tiles):
        covering = set(owners[tile * plan.k_blocks : (tile + 1) * plan.k_blocks])
        assert len(covering) == plan.tile_slots(tile) <= plan.slots
        assert covering == set(range(min(covering), max(covering) + 1))
    assert plan.slots == max(plan.tile_slots(t) for t in range(plan.n_tiles))


# 256 x 640 at block_n 32: 8 tiles x 5 K steps = 40 units; 6 programs of 7 units cross tiles
# (2 or 3 slots per tile); 9 programs of 5 units on 64 x 128 leave the last program short.
CASES = [(1, 256, 640, 6), (3, 256, 640, 6), (20, 256, 640, 4), (2, 64, 128, 9), (1, 96, 384, 40)]


@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
@pytest.mark.parametrize("m,n,k,programs", CASES)
def test_stream_k_matches_split_k_and_reduces_its_own_partials(m, n, k, programs, tma) -> None:
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    config = gemm.GemmConfig(16, 32, 1, 2, 1, tma=tma, stream_k=programs)
    partial_elements, tiles = gemm.SplitKWorkspace.required(m, n, config, k)
    plan = config.stream_k_plan(n, k)
    assert partial_elements == plan.slots * m * n and tiles == -(-m // 16) * plan.n_tiles
    workspace = gemm.SplitKWorkspace(partial_elements, tiles, DEVICE)
    workspace.partials.fill_(float("nan"))
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    reduced = gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=out, workspace=workspace, config=config)
    assert reduced is out and (workspace.counters == 0).all()
    assert rel_err(reduced, ref.fp8_gemm(x_q, x_s, w_q, w_s)) < 4e-3
    split = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=gemm.GemmConfig(16, 32, 2, 2, 1))
    assert rel_err(reduced, split) < 8e-3

    workspace.partials.fill_(float("nan"))
    untouched = torch.full_like(out, float("nan"))
    partials = gemm.fp8_gemm(
        x_q, x_s, w_q, w_s, out=untouched, workspace=workspace, config=config, unreduced=True
    )
    assert isinstance(partials, gemm.SplitKPartials) and partials.parts.shape == (plan.slots, m, n)
    assert torch.isnan(untouched.float()).all() and (workspace.counters == 0).all()
    assert torch.isfinite(partials.parts).all(), "a slot was left unwritten (the consumer sums them all)"
    assert torch.equal(partials.reduce(), reduced)


def test_bf16_partials_and_tma_give_the_pointer_path_bits() -> None:
    m, n, k = 2, 256, 640
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    base = gemm.GemmConfig(16, 32, 1, 2, 1, stream_k=6)
    pointers = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=base)
    assert torch.equal(gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=replace(base, tma=True)), pointers)
    halves = replace(base, bf16_partials=True)
    need, _ = gemm.SplitKWorkspace.required(m, n, halves, k)
    assert need == (base.stream_k_plan(n, k).slots * m * n + 1) // 2
    partials = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=halves, unreduced=True)
    assert partials.parts.dtype == torch.bfloat16
    reduced = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=halves)
    assert torch.equal(partials.reduce(), reduced) and rel_err(reduced, pointers) < 1e-2


def test_stream_k_refuses_what_it_does_not_do() -> None:
    n, k = 64, 256
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    config = gemm.GemmConfig(16, 32, 1, 2, 1, stream_k=4)
    with pytest.raises(ValueError, match="pre-quantized"):
        gemm.fp8_linear(x, w_q, w_s, True, config=config)
    with pytest.raises(ValueError, match="pass k"):
        gemm.SplitKWorkspace.required(1, n, config)
    workspace = gemm.SplitKWorkspace(1, 1, DEVICE)
    with pytest.raises(ValueError, match="workspace too small"):
        gemm.fp8_gemm(*quant.quantize_activations(x), w_q, w_s, workspace=workspace, config=config)
    # one program streaming every unit is allowed (scales come one unit ahead, not preloaded)
    long_k = 128 * 40
    w_q, w_s = fp8_weight(32, long_k)
    x_q, x_s = quant.quantize_activations(torch.randn(1, long_k, device=DEVICE).to(torch.bfloat16))
    single = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=gemm.GemmConfig(16, 32, 1, 2, 1, stream_k=1))
    assert rel_err(single, ref.fp8_gemm(x_q, x_s, w_q, w_s)) < 4e-3


def test_a_tuned_stream_k_entry_leaves_inline_quantization_on_split_k(monkeypatch) -> None:
    """The FP8 table also serves `fp8_linear(quantize_input=True)`, which stream-K does not take."""
    n, k = 64, 256
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(1, k, device=DEVICE).to(torch.bfloat16)
    monkeypatch.setitem(gemm.TUNED_CONFIGS_FP8, (n, k, 1), gemm.GemmConfig(16, 32, 1, 2, 1, stream_k=4))
    inline = gemm.fp8_linear(x, w_q, w_s, True)
    prequantized = gemm.fp8_gemm(*quant.quantize_activations(x), w_q, w_s)
    assert rel_err(inline, prequantized) < 8e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", list(S2_SHAPES))
@pytest.mark.parametrize("m", [1, 4, 16])
def test_s2_shapes_on_the_gpu(shape: str, m: int) -> None:
    n, k = S2_SHAPES[shape]
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    expected = ref.fp8_gemm(x_q, x_s, w_q, w_s)
    for config in (
        gemm.GemmConfig(16, 64, 1, 4, 6, tma=True, stream_k=132),
        gemm.GemmConfig(16, 128, 1, 4, 4, tma=True, stream_k=264),
        gemm.GemmConfig(16, 64, 1, 4, 4, stream_k=264, bf16_partials=True),
    ):
        workspace = gemm.SplitKWorkspace(*gemm.SplitKWorkspace.required(m, n, config, k), DEVICE)
        out = gemm.fp8_gemm(x_q, x_s, w_q, w_s, workspace=workspace, config=config)
        assert rel_err(out, expected) < 8e-3, config
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = gemm.fp8_gemm(x_q, x_s, w_q, w_s, workspace=workspace, config=config)
        for _ in range(3):
            graph.replay()
        assert torch.equal(replayed, out) and (workspace.counters == 0).all()
        partials = gemm.fp8_gemm(x_q, x_s, w_q, w_s, workspace=workspace, config=config, unreduced=True)
        assert torch.equal(partials.reduce(), out)
