"""Block-scaled FP8 GEMM (`kernels/fp8_gemm.py`) against the torch reference, every activation mode.

On a machine without CUDA the Triton interpreter runs the kernels (set before triton is imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
from fp8_testing import DEVICE, S2_SHAPES, fp8_weight, poisoned_out, rel_err  # noqa: E402

from shoal.kernels import fp8_gemm as gemm  # noqa: E402
from shoal.kernels import quant  # noqa: E402
from shoal.kernels import reference as ref  # noqa: E402

CONFIGS = [
    gemm.GemmConfig(block_m=16, block_n=32, split_k=1, num_warps=2, num_stages=1),
    gemm.GemmConfig(block_m=16, block_n=64, split_k=3, num_warps=2, num_stages=1),
]
SWAPPED = gemm.GemmConfig(block_m=16, block_n=32, split_k=2, num_warps=2, num_stages=1, swap_ab=True)


@pytest.mark.parametrize("config", [*CONFIGS, SWAPPED], ids=["nosplit", "split3", "swap-split2"])
@pytest.mark.parametrize("m,n,k", [(1, 96, 384), (5, 160, 256), (17, 64, 200)])
def test_w8a8_prequantized_matches_reference(config: gemm.GemmConfig, m: int, n: int, k: int) -> None:
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    x_q, x_s = quant.quantize_activations(x)
    out = gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=poisoned_out(m, n), config=config)
    assert rel_err(out, ref.fp8_gemm(x_q, x_s, w_q, w_s)) < 4e-3


def test_activation_scales_loaded_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback that loads activation scales inside the K loop (large BLOCK_M x steps)."""
    monkeypatch.setattr(gemm, "PRELOAD_A_SCALES_LIMIT", 0)
    m, n, k = 3, 64, 384
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    for config in (CONFIGS[0], SWAPPED):
        out = gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=poisoned_out(m, n), config=config)
        assert rel_err(out, ref.fp8_gemm(x_q, x_s, w_q, w_s)) < 4e-3


@pytest.mark.parametrize("base", [CONFIGS[0], CONFIGS[1], SWAPPED], ids=["nosplit", "split3", "swap-split2"])
def test_tma_loads_equal_pointer_loads(base: gemm.GemmConfig) -> None:
    """Descriptor loads zero-fill past M, N and K exactly as the masked pointer loads do: the
    same tiles, the same products, bit-identical output (M, N and K all ragged here)."""
    m, n, k = 5, 160, 400
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    plain = gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=poisoned_out(m, n), config=base)
    tma = gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=poisoned_out(m, n), config=replace(base, tma=True))
    assert torch.isfinite(plain).all() and torch.equal(tma, plain)


def test_tma_needs_aligned_rows() -> None:
    w_q, w_s = fp8_weight(64, 136)
    x_q, x_s = quant.quantize_activations(torch.randn(2, 136, device=DEVICE).to(torch.bfloat16))
    with pytest.raises(ValueError, match="K % 16"):
        gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=replace(CONFIGS[0], tma=True))


def test_rejects_block_n_that_does_not_divide_128() -> None:
    w_q, w_s = fp8_weight(256, 256)
    x = torch.randn(1, 256, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="block_n"):
        gemm.fp8_linear(x, w_q, w_s, False, config=gemm.GemmConfig(16, 256, 1))


@pytest.mark.parametrize("swap_ab", [False, True], ids=["ab", "swap-ab"])
@pytest.mark.parametrize("quantize_input", [False, True], ids=["w8a16", "w8a8-inline"])
@pytest.mark.parametrize("swiglu_input", [False, True], ids=["plain", "swiglu"])
def test_fp8_linear_modes_match_reference(quantize_input: bool, swiglu_input: bool, swap_ab: bool) -> None:
    m, n, k = 3, 192, 256
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(m, 2 * k if swiglu_input else k, device=DEVICE).to(torch.bfloat16)
    expected = ref.fp8_linear(x, w_q, w_s, quantize_input=quantize_input, swiglu_input=swiglu_input)
    config = SWAPPED if swap_ab else CONFIGS[1]
    out = gemm.fp8_linear(x, w_q, w_s, quantize_input, swiglu_input, out=poisoned_out(m, n), config=config)
    assert rel_err(out, expected) < 4e-3
    # and the FP8 product is close to the unquantized bf16 one (the error FP8 costs the model)
    a = ref.swiglu(x) if swiglu_input else x.float()
    exact = a @ ref.dequantize_weight(w_q, w_s).t()
    assert rel_err(out, exact) < (0.06 if quantize_input else 4e-3)


def test_inline_quantization_equals_separate_quant_launch() -> None:
    """The fused-in-GEMM activation quantization computes what `quant.swiglu_quantize` + GEMM does."""
    m, n, k = 2, 128, 384
    w_q, w_s = fp8_weight(n, k)
    gate_up = torch.randn(m, 2 * k, device=DEVICE).to(torch.bfloat16)
    fused = gemm.fp8_linear(gate_up, w_q, w_s, True, True, config=CONFIGS[0])
    separate = gemm.fp8_gemm(*quant.swiglu_quantize(gate_up), w_q, w_s, config=CONFIGS[0])
    assert rel_err(fused, separate) < 1e-2


def test_split_k_workspace_is_reusable_and_deterministic() -> None:
    m, n, k = 4, 64, 512
    w_q, w_s = fp8_weight(n, k)
    config = gemm.GemmConfig(block_m=16, block_n=32, split_k=4, num_warps=2, num_stages=1)
    partials, tiles = gemm.SplitKWorkspace.required(m, n, config)
    workspace = gemm.SplitKWorkspace(partials, tiles, DEVICE)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    first = gemm.fp8_linear(x, w_q, w_s, False, workspace=workspace, config=config)
    assert (workspace.counters == 0).all(), "counters must be reset for the next launch / graph replay"
    second = gemm.fp8_linear(x, w_q, w_s, False, out=poisoned_out(m, n), workspace=workspace, config=config)
    assert torch.equal(first, second)
    small = gemm.SplitKWorkspace(partials - 1, tiles, DEVICE)
    with pytest.raises(ValueError, match="workspace too small"):
        gemm.fp8_linear(x, w_q, w_s, False, workspace=small, config=config)


@pytest.mark.parametrize("inline", [False, True], ids=["prequantized", "inline-swiglu"])
def test_unreduced_split_k_returns_the_partials_of_the_reduced_result(inline: bool) -> None:
    """`unreduced=True`: the split programs write only their partials (no counter touched, `out`
    left alone) and `SplitKPartials.reduce()` gives the reducing launch's bits; without split the
    launch writes `out` as usual."""
    m, n, k = 3, 64, 768
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(m, 2 * k if inline else k, device=DEVICE).to(torch.bfloat16)
    config = gemm.GemmConfig(block_m=16, block_n=32, split_k=4, num_warps=2, num_stages=1)
    workspace = gemm.SplitKWorkspace(*gemm.SplitKWorkspace.required(m, n, config), DEVICE)

    def launch(config, **kwargs):
        if inline:
            return gemm.fp8_linear(x, w_q, w_s, True, True, workspace=workspace, config=config, **kwargs)
        return gemm.fp8_gemm(
            *quant.quantize_activations(x), w_q, w_s, workspace=workspace, config=config, **kwargs
        )

    reduced = launch(config)
    untouched = poisoned_out(m, n)
    workspace.partials.fill_(float("nan"))
    partials = launch(config, out=untouched, unreduced=True)
    assert isinstance(partials, gemm.SplitKPartials) and partials.parts.shape == (4, m, n)
    assert partials.parts.data_ptr() == workspace.partials.data_ptr()
    assert torch.equal(partials.reduce(), reduced)
    assert torch.isnan(untouched.float()).all() and (workspace.counters == 0).all()
    whole = launch(replace(config, split_k=1), out=poisoned_out(m, n), unreduced=True)
    assert isinstance(whole, torch.Tensor) and rel_err(whole, reduced) < 4e-3


@pytest.mark.parametrize("inline", [False, True], ids=["prequantized", "inline-swiglu"])
def test_bf16_partials_round_each_split_once(inline: bool) -> None:
    """`bf16_partials`: each split's fp32 partial is stored rounded to bf16 (half the workspace),
    the reducing launch and `SplitKPartials.reduce()` sum them in fp32 in split order, and the
    result stays within bf16 rounding of the fp32-partial result."""
    m, n, k = 3, 64, 768
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(m, 2 * k if inline else k, device=DEVICE).to(torch.bfloat16)
    config = gemm.GemmConfig(block_m=16, block_n=32, split_k=4, num_warps=2, num_stages=1, bf16_partials=True)
    need, tiles = gemm.SplitKWorkspace.required(m, n, config)
    assert need == (4 * m * n + 1) // 2  # fp32 elements: half of fp32 partials
    workspace = gemm.SplitKWorkspace(need, tiles, DEVICE)

    def launch(config, workspace=workspace, **kwargs):
        if inline:
            return gemm.fp8_linear(x, w_q, w_s, True, True, workspace=workspace, config=config, **kwargs)
        return gemm.fp8_gemm(
            *quant.quantize_activations(x), w_q, w_s, workspace=workspace, config=config, **kwargs
        )

    partials = launch(config, unreduced=True)
    assert isinstance(partials, gemm.SplitKPartials) and partials.parts.dtype == torch.bfloat16
    assert partials.parts.data_ptr() == workspace.partials.data_ptr()
    reduced = launch(config, out=poisoned_out(m, n))
    assert torch.equal(partials.reduce(), reduced) and (workspace.counters == 0).all()
    fp32 = launch(replace(config, bf16_partials=False), workspace=None)
    expected = sum(p.float() for p in partials.parts)  # the rounded partials, summed in order
    assert torch.equal(reduced, expected.to(torch.bfloat16))
    assert rel_err(reduced, fp32) < 1e-2
    with pytest.raises(ValueError, match="workspace too small"):
        launch(replace(config, bf16_partials=False))  # fp32 partials need twice the room


def test_bf16_partials_everywhere_marks_split_configs_only_while_active() -> None:
    """M = 128's entries (the Triton kernel, fp32 partials; every Gluon entry stores bf16 ones)."""
    split, whole = (
        gemm.pick_config(2560, 9728, 128, fp8_activations=True),
        gemm.pick_config(19456, 2560, 128, fp8_activations=True),
    )
    assert split.split_k > 1 and whole.split_k == 1 and not split.bf16_partials
    with gemm.bf16_partials_everywhere():
        assert gemm.pick_config(2560, 9728, 128, fp8_activations=True) == replace(split, bf16_partials=True)
        assert (
            gemm.pick_config(19456, 2560, 128, fp8_activations=True) == whole
        )  # nothing to store without a split
    assert gemm.pick_config(2560, 9728, 128, fp8_activations=True) == split


def test_rejects_transposed_or_restrided_scales() -> None:
    w_q, w_s = fp8_weight(256, 384)  # scale grid 2 x 3
    x = torch.randn(1, 384, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="weight_scale"):
        gemm.fp8_linear(x, w_q, w_s.t().contiguous(), False)
    square_q, square_s = fp8_weight(256, 256)
    with pytest.raises(ValueError, match="contiguous"):
        gemm.fp8_linear(x[:, :256], square_q, square_s.t(), False)


def test_default_config_fills_the_gpu() -> None:
    for n, k in S2_SHAPES.values():
        for m in (1, 4, 16, 64, 128):
            config = gemm.default_config(n, k, m)
            programs = -(-m // config.block_m) * -(-n // config.block_n) * config.split_k
            assert programs >= gemm.H200_SMS, (n, k, m, config)
            assert config.split_k <= -(-k // 128)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 16, 64, 128, 300, 1000])
@pytest.mark.parametrize("shape", list(S2_SHAPES), ids=list(S2_SHAPES))
@pytest.mark.parametrize("mode", ["w8a8", "w8a8-inline", "w8a16"])
def test_full_s2_shapes_gpu(m: int, shape: str, mode: str) -> None:
    n, k = S2_SHAPES[shape]
    w_q, w_s = fp8_weight(n, k)
    swiglu = shape == "down" and mode != "w8a8"
    x = torch.randn(m, 2 * k if swiglu else k, device=DEVICE).to(torch.bfloat16)
    out = poisoned_out(m, n)
    if mode == "w8a8":
        x_q, x_s = quant.quantize_activations(x)
        gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=out)
        expected = ref.fp8_gemm(x_q, x_s, w_q, w_s)
    else:
        gemm.fp8_linear(x, w_q, w_s, mode == "w8a8-inline", swiglu, out=out)
        expected = ref.fp8_linear(x, w_q, w_s, mode == "w8a8-inline", swiglu)
    torch.cuda.synchronize()
    assert rel_err(out, expected) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 128])
@pytest.mark.parametrize("shape", list(S2_SHAPES), ids=list(S2_SHAPES))
def test_tma_full_s2_shapes_gpu(m: int, shape: str) -> None:
    """On the GPU the descriptor loads (real TMA) give what the pointer loads give, bit for bit,
    inside a CUDA graph."""
    n, k = S2_SHAPES[shape]
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    config = replace(gemm.pick_config(n, k, m, x_q.device, fp8_activations=True), tma=True)
    workspace = gemm.SplitKWorkspace(*gemm.SplitKWorkspace.required(m, n, config), DEVICE)
    plain = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=replace(config, tma=False))
    out = poisoned_out(m, n)
    gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=out, workspace=workspace, config=config)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=out, workspace=workspace, config=config)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)


@pytest.mark.gpu
def test_cuda_graph_replay_gpu() -> None:
    n, k = S2_SHAPES["down"]
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(4, k, device=DEVICE).to(torch.bfloat16)
    config = gemm.pick_config(n, k, 4, x.device)
    workspace = gemm.SplitKWorkspace(*gemm.SplitKWorkspace.required(4, n, config), DEVICE)
    out = poisoned_out(4, n)
    gemm.fp8_linear(x, w_q, w_s, True, out=out, workspace=workspace)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm.fp8_linear(x, w_q, w_s, True, out=out, workspace=workspace)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref.fp8_linear(x, w_q, w_s, True)) < 4e-3


def test_tuned_configs_are_launchable() -> None:
    """Every table entry: a tile width dividing the scale block, >= 2 K steps per split."""
    for table in (gemm.TUNED_CONFIGS, gemm.TUNED_CONFIGS_FP8):
        for (n, k, bucket), config in table.items():
            assert bucket in gemm.M_BUCKETS and 128 % config.block_n == 0, (n, k, bucket, config)
            assert -(-k // 128) // config.split_k >= 2, (n, k, bucket, config)
            assert gemm.pick_config(n, k, bucket, fp8_activations=table is gemm.TUNED_CONFIGS_FP8) is config


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("shape", ["qkv", "o", "down"])
def test_consumers_of_unreduced_partials_at_s2_shapes_gpu(m: int, shape: str) -> None:
    """With the tuned configs (split K, TMA where tuned) on the GPU: the norm (o, down) or the
    QK-norm/RoPE/KV-write kernel (qkv) fed the GEMM's partials writes exactly what it writes on
    the GEMM's reduced output."""
    from shoal.kernels.norm_rope import qk_norm_rope_kv_write, rms_norm
    from shoal.models.layers import rope_table

    n, k = S2_SHAPES[shape]
    w_q, w_s = fp8_weight(n, k)
    x_q, x_s = quant.quantize_activations(torch.randn(m, k, device=DEVICE).to(torch.bfloat16))
    reduced = gemm.fp8_gemm(x_q, x_s, w_q, w_s)
    partials = gemm.fp8_gemm(x_q, x_s, w_q, w_s, unreduced=True)
    assert isinstance(partials, gemm.SplitKPartials), "the tuned config splits K at these shapes"
    assert torch.equal(partials.reduce(), reduced)
    if shape == "qkv":
        hq, hkv, d = 32, 8, 128
        positions = torch.arange(m, device=DEVICE) * 7
        table = rope_table(1024, d, 1e6).to(DEVICE)
        norm_w = torch.rand(d, device=DEVICE).to(torch.bfloat16)
        slots = torch.arange(m, device=DEVICE)
        results = []
        for qkv in (partials, reduced):
            k_pages = torch.zeros(m, 1, hkv, d, dtype=torch.bfloat16, device=DEVICE)
            v_pages = torch.zeros_like(k_pages)
            q = qk_norm_rope_kv_write(qkv, positions, table, k_pages, v_pages, slots, hq, hkv, norm_w, norm_w)
            results.append((q, k_pages, v_pages))
        for got, want in zip(*results, strict=True):
            assert torch.equal(got, want)
    else:
        weight = torch.rand(n, device=DEVICE).to(torch.bfloat16)
        residual = torch.randn(m, n, device=DEVICE).to(torch.bfloat16)
        for slice_groups in (None, 4):
            results = []
            for x in (partials, reduced):
                spare = torch.empty_like(residual) if slice_groups else None
                results.append(
                    rms_norm(x, weight, 1e-6, residual.clone(), residual_out=spare, slice_groups=slice_groups)
                )
            (normed, summed), (normed_ref, summed_ref) = results
            assert torch.equal(normed, normed_ref) and torch.equal(summed, summed_ref)


@pytest.mark.parametrize(
    "config",
    [SWAPPED, CONFIGS[1], replace(SWAPPED, tma=True), replace(CONFIGS[0], tma=True)],
    ids=["swap-split2", "split3", "swap-tma", "tma-nosplit"],
)
@pytest.mark.parametrize("m,n,k", [(1, 96, 384), (5, 160, 640), (17, 64, 200)])
def test_scales_ahead_gives_the_same_bits(config: gemm.GemmConfig, m: int, n: int, k: int) -> None:
    """`scales_ahead`: the K step's scales loaded one step ahead instead of picked from preloaded
    vectors. Same values, same arithmetic, so the same bits, reduced or left as partials; inline
    quantization (scales made in the GEMM) ignores the flag."""
    if config.tma and k % 16:
        pytest.skip("TMA needs K % 16 == 0")
    w_q, w_s = fp8_weight(n, k)
    x = torch.randn(m, k, device=DEVICE).to(torch.bfloat16)
    x_q, x_s = quant.quantize_activations(x)
    ahead = replace(config, scales_ahead=True)
    base = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=config)
    assert torch.equal(gemm.fp8_gemm(x_q, x_s, w_q, w_s, out=poisoned_out(m, n), config=ahead), base)
    if config.split_k > 1:
        parts = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=ahead, unreduced=True)
        assert torch.equal(parts.reduce(), base)
    inline = replace(ahead, tma=False)
    assert torch.equal(
        gemm.fp8_linear(x, w_q, w_s, True, config=inline),
        gemm.fp8_linear(x, w_q, w_s, True, config=replace(inline, scales_ahead=False)),
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 16, 64, 128])
def test_scales_ahead_at_s2_shapes_gives_the_tuned_configs_bits(m: int) -> None:
    """The tuned table's configs with and without `scales_ahead` on the GPU: the same bits, as a
    graph too."""
    x = torch.randn(m, 9728, device=DEVICE).to(torch.bfloat16)
    for name, (n, k) in S2_SHAPES.items():
        w_q, w_s = fp8_weight(n, k)
        x_q, x_s = quant.quantize_activations(x[:, :k].contiguous())
        config = replace(gemm.pick_config(n, k, m, x.device, fp8_activations=True), scales_ahead=False)
        base = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=config)
        ahead = replace(config, scales_ahead=True)
        workspace = gemm.SplitKWorkspace(*gemm.SplitKWorkspace.required(m, n, ahead), DEVICE)
        graph = torch.cuda.CUDAGraph()
        gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=ahead, workspace=workspace)  # compile outside
        with torch.cuda.graph(graph):
            replayed = gemm.fp8_gemm(x_q, x_s, w_q, w_s, config=ahead, workspace=workspace)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed, base), (name, m, config)
