"""CUDA-graph decode: replay equals eager for every bucket, and needs no host sync.

Run on a GPU box with `pytest -m gpu tests/test_engine_gpu.py`."""

from __future__ import annotations

import pytest
import torch

from shoal.config import EngineConfig
from shoal.engine.engine import EngineCore
from shoal.engine.request import SamplingParams
from shoal.engine.runner import DecodeBuffers
from shoal.models import load_model
from shoal.models.prompt import build_prompt

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def core(golden_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = load_model(golden_dir / "s2_tiny", device="cuda", dtype=torch.bfloat16)
    config = EngineConfig(
        device="cuda", dtype="bfloat16", num_pages=512, page_size=16, graph_max_batch=16, ignore_eos=True
    )
    return EngineCore(model, config)


def decoding_requests(core, count: int):
    """`count` requests of different prompts, each past its prefill."""
    model = core.model
    requests = []
    for i in range(count):
        prompt = build_prompt(model.config, model.tokenizer, "text " * (1 + i % 5), [])
        request = core.new_request(
            prompt, SamplingParams(seed=i, temperature=0.7 + 0.01 * i), max_new_frames=60
        )
        core.add(request)
        requests.append(request)
    while not all(r.is_decoding for r in requests):
        core.step()
    return requests


def eager(core, requests) -> torch.Tensor:
    runner = core.runner
    host = runner.host_buffers(requests, pages=runner.max_pages)  # same width: same kernel splits
    device = DecodeBuffers(*(getattr(host, f).to("cuda") for f in host.__dataclass_fields__))
    with torch.no_grad():
        runner.decode_step(device)
    return device.frames.cpu()


def test_graph_replay_equals_eager_for_every_bucket(core):
    graphs = core.runner.graphs
    assert graphs is not None and graphs.buckets[-1] == 16
    requests = decoding_requests(core, 16)
    for bucket in graphs.buckets:
        for live in sorted({bucket, max(1, bucket - 1)}):  # exact fit and padded
            batch = requests[:live]
            expected = eager(core, batch)
            replayed = graphs.run(core.runner.host_buffers(batch, pages=core.runner.max_pages), live)
            assert torch.equal(replayed, expected), (bucket, live)
    for request in requests:
        core.abort(request.request_id)


def test_graph_replay_makes_no_host_sync(core):
    graphs = core.runner.graphs
    requests = decoding_requests(core, 5)
    host = core.runner.host_buffers(requests, pages=core.runner.max_pages)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            graphs.launch(host, len(requests))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert graphs.frames(len(requests)).shape == (5, core.runner.num_rows)
    for request in requests:
        core.abort(request.request_id)
