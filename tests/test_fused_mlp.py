"""The persistent fused MLP (`kernels/fused_mlp.py`) against the three-launch chain it replaces:
gate+up GEMM, `swiglu_quantize`, down GEMM with unreduced split-K partials. Same tiles and the
same arithmetic per tile, so the partials must be equal bit for bit. On the CPU each phase is its
own interpreted launch; on the GPU one launch with grid barriers, also as a graph replayed."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from fp8_testing import DEVICE, fp8_weight  # noqa: E402

from shoal.kernels import fp8_gemm as gemm  # noqa: E402
from shoal.kernels import quant  # noqa: E402
from shoal.kernels import reference as ref  # noqa: E402
from shoal.kernels.fused_mlp import FusedMlpConfig, FusedMlpWorkspace, fused_mlp  # noqa: E402


def _chain(x_q, x_s, up, down, config: FusedMlpConfig) -> gemm.SplitKPartials:
    """Today's three launches with the fused config's tiles."""
    up_config = gemm.GemmConfig(
        16, config.block_n_up, 1, config.num_warps, config.num_stages, swap_ab=True, tma=config.tma
    )
    down_config = gemm.GemmConfig(
        16, config.block_n_down, config.split_down, config.num_warps, config.num_stages,
        swap_ab=True, tma=config.tma, bf16_partials=config.bf16_partials,
    )  # fmt: skip
    gate_up = gemm.fp8_gemm(x_q, x_s, *up, config=up_config)
    h_q, h_s = quant.swiglu_quantize(gate_up)
    return gemm.fp8_gemm(h_q, h_s, *down, config=down_config, unreduced=True)


SMALL = FusedMlpConfig(
    programs=5, block_n_up=32, block_n_down=32, split_down=3, num_warps=2, num_stages=1, tma=False
)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize(
    "config",
    [
        SMALL,
        replace(SMALL, tma=True),
        replace(SMALL, bf16_partials=True, programs=7),
        replace(SMALL, sync="dataflow"),
        replace(SMALL, sync="dataflow", tma=True, block_n_up=64, programs=3),
    ],
    ids=["ptr", "tma", "bf16", "dataflow", "dataflow-tma"],
)
def test_fused_mlp_equals_the_three_launch_chain(m: int, config: FusedMlpConfig) -> None:
    hidden, inter = 256, 384  # 3 groups of SwiGLU output; the down K split over 3 programs
    up, down = fp8_weight(2 * inter, hidden, magnitude=0.05), fp8_weight(hidden, inter, magnitude=0.05)
    x_q, x_s = quant.quantize_activations(torch.randn(m, hidden, device=DEVICE).to(torch.bfloat16))
    workspace = FusedMlpWorkspace(hidden, inter, 4, config.split_down, DEVICE)
    workspace.partials.fill_(float("nan"))
    fused = fused_mlp(x_q, x_s, *up, *down, workspace, config)
    chain = _chain(x_q, x_s, up, down, config)
    assert fused.parts.shape == chain.parts.shape == (config.split_down, m, hidden)
    assert fused.parts.dtype == chain.parts.dtype
    assert torch.equal(fused.parts, chain.parts)
    assert torch.equal(fused.reduce(), chain.reduce())
    assert (workspace.counter == 0).all(), "counters and ready flags must be back at 0 for the next launch"
    # and the chain is the MLP: against the bf16 model's arithmetic on dequantized weights
    w_up, w_down = ref.dequantize_weight(*up), ref.dequantize_weight(*down)
    x = ref.dequantize_activations(x_q, x_s)
    gate, upv = (x @ w_up.t()).chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * upv) @ w_down.t()
    error = (fused.reduce().float() - expected).norm() / expected.norm()
    assert error < 0.05


def test_fused_mlp_refuses_bad_inputs() -> None:
    hidden, inter = 256, 384
    up, down = fp8_weight(2 * inter, hidden, magnitude=0.05), fp8_weight(hidden, inter, magnitude=0.05)
    workspace = FusedMlpWorkspace(hidden, inter, 2, SMALL.split_down, DEVICE)
    x_q, x_s = quant.quantize_activations(torch.randn(3, hidden, device=DEVICE).to(torch.bfloat16))
    with pytest.raises(ValueError, match="rows"):
        fused_mlp(x_q, x_s, *up, *down, workspace, SMALL)
    with pytest.raises(ValueError, match="weights must be"):
        fused_mlp(x_q[:1], x_s[:1], *down, *down, workspace, SMALL)
    with pytest.raises(ValueError, match="sync"):
        replace(SMALL, sync="spin")
    with pytest.raises(ValueError, match="block_n_up"):
        replace(SMALL, block_n_up=48)
    with pytest.raises(ValueError, match="split"):
        fused_mlp(x_q[:1], x_s[:1].contiguous(), *up, *down, workspace, replace(SMALL, split_down=7))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4, 16])
def test_s2_mlp_on_the_gpu_one_launch_with_grid_barriers(m: int) -> None:
    hidden, inter = 2560, 9728
    up, down = fp8_weight(2 * inter, hidden, magnitude=0.05), fp8_weight(hidden, inter, magnitude=0.05)
    x_q, x_s = quant.quantize_activations(torch.randn(m, hidden, device=DEVICE).to(torch.bfloat16))
    for config in (
        FusedMlpConfig(),
        FusedMlpConfig(programs=76, num_stages=6),
        FusedMlpConfig(bf16_partials=True),
    ):
        workspace = FusedMlpWorkspace(hidden, inter, 16, config.split_down, DEVICE)
        chain = _chain(x_q, x_s, up, down, config)
        fused = fused_mlp(x_q, x_s, *up, *down, workspace, config)
        torch.cuda.synchronize()
        assert torch.equal(fused.parts, chain.parts), config
        assert (workspace.counter == 0).all()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = fused_mlp(x_q, x_s, *up, *down, workspace, config)
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed.parts, chain.parts) and (workspace.counter == 0).all()


def test_resident_programs_per_sm_bound() -> None:
    """The launcher's co-residency bound: 4 stages of 64-row tiles fit four programs an SM (by
    shared memory and by 128 registers a thread), 6 stages three, 8 warps two."""
    from shoal.kernels.fused_mlp import resident_per_sm

    assert resident_per_sm(FusedMlpConfig()) == 4
    assert resident_per_sm(FusedMlpConfig(num_stages=6)) == 3
    assert resident_per_sm(FusedMlpConfig(num_warps=8)) == 2
    assert FusedMlpConfig().programs <= 132 * resident_per_sm(FusedMlpConfig())
