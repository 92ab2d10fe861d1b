"""The first frame of a request from static buffers (`runner.FirstFrameBatch`, replayed as
`graphs.FirstFrameGraphs` on a GPU) on the CPU, run eagerly (`first_frame_graphs=True`):

- `ModelRunner.first_frames` (capped sampling) gives exactly the frames of the eager
  `frames_from_hidden` on fresh buffers (uncapped), with the kernel step (Triton interpreter)
  and the torch-ops step, for 1, 3 (bucket 4, one padding row) and, torch-ops only, 5 (bucket 8)
  completing rows with different sampling params, seeds, frame indices (0 included) and
  windows (RAS fires); a later call with other rows sees no stale state (a shorter window in
  the same row, fewer rows after more), and its padding rows are padding;
- which rows take the static path (capped top_k, at most the largest bucket);
- the engine with the static path equals `reference.generate` (including a request resumed
  after preemption, whose first frame after the re-prefill has frame index > 0).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import pytest  # noqa: E402
from model_testing import tiny_s2  # noqa: E402
from test_engine_batching import TEXTS, Collector, expected, submit  # noqa: E402

from shoal.config import EngineConfig  # noqa: E402
from shoal.engine.api import Priority  # noqa: E402
from shoal.engine.core import EngineCore  # noqa: E402
from shoal.engine.decode_step import DecodeStep  # noqa: E402
from shoal.engine.request import Request, SamplingParams  # noqa: E402

BUCKETS = (1, 4, 8)


@pytest.fixture(scope="module", params=[pytest.param("kernels", marks=pytest.mark.interpreter), "torch"])
def runner(request, golden_dir):
    model = tiny_s2(golden_dir, torch.float32)
    config = EngineConfig(
        device="cpu", dtype="float32", num_pages=16, page_size=16, max_running_requests=8,
        graph_buckets=BUCKETS, decode_step="fast", first_frame_graphs=True,
    )  # fmt: skip
    core = EngineCore(model, config)
    runner = core.runner
    assert runner.first_frame is not None and runner.first_frame.buckets == BUCKETS
    assert runner.first_frame_graphs is None  # no CUDA: the same buffers, eagerly
    if request.param == "kernels":
        runner.step = DecodeStep(model, runner.kv, runner.max_batch, use_kernels=True, max_top_k=64)
    return runner


def make_request(
    runner, name: str, params: SamplingParams, num_frames: int, main: int | None = None
) -> Request:
    """A request with `num_frames` frames already (a resumed request; 0: a fresh one). `main`:
    every earlier main token (for RAS), else varied semantic ids."""
    c = runner.model.config
    g = torch.Generator().manual_seed(params.seed)
    request = Request(name, torch.zeros(runner.num_rows, 3, dtype=torch.long), params, max_new_frames=40)
    for i in range(num_frames):
        frame = torch.randint(0, c.codebook_size, (runner.num_rows,), generator=g, dtype=torch.int32)
        frame[0] = c.semantic_begin_id + (i * 7 + params.seed) % c.codebook_size if main is None else main
        request.append_frame(frame)
    return request


def eager_frames(runner, requests, hidden, normed, last_rows) -> torch.Tensor:
    """The eager first frames: fresh buffers of exactly n rows, whole-row sampling."""
    buffers = runner.fresh_first_frame_buffers(requests)
    buffers.frames.fill_(-7)  # poison: every element must be written
    rows = torch.tensor(last_rows)
    with torch.no_grad():
        runner.step.frames_from_hidden(hidden[rows], normed[rows], buffers, capped=False)
    assert (buffers.frames >= 0).all()
    return buffers.frames


def static_frames(runner, requests, hidden, normed, last_rows) -> torch.Tensor:
    runner.first_frame.buffers.frames.fill_(-7)  # poison: every live element must be written
    with torch.no_grad():
        return runner.first_frames(requests, hidden, normed, last_rows).clone()


def assert_padding(runner, live: int, bucket: int) -> None:
    """Rows live.. of the static batch are harmless padding: in the host staging and the
    hidden states all of them, in the device fields those of the bucket that ran."""
    batch = runner.first_frame
    assert batch.live == live
    assert (batch.states[:, live:] == 0).all()
    for buffers, end in ((batch.host, batch.max_batch), (batch.buffers, bucket)):
        for name in ("window", "frame_index", "seed"):
            assert (getattr(buffers, name)[live:end] == 0).all(), name
        for name in ("temperature", "top_p", "repetition_penalty", "top_k"):
            assert (getattr(buffers, name)[live:end] == 1).all(), name


def test_static_first_frames_equal_eager_frames(runner) -> None:
    c = runner.model.config
    g = torch.Generator().manual_seed(11)
    hidden = torch.randn(12, c.dim, generator=g)
    normed = runner.model.norm(hidden).detach()
    hidden, normed = hidden.detach(), normed.detach()

    # A near-greedy row draws the same main token T at any frame index (probed with a window
    # without semantic tokens); a resumed row whose full window holds T resamples it (RAS).
    ras_params = SamplingParams(temperature=0.05, top_p=0.9, top_k=20, seed=5)
    probe = make_request(runner, "probe", ras_params, 12, main=0)
    token = int(eager_frames(runner, [probe], hidden, normed, [4])[0, 0])
    ras = make_request(runner, "ras", ras_params, 12, main=token)
    assert int(eager_frames(runner, [ras], hidden, normed, [4])[0, 0]) != token, "RAS not hit"

    first = [
        ras,
        make_request(runner, "a", SamplingParams(temperature=0.9, top_p=0.8, top_k=30, seed=1), 0),
        make_request(runner, "b", SamplingParams(temperature=0.6, top_p=0.95, top_k=3, seed=2), 14),
    ]
    want_first = eager_frames(runner, first, hidden, normed, [4, 0, 9])
    assert torch.equal(static_frames(runner, first, hidden, normed, [4, 0, 9]), want_first)
    assert_padding(runner, 3, 4)

    # Then in the same row a request with a short window (two frames, T not among them): the
    # rest of its window must be empty, not the previous row's T's (RAS would fire).
    short = [make_request(runner, "short", ras_params, 3, main=token + 1)]
    want = eager_frames(runner, short, hidden, normed, [4])
    assert int(want[0, 0]) == token
    assert torch.equal(static_frames(runner, short, hidden, normed, [4]), want)
    assert_padding(runner, 1, 1)

    # Five rows (bucket 8), then one, then three others (bucket 4 again): rows that held a
    # longer window, a later frame index or a hidden state before must not leak into these.
    # (The fill is the same for both steps; the interpreted kernels pay per row, so torch only.)
    if not runner.step.use_kernels:
        five = []
        for i in range(5):
            params = SamplingParams(
                temperature=0.5 + 0.1 * i, top_p=0.7 + 0.05 * i, top_k=(1, 64, 10, 40, 7)[i], seed=20 + i
            )
            five.append(make_request(runner, f"f{i}", params, (0, 3, 12, 1, 2)[i]))
        rows = [11, 3, 3, 7, 0]
        assert torch.equal(
            static_frames(runner, five, hidden, normed, rows),
            eager_frames(runner, five, hidden, normed, rows),
        )
        assert_padding(runner, 5, 8)

    one = [make_request(runner, "one", SamplingParams(temperature=1.1, top_p=0.6, top_k=50, seed=9), 0)]
    assert torch.equal(
        static_frames(runner, one, hidden, normed, [2]), eager_frames(runner, one, hidden, normed, [2])
    )
    assert_padding(runner, 1, 1)

    again = [
        make_request(runner, "x", SamplingParams(temperature=0.8, top_p=0.85, top_k=25, seed=31), 2),
        make_request(runner, "y", SamplingParams(temperature=0.7, top_p=0.9, top_k=2, seed=32), 0),
        make_request(runner, "z", SamplingParams(temperature=0.4, top_p=1.0, top_k=60, seed=33), 1),
    ]
    rows = [8, 1, 6]
    want = eager_frames(runner, again, hidden, normed, rows)
    # normed None: the prefill did not run the fused kernels; the model's final norm is applied.
    assert torch.equal(static_frames(runner, again, hidden, None, rows), want)
    assert_padding(runner, 3, 4)
    # The same rows as the first call still give its frames (nothing cached across calls).
    assert torch.equal(static_frames(runner, first, hidden, normed, [4, 0, 9]), want_first)


def test_which_rows_take_the_static_path(runner) -> None:
    def fresh(top_k: int) -> Request:
        return make_request(runner, "r", SamplingParams(top_k=top_k), 0)

    bound = runner.step.max_top_k  # the config's 32, or the kernel step's 64
    assert runner.uses_first_frame_batch([fresh(bound)] * 8)  # top_k at the sampling bound
    assert not runner.uses_first_frame_batch([fresh(bound)] * 9)  # above the largest bucket
    assert not runner.uses_first_frame_batch([fresh(30), fresh(bound + 1)])  # not capped: whole-row sort


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_with_static_first_frames_equals_reference(golden_dir, overlap: bool) -> None:
    """Requests complete together in prefill steps, a realtime request preempts batch ones,
    resumed by re-prefills whose first frames have frame index > 0; one request's top_k is
    above the bound (its first frame runs eagerly, uncapped)."""
    model = tiny_s2(golden_dir, torch.float64, max_seq_len=384)
    config = EngineConfig(
        device="cpu", dtype="float64", num_pages=256, page_size=4, max_prefill_tokens=96,
        max_running_requests=3, graph_buckets=(1, 2), decode_step="fast", first_frame_graphs=True,
        ignore_eos=True, overlap_steps=overlap,
    )  # fmt: skip
    core = EngineCore(model, config)
    runner = core.runner
    static_rows = []
    original = runner.first_frames

    def counting(requests, *args):
        static_rows.append([r.num_frames for r in requests])
        return original(requests, *args)

    runner.first_frames = counting
    sink = Collector()
    jobs = []
    for i in range(3):
        params = SamplingParams(seed=40 + i, temperature=0.7 + 0.1 * i, top_k=(30, 32, 5)[i], top_p=0.8)
        jobs.append(
            (submit(core, model, sink, f"b{i}", TEXTS[i], [], params, 16, Priority.BATCH), params, 16)
        )
    for _ in range(4):
        core.step()
    for name, top_k, priority in (("rt", 12, Priority.REALTIME), ("wide", 100, Priority.STANDARD)):
        params = SamplingParams(seed=len(jobs), top_k=top_k)
        jobs.append((submit(core, model, sink, name, "urgent " + name, [], params, 8, priority), params, 8))
    core.run_until_idle()
    assert sum(r.num_preemptions for (r, _), _, _ in jobs) >= 1
    assert any(len(rows) >= 2 for rows in static_rows)  # several rows in one bucket
    assert any(index > 0 for rows in static_rows for index in rows)  # a resumed request
    for (request, prompt), params, frames in jobs:
        oracle = expected(model, prompt, params, frames)
        assert torch.equal(sink.output(request.request_id)[:, : oracle.shape[1]], oracle), request.request_id
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages
