"""`EngineConfig.advance_on_device`: the kernel step's last kernel advances the step's metadata and
writes the frames into the host ring, so steady decoding uploads nothing and copies nothing back.
On the CPU the kernel step runs in the Triton interpreter, swapped into a CPU engine once its
requests are decoding (their prefills and first frames ran on the torch-ops step)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from test_engine_fp8 import _checkpoint, prompt_for  # noqa: E402

from shoal.config import EngineConfig  # noqa: E402
from shoal.engine.core import EngineCore  # noqa: E402
from shoal.engine.decode_step import DecodeStep  # noqa: E402
from shoal.engine.fp8_weights import graph_row_counts  # noqa: E402
from shoal.engine.request import SamplingParams  # noqa: E402
from shoal.models import load_model  # noqa: E402

FRAMES = 6  # per request: 2 before the swap, 4 on the kernel step (row 0 enters a new page among them)


def decode_on_kernel_step(model, advance: bool) -> tuple[list[torch.Tensor], list[tuple[str, ...]]]:
    """Two requests on an FP8 CPU engine with overlapped steps; after their second frame the
    engine decodes on the kernel step (advancing on the device or not). Returns each request's
    frames and what each kernel-step launch uploaded."""
    config = EngineConfig(
        device="cpu", dtype="bfloat16", num_pages=64, page_size=16, decode_step="fast",
        weight_format="fp8", overlap_steps=True, ignore_eos=True, advance_on_device=advance,
    )  # fmt: skip
    core = EngineCore(model, config)
    assert core.runner.frame_ring is None  # the CPU engine's own step is torch ops
    requests = []
    for i, length in enumerate((13, 18)):  # rows cross a 16-key page at different steps
        request = core.new_request(
            prompt_for(model, length, i), SamplingParams(seed=i), max_new_frames=FRAMES
        )
        core.add(request)
        requests.append(request)
    while not all(r.num_frames >= 2 for r in requests):
        core.step()
    runner = core.runner
    step = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True)
    step.fp8.reserve(graph_row_counts([1, 2]))
    runner.step = step
    runner.host.invalidate()  # the device buffers now meet a step of another kind
    if advance:
        runner.advance_on_device()
    uploads = []
    launch = runner.launch_decode

    def recording(*args, **kwargs):
        pending = launch(*args, **kwargs)
        uploads.append(runner.last_upload)
        return pending

    runner.launch_decode = recording
    while core.has_work:
        core.step()
    return [r.frames[: r.num_frames].clone() for r in requests], uploads


@pytest.mark.interpreter
@pytest.mark.slow
def test_steady_steps_upload_nothing_and_give_the_same_frames(tmp_path) -> None:
    model = load_model(_checkpoint(tmp_path), dtype=torch.bfloat16)
    model.build_rope_tables("cpu")
    frames, uploads = {}, {}
    for advance in (False, True):
        frames[advance], uploads[advance] = decode_on_kernel_step(model, advance)
    for advanced, plain in zip(frames[True], frames[False], strict=True):
        assert advanced.shape[0] == FRAMES and torch.equal(advanced, plain)
    # Without it every launch sends the scalars. With it: the first kernel launch sends all,
    # then only steps whose block tables changed (a row entered a new page) send the scalars.
    assert all("scalars" in sent for sent in uploads[False])
    with_advance = uploads[True]
    assert "tokens" in with_advance[0] and "scalars" in with_advance[0]
    steady = with_advance[1:]
    assert any(sent == () for sent in steady), steady
    for sent in steady:
        assert ("scalars" in sent) == ("block_tables" in sent), steady
