"""CUDA-graph decode: replay equals eager for every bucket, needs no host sync, and the fused
step agrees with the model's torch forward.

Run on a GPU box with `pytest -m gpu tests/test_engine_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from shoal.config import EngineConfig
from shoal.engine.api import FinishReason
from shoal.engine.core import EngineCore
from shoal.engine.decode_step import DecodeStep
from shoal.engine.request import SamplingParams
from shoal.models import load_model
from shoal.models.prompt import build_prompt

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def core(golden_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = load_model(golden_dir / "s2_tiny", device="cuda", dtype=torch.bfloat16)
    config = EngineConfig(
        device="cuda", dtype="bfloat16", num_pages=512, page_size=16, max_running_requests=16, ignore_eos=True
    )
    return EngineCore(model, config)


def decoding_requests(core, count: int, top_k: int = 30):
    """`count` requests of different prompts, each past its prefill with a few frames."""
    model = core.model
    requests = []
    for i in range(count):
        prompt = build_prompt(model.config, model.tokenizer, "text " * (1 + i % 5), [])
        params = SamplingParams(seed=i, temperature=0.7 + 0.01 * i, top_k=top_k)
        request = core.new_request(prompt, params, max_new_frames=60)
        core.add(request)
        requests.append(request)
    while not all(r.num_frames >= 3 for r in requests):
        core.step()
    return requests


def snapshot(buffers) -> dict:
    return {name: getattr(buffers, name).clone() for name in buffers.names}


def restore(buffers, saved: dict) -> None:
    for name, value in saved.items():
        getattr(buffers, name).copy_(value)


def test_graph_replay_equals_eager_for_every_bucket(core):
    runner, graphs = core.runner, core.runner.graphs
    assert graphs is not None and graphs.buckets[-1] == 16 and runner.step is not None
    requests = decoding_requests(core, 16)
    for bucket in graphs.buckets:
        for live in sorted({bucket, max(1, bucket - 1)}):  # exact fit and padded
            runner.host.invalidate()
            fields = runner.host.fill(requests[:live])
            runner.host.upload(runner.buffers, fields, bucket)
            saved = snapshot(runner.buffers)
            with torch.no_grad():
                runner.decode_step(runner.buffers.view(bucket))
            expected = snapshot(runner.buffers)
            restore(runner.buffers, saved)
            runner.buffers.frames.fill_(-1)
            graphs.replay(bucket)
            for name in ("frames", "window", "tokens"):
                assert torch.equal(getattr(runner.buffers, name)[:live], expected[name][:live]), (
                    bucket,
                    live,
                    name,
                )
    runner.host.invalidate()
    for request in requests:
        core.abort(request.request_id)


def test_graph_replay_makes_no_host_sync(core):
    runner = core.runner
    requests = decoding_requests(core, 5)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):  # first launch uploads everything, later ones the metadata only
            pending = runner.launch_decode(requests)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.result().shape == (5, runner.num_rows)
    for request in requests:
        core.abort(request.request_id)


def test_large_top_k_runs_uncapped_and_steady_path_matches(core):
    """top_k above the kernels' bound: eager, whole-row sort; then steady steps keep going."""
    runner = core.runner
    requests = decoding_requests(core, 3, top_k=200)
    assert not runner.capped(requests)
    for _ in range(4):
        frames = runner.decode(requests)
        assert frames.shape == (3, runner.num_rows) and (frames >= 0).all()
        for request, frame in zip(requests, frames, strict=True):
            request.num_computed += 1
            request.append_frame(frame)
            core.kv.grow(request, request.seq_len)
    for request in requests:
        core.abort(request.request_id)


def test_fused_step_agrees_with_torch_forward(core):
    runner = core.runner
    requests = decoding_requests(core, 4)
    torch_step = DecodeStep(runner.model, runner.kv, runner.max_batch, use_kernels=False)
    runner.host.invalidate()
    fields = runner.host.fill(requests)
    runner.host.upload(runner.buffers, fields, 4)
    view = runner.buffers.view(4)
    with torch.no_grad():
        hidden_k, normed_k = runner.step.slow(view)
        hidden_t, normed_t = torch_step.slow(view)
    error = (normed_k.float() - normed_t.float()).norm() / normed_t.float().norm()
    assert error < 2e-2, error
    runner.host.invalidate()
    for request in requests:
        core.abort(request.request_id)


def run_fixed_lengths(model, device: str, dtype: str, overlap: bool):
    """12 requests of distinct lengths (`<|im_end|>` ignored), all prefilled in the first
    step: the batch shrinks at the same steps with and without `overlap_steps` (a last frame
    is known in advance, so no step is launched ahead over it), so every step has the same
    rows and the outputs must be equal bit for bit."""
    config = EngineConfig(
        device=device, dtype=dtype, num_pages=512, page_size=16, max_running_requests=16,
        ignore_eos=True, overlap_steps=overlap,
    )  # fmt: skip
    core = EngineCore(model, config)
    out: dict[str, list] = {}

    def sink(request, frames, reason):
        if frames is not None:
            out.setdefault(request.request_id, []).append(frames)

    requests = []
    for i in range(12):
        prompt = build_prompt(model.config, model.tokenizer, "text " * (1 + i % 5), [])
        params = SamplingParams(seed=100 + i, temperature=0.7 + 0.01 * i)
        requests.append(
            core.new_request(prompt, params, max_new_frames=20 + 3 * i, request_id=f"g{i}", sink=sink)
        )
        core.add(requests[-1])
    core.run_until_idle()
    assert core.kv.pool.num_used == 0 and core.inflight is None
    outputs = {name: torch.cat(chunks) for name, chunks in out.items()}
    for request in requests:  # (max_new_frames may be clipped to the context)
        assert request.finish_reason is FinishReason.LENGTH
        assert outputs[request.request_id].shape[0] == request.max_new_frames
    assert len({r.max_new_frames for r in requests}) > 6
    return outputs, core


def test_overlapped_steps_equal_plain_steps(core):
    model = core.model
    plain, _ = run_fixed_lengths(model, "cuda", "bfloat16", overlap=False)
    overlapped, ahead_core = run_fixed_lengths(model, "cuda", "bfloat16", overlap=True)
    assert ahead_core.steps_ahead > 20 and ahead_core.rows_discarded == 0
    assert plain.keys() == overlapped.keys()
    for name, frames in plain.items():
        assert torch.equal(overlapped[name], frames), name


def test_step_ahead_makes_no_host_sync(core):
    model = core.model
    config = EngineConfig(
        device="cuda", dtype="bfloat16", num_pages=512, page_size=16, max_running_requests=16,
        ignore_eos=True, overlap_steps=True,
    )  # fmt: skip
    ahead_core = EngineCore(model, config)
    for i in range(5):
        prompt = build_prompt(model.config, model.tokenizer, "text " * (1 + i), [])
        ahead_core.add(ahead_core.new_request(prompt, SamplingParams(seed=i), max_new_frames=40))
    while ahead_core.inflight is None:
        ahead_core.step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = ahead_core.begin_step()  # returns the step ahead and launches the next one
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending.ahead and ahead_core.inflight is not None
    pending.wait()
    assert len(ahead_core.end_step(pending)) == 5
    ahead_core.run_until_idle()
    assert ahead_core.kv.pool.num_used == 0
