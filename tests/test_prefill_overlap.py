"""Prefill beside the decode (`EngineConfig.overlap_prefill`): on CUDA the prefill graphs replay
on a stream of their own while the step's decode graph runs, with FP8 projections of their own
buffers (`Fp8Projections.sibling`). The frames must be those of the one-stream engine exactly,
under staggered arrivals that put prefill and decode in the same steps (`run_closed_loop`).

The CPU tests cover the switch, the sibling projections, the closed-loop driver and the gate's
row selection; the stream itself runs only on a GPU (`pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch
from model_testing import staggered_request_frames, tiny_s2

from shoal.bench import gate_performance
from shoal.bench.engine import make_prompts, run_closed_loop
from shoal.config import EngineConfig
from shoal.engine.core import EngineCore
from shoal.engine.fp8_weights import Fp8Projections, prepare_model
from shoal.models import load_model


def test_config_switch() -> None:
    from shoal.tuning import Tuning

    assert EngineConfig().overlap_prefill is True
    assert Tuning.from_environment({"SHOAL_OVERLAP_PREFILL": "0"}).overlap_prefill is False


def test_sibling_projections_share_weights_not_buffers(golden_dir) -> None:
    model = load_model(golden_dir / "s2_tiny", dtype=torch.float32)
    prepare_model(model)
    main = Fp8Projections(model, backend="reference")
    side = main.sibling()
    assert side.blocks is main.blocks and side.table is main.table
    main.reserve([2, 4])
    side.reserve([32])
    assert main.reserved == {2, 4} and side.reserved == {32}
    assert not set(main._buffers) & set(side._buffers)
    block = model.layers[0]
    x = torch.randn(32, model.config.dim)
    assert torch.equal(side.qkv(block, x), main.qkv(block, x))


def test_closed_loop_keeps_the_concurrency_and_runs_every_prompt(golden_dir) -> None:
    cpu_model = tiny_s2(golden_dir, torch.float64)
    config = EngineConfig(device="cpu", dtype="float64", num_pages=128, page_size=4, ignore_eos=True)
    core = EngineCore(cpu_model, config)
    live: list[int] = []
    add = core.add

    def counting_add(request, *args, **kwargs):
        add(request, *args, **kwargs)
        live.append(sum(not r.is_finished for r in core.requests.values()))

    core.add = counting_add
    steps = []
    step = core.step

    def counting_step():
        steps.append(len(live))
        return step()

    core.step = counting_step
    prompts = make_prompts(cpu_model, 5, 12, 0, seed=3)
    result = run_closed_loop(core, prompts, 3, 2, 0)
    assert result["requests"] == 5 and result["concurrency"] == 2 and len(live) == 5
    assert max(live) == 2  # never more than the concurrency at once
    assert all(b - a <= 1 for a, b in zip(steps, steps[1:], strict=False))  # one new request per step
    assert not core.has_work and core.kv.pool.num_used == 0


def test_gate_rows_skip_closed_loop_and_prefer_the_default_overlap() -> None:
    def row(concurrency, overlap, closed=0):
        return {"weight_format": "fp8", "concurrency": concurrency, "overlap_prefill": overlap,
                "closed_loop": closed}  # fmt: skip

    rows = [row(1, True), row(1, False), row(16, True, closed=64)]
    assert gate_performance.select_results(rows, "fp8") == [row(1, True)]
    assert gate_performance.select_results([row(1, False)], "fp8") == [row(1, False)]
    assert gate_performance.select_results([{"weight_format": "fp8", "concurrency": 1}], "fp8")  # old rows


@pytest.mark.gpu
@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_prefill_beside_the_decode_gives_the_one_stream_frames(golden_dir, weight_format: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    frames = {}
    for overlap in (False, True):
        model = load_model(golden_dir / "s2_tiny", device="cuda", dtype=torch.bfloat16)
        config = EngineConfig(
            device="cuda", dtype="bfloat16", num_pages=512, page_size=16, max_running_requests=8,
            ignore_eos=True, weight_format=weight_format, overlap_prefill=overlap,
            prefill_graph_buckets=(32, 64, 128),
        )  # fmt: skip
        core = EngineCore(model, config)
        assert (core.runner.prefill_stream is not None) is overlap
        frames[overlap] = staggered_request_frames(core, seed=5)
        assert core.kv.pool.num_used == 0
        del core, model
        torch.cuda.empty_cache()
    assert len(frames[True]) == len(frames[False]) == 7
    for with_overlap, without in zip(frames[True], frames[False], strict=True):
        assert torch.equal(with_overlap, without)
