"""FP8 weights in the engine (`EngineConfig.weight_format="fp8"`, `engine/fp8_weights.py`) on the CPU.

- the engine on an FP8-quantized tiny model gives exactly the frames of `reference.generate` on the
  same model (both the reference and the torch-ops fast step: the dequantized arithmetic path);
- loading: quantize at load, an FP8 checkpoint, and a broken scale layout refused;
- `Fp8Projections` (the fused step's FP8 GEMMs): the reference backend equals the layers' own
  forward, the Triton kernels (interpreter) equal the reference up to bf16 output rounding for
  every variant, reserved buffers are reused, and the kernel decode step with FP8 tracks the
  torch step;
- the correctness gate through the engine path on the gate's planted-margin model.
"""

from __future__ import annotations

import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402
from model_testing import tiny_s2  # noqa: E402

from shoal.bench import gate, gate_correctness  # noqa: E402
from shoal.config import EngineConfig  # noqa: E402
from shoal.engine.batch import DecodeBuffers  # noqa: E402
from shoal.engine.core import EngineCore  # noqa: E402
from shoal.engine.decode_step import DecodeStep  # noqa: E402
from shoal.engine.fp8_weights import (  # noqa: E402
    M_BUCKETS,
    PREFILL_BUCKETS,
    VARIANTS,
    Fp8Projections,
    graph_row_counts,
    m_bucket,
    prepare_model,
    variant_for,
)
from shoal.engine.load import load_engine_model  # noqa: E402
from shoal.engine.request import SamplingParams  # noqa: E402
from shoal.models import load_model  # noqa: E402
from shoal.models.reference import generate  # noqa: E402
from shoal.models.writer import random_state_dict, tiny_config, write_checkpoint  # noqa: E402
from shoal.quant import fp8  # noqa: E402
from shoal.quant.fp8_head import Fp8RoundedHead  # noqa: E402
from shoal.quant.fp8_linear import Fp8Linear, LayoutError, fp8_layers, quantize_model_  # noqa: E402
from shoal.tuning import TUNING


def prompt_for(model, length: int, seed: int) -> torch.Tensor:
    c = model.config
    g = torch.Generator().manual_seed(seed)
    prompt = torch.zeros(c.num_codebooks + 1, length, dtype=torch.long)
    prompt[0] = torch.randint(0, c.semantic_begin_id, (length,), generator=g)
    codes = torch.randint(0, c.codebook_size, (c.num_codebooks, length - length // 2), generator=g)
    prompt[1:, length // 2 :] = codes
    prompt[0, length // 2 :] = c.semantic_begin_id + codes[0]
    return prompt


def test_weight_format_is_validated() -> None:
    assert EngineConfig().weight_format == "bf16"
    with pytest.raises(ValueError, match="weight_format"):
        EngineConfig(weight_format="int4")


@pytest.mark.parametrize("decode_step", ["reference", "fast"])
def test_fp8_engine_equals_reference_generator_on_the_quantized_model(golden_dir, decode_step: str) -> None:
    model = tiny_s2(golden_dir, torch.float32)
    config = EngineConfig(
        device="cpu", dtype="float32", num_pages=128, page_size=4, max_prefill_tokens=24,
        weight_format="fp8", decode_step=decode_step,
    )  # fmt: skip
    core = EngineCore(model, config)  # quantizes the model in place
    layers = fp8_layers(model)
    assert len(layers) == 5 * (model.config.n_layer + model.config.n_fast_layer)
    assert all(layer.quantize_input for _, layer in layers)
    assert model.embeddings.weight.dtype == torch.float32 and not isinstance(model.fast_output, Fp8Linear)
    assert isinstance(model.fast_output, Fp8RoundedHead)  # the reference below decodes with it too
    jobs = []
    for i in range(4):
        params = SamplingParams(
            temperature=0.6 + 0.1 * i, top_p=0.7 + 0.07 * i, top_k=(3, 30, 1, 64)[i], seed=i
        )
        jobs.append((prompt_for(model, 10 + 3 * i, i), params, 6 + 3 * i))
    requests, pending = [], list(jobs)
    while pending or core.has_work:
        if pending:  # one arrival per step: the batch changes composition
            prompt, params, frames = pending.pop(0)
            requests.append(core.new_request(prompt, params, max_new_frames=frames))
            core.add(requests[-1])
        core.step()
    for request, (prompt, params, frames) in zip(requests, jobs, strict=True):
        want = generate(
            model, prompt, max_frames=frames, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, seed=params.seed,
        )  # fmt: skip
        assert torch.equal(request.frames[: request.num_frames].t(), want)


def test_bf16_engine_refuses_an_fp8_model(golden_dir) -> None:
    model = tiny_s2(golden_dir, torch.float32)
    quantize_model_(model)
    with pytest.raises(ValueError, match="weight_format='fp8'"):
        EngineCore(model, EngineConfig(device="cpu", dtype="float32", num_pages=16))


# ---- loading ------------------------------------------------------------------------------------


def _checkpoint(directory):
    config = tiny_config("s2").replace(dim=256, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=256)
    config = config.replace(fast_dim=256, fast_head_dim=64, fast_intermediate_size=384)
    write_checkpoint(directory, config, random_state_dict(config, seed=4))
    return directory


def test_load_engine_model_quantizes_or_reads_fp8(tmp_path) -> None:
    from shoal.quant.fp8_linear import quantize_checkpoint

    source = _checkpoint(tmp_path / "bf16")
    model, weight_format = load_engine_model(source, "cpu", "float32")
    assert weight_format == "bf16" and not fp8_layers(model)
    model, weight_format = load_engine_model(source, "cpu", "float32", "fp8")  # quantized at load
    assert weight_format == "fp8" and len(fp8_layers(model)) == 5 * (model.config.n_layer + 2)
    out = quantize_checkpoint(source, tmp_path / "fp8")
    loaded, weight_format = load_engine_model(out, "cpu", "float32")  # FP8 detected
    assert weight_format == "fp8"
    a, b = dict(fp8_layers(model)), dict(fp8_layers(loaded))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].weight.view(torch.uint8), b[name].weight.view(torch.uint8)), name
        assert torch.equal(a[name].weight_scale, b[name].weight_scale), name
    with pytest.raises(ValueError, match="FP8 checkpoint"):
        load_engine_model(out, "cpu", "float32", "bf16")


def test_load_engine_model_refuses_a_transposed_scale(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    source = _checkpoint(tmp_path / "bf16")
    model = load_model(source)
    modules = quantize_model_(model)
    out = fp8.write_quantized_checkpoint(source, tmp_path / "fp8", model.state_dict(), modules, True)
    state = load_file(str(out / fp8.WEIGHTS_FILE))
    name = "layers.0.attention.wo.weight_scale"  # 256 x 256: a square 2 x 2 grid
    state[name] = state[name].t().contiguous()
    save_file(state, str(out / fp8.WEIGHTS_FILE))
    with pytest.raises(LayoutError, match="layers.0.attention.wo"):
        load_engine_model(out, "cpu", "float32")


# ---- the fused step's projections ---------------------------------------------------------------


@pytest.fixture(scope="module")
def planted():
    """The gate's model, FP8: intermediate sizes 512 and 384, so gate and up are one GEMM."""
    model = gate_correctness.planted_margin_model()
    prepare_model(model)
    return model


def _bf16_exact(shape, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


def test_variant_choice() -> None:
    assert m_bucket(1) == 1 and m_bucket(3) == 4 and m_bucket(128) == 128 and m_bucket(129) > 128
    assert variant_for(6144, 2560, 1, table={}) == "w8a8"
    assert variant_for(6144, 2560, 1, quantize_activations=False, table={}) == "w8a16"
    assert variant_for(6144, 2560, 300, table={}) == "bf16"
    # Prefill: up to 256 rows on our kernel, then block-scaled cuBLAS.
    assert m_bucket(129) == m_bucket(256) != m_bucket(257) == m_bucket(1024) != m_bucket(1025)
    assert variant_for(19456, 2560, 200) == "w8a8" and variant_for(2560, 9728, 256) == "w8a8"
    assert variant_for(19456, 2560, 300) == "scaled_mm" and variant_for(2560, 4096, 1024) == "scaled_mm"
    assert variant_for(19456, 2560, 1025) == "scaled_mm" and variant_for(2560, 9728, 8192) == "scaled_mm"
    assert variant_for(6144, 2560, 8192) == "scaled_mm"
    # So no S2-Pro projection keeps a bf16 copy of its weight.
    for n, k in ((6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)):  # S2-Pro's projections
        assert all(variant_for(n, k, bucket) != "bf16" for bucket in (*M_BUCKETS, *PREFILL_BUCKETS))
    assert variant_for(6144, 2560, 3, table={(6144, 2560, 4): "w8a8_inline"}) == "w8a8_inline"
    assert graph_row_counts((1, 4)) == {1, 2, 4, 8}


def test_gate_up_concatenation_is_exact(planted, golden_dir) -> None:
    projections = Fp8Projections(planted, backend="reference", emulate_kernels=False)
    assert all(b.gate_up is not None for b in projections.blocks.values())
    for block in (planted.layers[1], planted.fast_layers[0]):
        b, ff = projections.blocks[id(block)], block.feed_forward
        assert ff.w1.weight.data_ptr() == b.gate_up.q.data_ptr()  # the layers hold views: one copy
        ff.w1.check_layout("w1")
        ff.w3.check_layout("w3")
        x = _bf16_exact((3, ff.w1.in_features), 1)
        both = projections._linear(b.gate_up, x)
        torch.testing.assert_close(both, torch.cat([ff.w1(x), ff.w3(x)], dim=1), rtol=1e-6, atol=1e-6)
        attn = block.attention
        assert torch.equal(projections.qkv(block, x), attn.wqkv(x))
        y = _bf16_exact((3, attn.wo.in_features), 2)
        assert torch.equal(projections.out_proj(block, y), attn.wo(y))
    halves = Fp8Projections(_prepared_tiny(golden_dir), backend="reference")
    assert all(b.gate_up is None for b in halves.blocks.values())  # intermediate 160, 96: not exact


def _prepared_tiny(golden_dir):
    model = tiny_s2(golden_dir, torch.float32)
    prepare_model(model)
    return model


@pytest.mark.interpreter
@pytest.mark.parametrize("variant", [v for v in VARIANTS if v != "scaled_mm"])  # that one: GPU test below
@pytest.mark.parametrize("which", ["planted", "golden"])
def test_triton_projections_equal_reference(planted, golden_dir, variant: str, which: str) -> None:
    model = planted if which == "planted" else _prepared_tiny(golden_dir)
    table = {}
    for block in [*model.layers, *model.fast_layers]:
        for layer in (block.attention.wqkv, block.attention.wo, block.feed_forward.w2):
            for m in (1, 2, 4):
                table[(layer.out_features, layer.in_features, m)] = variant
        ff = block.feed_forward
        for n in (ff.w1.out_features, 2 * ff.w1.out_features):
            for m in (1, 2, 4):
                table[(n, ff.w1.in_features, m)] = variant
    triton = Fp8Projections(model, backend="triton", table=table)
    reference = Fp8Projections(model, backend="reference", table=table)
    # bf16 output rounding (and, for bf16 weights, their rounding) is all that may differ: one
    # bf16 ulp for a projection. The MLP chains two: its gate/up output is rounded to bf16 in both
    # paths, from fp32 sums in different orders, so an element of it may sit one ulp apart, and the
    # down projection carries that into its output: two ulps there (in a fresh install of
    # 2026-12-01 one element of the fast layer's 3-row MLP lands two apart).
    ulps = {"qkv": 1, "mlp": 2}
    for block in (model.layers[0], model.fast_layers[-1]):
        for m in (1, 3):
            x = _bf16_exact((m, block.attention.wqkv.in_features), m)
            for op in ("qkv", "mlp"):
                got, want = getattr(triton, op)(block, x), getattr(reference, op)(block, x)
                assert got.dtype == x.dtype and got.shape == want.shape
                if variant == "bf16":
                    assert ((got - want).norm() / want.norm()) < 2e-2, op
                else:
                    torch.testing.assert_close(got, want, rtol=ulps[op] * 2**-7 + 1e-4, atol=1e-5)


@pytest.mark.interpreter
def test_prefill_variant_runs_the_w8a8_kernel_off_the_gpu(planted) -> None:
    """`scaled_mm` (cuBLAS) has no CPU version: off CUDA the same arithmetic runs on the W8A8
    kernel, so an interpreted engine with a long prompt still prefills."""
    bucket = m_bucket(130)
    table = {}
    for block in [*planted.layers, *planted.fast_layers]:
        ff, attn = block.feed_forward, block.attention
        for layer in (attn.wqkv, ff.w2):
            table[(layer.out_features, layer.in_features, bucket)] = "scaled_mm"
        table[(2 * ff.w1.out_features, ff.w1.in_features, bucket)] = "scaled_mm"
    triton = Fp8Projections(planted, backend="triton", table=table)
    reference = Fp8Projections(planted, backend="reference", table=table)
    block = planted.layers[0]
    x = _bf16_exact((130, block.attention.wqkv.in_features), 9)
    for op in ("qkv", "mlp"):
        got, want = getattr(triton, op)(block, x), getattr(reference, op)(block, x)
        torch.testing.assert_close(got, want, rtol=2**-7 + 1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [300, 4096])
def test_scaled_mm_prefill_equals_reference_at_s2_shapes(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefill rows through block-scaled `torch._scaled_mm` (rows padded to 16 by the quantization)
    equal the W8A8 reference up to bf16 output rounding and summation order, SwiGLU included
    (S2-Pro shapes); into a given output or a padded one of its own, the same bits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from shoal.engine.fp8_weights import Fp8Weight
    from shoal.kernels import reference

    assert variant_for(6144, 2560, rows, forced_prefill="scaled_mm") == "scaled_mm"
    torch.manual_seed(rows)
    for n, k, swiglu in ((6144, 2560, False), (2560, 9728, True)):
        w_q, w_scale = reference.quantize_weight(torch.randn(n, k, device="cuda") * 0.02)
        weight = Fp8Weight(w_q, w_scale)
        x = torch.randn(rows, 2 * k if swiglu else k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(rows, n, dtype=torch.bfloat16, device="cuda")
        assert Fp8Projections._scaled_mm(weight, x, swiglu, out) is out  # cuBLAS writes it or a copy
        view = Fp8Projections._scaled_mm(weight, x, swiglu, None)  # the first rows of a padded result
        assert view.shape == out.shape and view.is_contiguous() and torch.equal(view, out)
        want = reference.fp8_linear(x, w_q, w_scale, True, swiglu, out_dtype=torch.float32)
        # cuBLAS sums in another order than the reference: a bf16 ulp here and there, nothing more
        error = (out.float() - want).norm() / want.norm()
        assert error < 2e-3, (n, k, error)
        assert ((out.float() - want).abs() <= 2**-6 * want.abs() + 1e-3).float().mean() > 0.999


@pytest.mark.gpu
def test_prefill_inputs_quantized_by_their_producers_give_the_unfused_bits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 1,000-token prefill of three sequences (padded to 1,008 rows) at S2-Pro shapes: the norms
    and the attention write the block-scaled `_scaled_mm` projections' inputs quantized (qkv, o,
    gate+up of every layer), and the hidden states equal those of the same prefill with a
    quantization launch before each GEMM, bit for bit (the fused quantization is
    `quantize_activations` of the bf16 output, and the GEMMs are the same)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from shoal.bench.engine import build_random_s2

    model = build_random_s2("cuda", torch.bfloat16, slow_layers=2)
    config = EngineConfig(
        device="cuda", max_running_requests=4, max_seq_len=512, num_pages=256, weight_format="fp8",
        use_cuda_graphs=False, prefill_graphs=False,
    )  # fmt: skip
    runner = EngineCore(model, config).runner
    lengths = (400, 350, 250)
    segments, offset = [], 0
    for i, count in enumerate(lengths):
        segments.append((offset, count, count, list(range(1 + 32 * i, 1 + 32 * (i + 1)))))
        offset += count
    g = torch.Generator().manual_seed(0)
    tokens = torch.zeros(offset, model.config.num_codebooks + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, 150_000, (offset,), generator=g)
    tokens = tokens.cuda()
    positions = torch.cat([torch.arange(count) for count in lengths]).cuda()
    inputs = []
    scaled_mm = Fp8Projections._scaled_mm
    monkeypatch.setattr(
        Fp8Projections,
        "_scaled_mm",
        staticmethod(lambda w, x, *a: (inputs.append(type(x)), scaled_mm(w, x, *a))[1]),
    )
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(Fp8Projections, "fp8_input", lambda self, *args: None)
        inputs.clear()
        runner.kv.set_varlen(segments)
        with torch.no_grad():
            hidden, normed = runner.step.prefill(tokens, positions, runner.kv._slots, runner.kv._prefill_meta)
        results.append((hidden.clone(), normed.clone()))
        expected = [tuple] * 3 + [torch.Tensor] if fused else [torch.Tensor] * 4
        assert inputs == expected * 2, inputs  # qkv, o, gate+up quantized by their producers; down not
    (hidden, normed), (hidden_ref, normed_ref) = results
    assert hidden.shape == (offset, model.config.dim)
    assert torch.isfinite(hidden).all()
    assert torch.equal(hidden, hidden_ref) and torch.equal(normed, normed_ref)


@pytest.mark.interpreter
def test_reserved_buffers_are_reused(planted) -> None:
    projections = Fp8Projections(planted, backend="triton", table={})
    projections.reserve({1, 2})
    assert projections.workspace is not None
    block = planted.layers[0]
    x = _bf16_exact((2, planted.config.dim), 3).bfloat16()
    first = projections.qkv(block, x)
    expected = first.clone()
    second = projections.qkv(block, x + 1)
    assert first.data_ptr() == second.data_ptr()  # the reserved output, no allocation
    assert first.data_ptr() == projections._buffers[("out", first.shape[1], x.shape[1], 2)].data_ptr()
    mlp = projections.mlp(block, x)
    assert mlp.data_ptr() == projections.mlp(planted.layers[1], x).data_ptr()
    assert int(projections.workspace.counters.abs().sum()) == 0  # split-K counters left at zero
    other = projections.qkv(block, torch.cat([x, x]))  # M = 4 was not reserved: its own tensor
    assert other.data_ptr() != first.data_ptr()
    torch.testing.assert_close(other[:2], expected, rtol=2**-7 + 1e-4, atol=1e-5)
    with pytest.raises(RuntimeError, match="once"):
        projections.reserve({4})


@pytest.mark.interpreter
def test_projection_biases_apply_to_quantized_inputs_and_keep_the_reduction(tmp_path, monkeypatch) -> None:
    """A model with qkv and o biases, every GEMM split in two: a projection fed its input already
    quantized (`fp8_input`) adds the bias as the one that quantizes it itself, and `unreduced`
    (whose partials could not carry a bias) still returns the reduced, biased output."""
    from shoal.kernels import fp8_gemm
    from shoal.kernels.quant import quantize_activations

    two_splits = fp8_gemm.GemmConfig(block_m=16, block_n=32, split_k=2, num_warps=2, num_stages=1)
    monkeypatch.setattr(fp8_gemm, "pick_config", lambda *args, **kwargs: two_splits)
    config = tiny_config("s2").replace(
        dim=256, n_head=4, n_local_heads=2, head_dim=64, intermediate_size=256,
        attention_qkv_bias=True, attention_o_bias=True,
    )  # fmt: skip
    state = random_state_dict(config, seed=5)
    generator = torch.Generator().manual_seed(5)
    for name, tensor in state.items():
        if name.endswith(".bias"):  # the writer's biases are zeros: make them show
            tensor.copy_(torch.randn(tensor.shape, generator=generator))
    write_checkpoint(tmp_path, config, state)
    model = load_model(tmp_path, dtype=torch.bfloat16)
    prepare_model(model)
    projections = Fp8Projections(model, backend="triton", table={})
    projections.reserve({2})
    block = model.layers[0]
    weights = projections.blocks[id(block)]
    assert weights.qkv.bias.abs().min() > 0 and weights.wo.bias.abs().min() > 0
    x = _bf16_exact((2, config.dim), 4).bfloat16()
    for which, project in (("qkv", projections.qkv), ("out", projections.out_proj)):
        width = x.shape[1] if which == "qkv" else config.n_head * config.head_dim
        a = x if which == "qkv" else _bf16_exact((2, width), 6).bfloat16()
        expected = project(block, a).clone()
        q, scales = projections.fp8_input(block, which, 2)
        quantize_activations(a, out=q, scales=scales)
        assert torch.equal(project(block, (q, scales)), expected)
        reduced = project(block, a, unreduced=True)
        assert not isinstance(reduced, fp8_gemm.SplitKPartials) and torch.equal(reduced, expected)


def _two_running_requests(model, dtype: str):
    """An FP8 engine (torch-ops step on the CPU) with two requests two frames into decoding:
    (its runner, the requests), whose host batch gives a kernel step realistic inputs."""
    config = EngineConfig(
        device="cpu", dtype=dtype, num_pages=64, page_size=16, decode_step="fast", weight_format="fp8"
    )
    core = EngineCore(model, config)
    requests = []
    for i in range(2):
        request = core.new_request(prompt_for(model, 12 + i, i), SamplingParams(seed=i), max_new_frames=20)
        core.add(request)
        requests.append(request)
    while not all(r.num_frames >= 2 for r in requests):
        core.step()
    return core.runner, requests


@pytest.mark.interpreter
def test_kernel_decode_step_with_fp8_tracks_the_torch_step(golden_dir) -> None:
    model = tiny_s2(golden_dir, torch.float32)
    runner, requests = _two_running_requests(model, "float32")
    kernel_step = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True)
    assert kernel_step.fp8 is not None and runner.step.fp8 is None  # torch-ops step: the modules
    fields = runner.host.fill(requests)
    buffers = []
    for _ in range(2):
        b = DecodeBuffers.allocate(2, runner.max_pages, runner.window_size, runner.num_rows, "cpu")
        for name in fields:
            getattr(b, name).copy_(getattr(runner.host.host, name)[:2])
        buffers.append(b)

    def run(step, b):
        with torch.no_grad():
            hidden, normed = step.slow(b)
            x = torch.stack([normed, model.fast_embed(torch.zeros(2, dtype=torch.long))], 1)
            return hidden, normed, step._fast_kernels(x.flatten(0, 1), 0)

    def relative(a, b):
        return float((a - b).norm() / b.norm())

    # 1. The wiring: the fused step with the reference projections (no rounding) computes what the
    #    model's own Fp8Linear modules compute in the torch-ops step.
    hidden_t, normed_t = runner.step.slow(buffers[0])
    with torch.no_grad():
        cache = model.new_fast_cache(2)
        x = torch.stack([normed_t, model.fast_embed(torch.zeros(2, dtype=torch.long))], 1)
        fast_t = model.forward_fast(x, 0, cache)[:, 1]
    kernel_step.fp8 = Fp8Projections(model, backend="reference", emulate_kernels=False)
    hidden_r, normed_r, fast_r = run(kernel_step, buffers[1])
    assert relative(hidden_r, hidden_t) < 1e-4 and relative(normed_r, normed_t) < 1e-4
    assert relative(fast_r, fast_t) < 1e-3
    # 2. The kernels: Triton FP8 GEMMs against the reference with the kernels' bf16 rounding; only
    #    the fp32 summation order differs (1 bf16 ulp per GEMM output at most).
    kernel_step.fp8 = Fp8Projections(model, backend="reference", emulate_kernels=True)
    emulated = run(kernel_step, buffers[0])
    kernel_step.fp8 = Fp8Projections(model, backend="triton")
    triton = run(kernel_step, buffers[1])
    for got, want in zip(triton, emulated, strict=True):
        assert relative(got, want) < 1e-2


def _wide_head_model(directory) -> torch.nn.Module:
    """A tiny S2 model with 128-wide heads, so attention outputs are whole quantization groups."""
    config = tiny_config("s2").replace(
        head_dim=128, fast_head_dim=128, n_head=2, n_local_heads=1, intermediate_size=256,
        fast_intermediate_size=256,
    )  # fmt: skip
    write_checkpoint(directory, config, seed=3)
    model = load_model(directory, dtype=torch.bfloat16)
    model.build_rope_tables("cpu")
    return model


def _two_requests_on_tiny_s2(tmp_path):
    """The bf16 tiny S2 checkpoint (`_checkpoint`) loaded, two requests running on it, and the
    host fields their decode step reads: (model, runner, fields)."""
    model = load_model(_checkpoint(tmp_path), dtype=torch.bfloat16)
    model.build_rope_tables("cpu")
    runner, requests = _two_running_requests(model, "bfloat16")
    return model, runner, runner.host.fill(requests)


def _slow_and_first_fast_pass(step: DecodeStep, model, runner, fields) -> tuple[torch.Tensor, ...]:
    """The two running requests' slow step and first fast pass through `step` (fresh buffers)."""
    b = DecodeBuffers.allocate(2, runner.max_pages, runner.window_size, runner.num_rows, "cpu")
    for name in fields:
        getattr(b, name).copy_(getattr(runner.host.host, name)[:2])
    with torch.no_grad():
        hidden, normed = step.slow(b)
        x = torch.stack([normed, model.fast_embed(torch.zeros(2, dtype=torch.long))], 1)
        return hidden.clone(), normed.clone(), step._fast_kernels(x.flatten(0, 1), 0).clone()


@pytest.mark.interpreter
@pytest.mark.parametrize("heads", ["golden", "wide", "split-rows"])
def test_fused_input_quantization_equals_separate_launches(golden_dir, tmp_path, heads: str) -> None:
    """With reserved row counts the norms (and, with 128-wide heads, the attention) write the
    W8A8 projections' inputs already quantized; the step's outputs are bit for bit those of the
    unfused step (bf16 output, then a quantization launch, one norm program per row, residual in
    place). `split-rows`: a 256-wide model whose fused step splits every norm row over two
    programs (`slice_groups` 1, the residual stream in two buffers)."""
    if heads == "split-rows":
        model = load_model(_checkpoint(tmp_path), dtype=torch.bfloat16)
        model.build_rope_tables("cpu")
    else:
        model = tiny_s2(golden_dir, torch.bfloat16) if heads == "golden" else _wide_head_model(tmp_path)
    runner, requests = _two_running_requests(model, "bfloat16")
    fused = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True)
    fused.fp8.reserve(graph_row_counts([2]))
    slice_groups = 1 if heads == "split-rows" else None
    fused.tuning = TUNING.with_fields(
        fuse_attention_quant=True, norm_split_max_rows=1 << 20, norm_slice_groups=slice_groups
    )
    separate = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True)  # nothing reserved
    separate.tuning = TUNING.with_fields(norm_split_max_rows=0)
    block = model.layers[0]
    assert fused.fp8.fp8_input(block, "qkv", 2) is not None
    assert fused.fp8.fp8_input(block, "gate_up", 4) is not None
    assert separate.fp8.fp8_input(block, "qkv", 2) is None
    if heads == "wide":
        assert fused.fp8.fp8_input(block, "out", 2) is not None
    fields = runner.host.fill(requests)
    outputs = []
    for step in (fused, separate):
        outputs.append(_slow_and_first_fast_pass(step, model, runner, fields))
    for got, want in zip(*outputs, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "split_rows,fused_fast", [(False, True), (True, False)], ids=["row-programs", "split-rows-unfused-fast"]
)
@pytest.mark.interpreter
def test_consumers_summing_split_k_partials_equal_the_reducing_gemms(
    tmp_path, monkeypatch, split_rows: bool, fused_fast: bool
) -> None:
    """Every FP8 GEMM forced to split K in two: the o and down projections hand their partials to
    the norm after them, qkv to the QK-norm/RoPE/KV-write kernel, or in the fast layers to the
    fused fast attention that replaces it. Each hand-over must actually happen, and the step's
    outputs equal, bit for bit, those of the step whose GEMMs all reduce their own partials; both
    row layouts of the norm (one program per row; rows split over programs, the residual stream in
    two buffers), the fast layers fused or not."""
    from shoal.kernels import fast_attention, fp8_gemm, norm_rope

    two_splits = fp8_gemm.GemmConfig(block_m=16, block_n=32, split_k=2, num_warps=2, num_stages=1)
    monkeypatch.setattr(fp8_gemm, "pick_config", lambda *args, **kwargs: two_splits)
    handed = {"rms_norm": [], "qk_norm_rope_kv_write": [], "fast_rope_attention": []}
    for name, calls in handed.items():
        module = fast_attention if name == "fast_rope_attention" else norm_rope
        original = getattr(module, name)

        def counting(x, *args, _original=original, _calls=calls, **kwargs):
            _calls.append(isinstance(x, fp8_gemm.SplitKPartials))
            return _original(x, *args, **kwargs)

        monkeypatch.setattr(module, name, counting)
    model, runner, fields = _two_requests_on_tiny_s2(tmp_path)
    outputs = []
    for switch in ("1", "0"):
        consumers = switch == "1"
        tuning = TUNING.with_fields(
            norm_reduces_partials=consumers, rope_reduces_partials=consumers,
            fast_attention_partials_max_batch=TUNING.fast_attention_partials_max_batch if consumers else 0,
            norm_split_max_rows=1 << 20 if split_rows else 0, norm_slice_groups=1,
            two_launch_fast_from=17 if fused_fast else 1, two_launch_fast_to=1 << 30,
        )  # fmt: skip
        step = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True, tuning=tuning)
        step.fp8.reserve(graph_row_counts([2]))
        for calls in handed.values():
            calls.clear()
        outputs.append(_slow_and_first_fast_pass(step, model, runner, fields))
        layers = len(model.layers) + len(model.fast_layers)
        rope_layers = len(model.layers) + (0 if fused_fast else len(model.fast_layers))
        fast_attention_layers = len(model.fast_layers) if fused_fast else 0
        expected = (2 * layers, rope_layers, fast_attention_layers) if switch == "1" else (0, 0, 0)
        assert tuple(sum(calls) for calls in handed.values()) == expected, handed
    for got, want in zip(*outputs, strict=True):
        assert torch.equal(got, want)


def test_fast_qkv_partials_go_to_the_fast_attention_only_where_measured(tmp_path, monkeypatch) -> None:
    """The fast qkv GEMM hands its partials over up to FAST_ATTENTION_PARTIALS_MAX_BATCH rows, for
    fast layers without QK-norm (the 8-warp launch), and never with
    its tuning field at 0."""
    import dataclasses

    FAST_ATTENTION_PARTIALS_MAX_BATCH = TUNING.fast_attention_partials_max_batch  # noqa: N806

    model, runner, _ = _two_requests_on_tiny_s2(tmp_path)
    step = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True)
    assert not step.config.fast_attention_qk_norm
    assert step.hands_fast_qkv_partials(1) and step.hands_fast_qkv_partials(FAST_ATTENTION_PARTIALS_MAX_BATCH)
    assert not step.hands_fast_qkv_partials(FAST_ATTENTION_PARTIALS_MAX_BATCH + 1)
    step.config = dataclasses.replace(step.config, fast_attention_qk_norm=True)
    assert not step.hands_fast_qkv_partials(1)
    tuning = TUNING.with_fields(fast_attention_partials_max_batch=0)
    assert not DecodeStep(
        model, runner.kv, runner.max_batch, use_kernels=True, tuning=tuning
    ).hands_fast_qkv_partials(1)


# ---- the correctness gate through the engine ----------------------------------------------------


@pytest.fixture(scope="module")
def gate_models():
    reference_model = gate_correctness.planted_margin_model()
    fp8_model = copy.deepcopy(reference_model)
    quantize_model_(fp8_model)
    return reference_model, fp8_model


def test_engine_greedy_is_the_reference_greedy_decode(gate_models) -> None:
    reference_model, _ = gate_models
    prompt = gate_correctness.gate_prompt(reference_model.config)
    bf16 = gate_correctness.engine_greedy(copy.deepcopy(reference_model), prompt, 5, "bf16")
    assert torch.equal(bf16, generate(reference_model, prompt, max_frames=5, **gate_correctness.GREEDY))


def test_correctness_gate_passes_through_the_engine(gate_models) -> None:
    reference_model, fp8_model = gate_models
    prompt = gate_correctness.gate_prompt(reference_model.config)
    engine_frames = []

    def through_engine(p, frames):
        engine_frames.append(gate_correctness.engine_greedy(fp8_model, p, frames, "fp8"))
        return engine_frames[-1]

    result = gate_correctness.check_correctness(reference_model, fp8_model, prompt, fp8_frames=through_engine)
    assert result.passed, result.report()
    assert engine_frames and engine_frames[0].shape[1] == 5
    # the engine's FP8 frames are the reference generator's on the same FP8 model
    assert torch.equal(engine_frames[0], generate(fp8_model, prompt, max_frames=5, **gate_correctness.GREEDY))


def test_engine_refuses_a_broken_scale_layout(gate_models) -> None:
    """The historical bug (scales transposed, same shape) never reaches the engine's frames."""
    reference_model, fp8_model = gate_models
    broken = copy.deepcopy(fp8_model)
    for _, layer in fp8_layers(broken):
        layer.weight_scale = layer.weight_scale.t().contiguous().view(layer.weight_scale.shape)
    with pytest.raises(LayoutError):
        gate_correctness.engine_greedy(broken, gate_correctness.gate_prompt(reference_model.config), 5, "fp8")


def test_gate_cli_engine_path(capsys) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    gate.add_arguments(parser)
    assert gate.run(parser.parse_args(["correctness", "--path", "engine", "--device", "cpu"])) == 0
    out = capsys.readouterr().out
    assert "engine path" in out and "PASS" in out
