"""The L2 window over a fast weight (`engine/l2_residency.py`): which weight it covers, its hit
ratio, that it is never asked for off CUDA, and on a GPU that every kernel node of the engine's
decode graphs carries it (the driver reads back what was set).

Its effect on the step's time is a benchmark (`shoal bench ab --variant step:l2_persist=false`,
docs/performance.md), not a test; that replays with it equal eager steps is
tests/test_engine_gpu.py's, whose engine reserves the window by default."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
import torch

from shoal.engine import l2_residency
from shoal.engine.l2_residency import L2Window, largest_fast_weight, reserve_window
from shoal.models import load_model
from shoal.quant.engine_fp8 import Fp8Projections, prepare_model


def test_hit_ratio_keeps_persisting_lines_within_the_set_aside() -> None:
    assert L2Window(0, 100 << 20, 40 << 20).hit_ratio == pytest.approx(0.4)
    assert L2Window(0, 10 << 20, 10 << 20).hit_ratio == 1.0


def test_no_window_off_cuda() -> None:
    assert reserve_window(torch.zeros(1024, 1024)) is None


def tiny(golden_dir):
    return load_model(golden_dir / "s2_tiny", device="cpu", dtype=torch.float32)


def test_largest_fast_weight_bf16_is_a_fast_layer_parameter(golden_dir) -> None:
    model = tiny(golden_dir)
    weight = largest_fast_weight(SimpleNamespace(model=model, fp8=None))
    fast = [p for layer in model.fast_layers for p in layer.parameters()]
    assert any(weight is p for p in fast)
    assert weight.numel() == max(p.numel() for p in fast)
    slow = {p.data_ptr() for layer in model.layers for p in layer.parameters()}
    assert weight.data_ptr() not in slow


def test_largest_fast_weight_fp8_is_the_e4m3_matrix_the_fast_gemm_reads(golden_dir) -> None:
    model = tiny(golden_dir)
    prepare_model(model)
    projections = Fp8Projections(model, backend="reference")
    weight = largest_fast_weight(SimpleNamespace(model=model, fp8=projections))
    assert weight.dtype == torch.float8_e4m3fn
    # intermediate 96 is no multiple of 128: gate and up stay two GEMMs; the largest of the fast
    # layers' matrices (qkv, o, gate, up, down).
    blocks = [projections.blocks[id(layer)] for layer in model.fast_layers]
    candidates = [w.q for b in blocks for w in (b.qkv, b.wo, b.w1, b.w3, b.w2)]
    assert any(weight is t for t in candidates)
    assert weight.numel() == max(t.numel() for t in candidates)


class _Value(ctypes.Union):
    _fields_ = [("window", l2_residency._AccessPolicyWindow), ("pad", ctypes.c_char * 64)]


@pytest.mark.gpu
def test_engine_decode_graph_nodes_carry_the_window(golden_dir) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from shoal.config import EngineConfig
    from shoal.engine.core import EngineCore
    from shoal.engine.graphs import capture_graph

    model = load_model(golden_dir / "s2_tiny", device="cuda", dtype=torch.bfloat16)
    config = EngineConfig(device="cuda", dtype="bfloat16", num_pages=64, max_running_requests=4)
    runner = EngineCore(model, config).runner
    window = runner.graph_window()
    assert window is not None and window.set_aside > 0
    fast = {p.data_ptr() for layer in model.fast_layers for p in layer.parameters()}
    assert window.base_ptr in fast
    view = runner.buffers.view(runner.graphs.buckets[0])
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        runner.step(view)
    applied = window.apply(graph)
    assert applied > 0
    driver = l2_residency._driver()
    count = ctypes.c_size_t()
    raw = ctypes.c_void_p(graph.raw_cuda_graph())
    assert driver.cuGraphGetNodes(raw, None, ctypes.byref(count)) == 0
    nodes = (ctypes.c_void_p * count.value)()
    assert driver.cuGraphGetNodes(raw, nodes, ctypes.byref(count)) == 0
    seen, kind = 0, ctypes.c_int()
    for node in nodes:
        assert driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)) == 0
        if kind.value != 0:
            continue
        value = _Value()
        assert driver.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), 1, ctypes.byref(value)) == 0
        assert value.window.base_ptr == window.base_ptr and value.window.num_bytes == window.num_bytes
        assert value.window.hit_ratio == pytest.approx(window.hit_ratio)
        assert value.window.hit_prop == 2
        seen += 1
    assert seen == applied
    assert capture_graph(lambda: runner.step(view), window=window) is not None  # instantiates
