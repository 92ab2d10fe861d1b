"""CUDA-graph decode: replay equals eager for every bucket, needs no host sync, and the fused
step agrees with the model's torch forward. First-frame graphs (bf16 and FP8): replay equals the
same static buffers run eagerly and the eager path, with no host sync.

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


# First-frame graphs (`runner.FirstFrameBatch`, `graphs.FirstFrameGraphs`) --------------------


def first_frame_core(
    golden_dir, weight_format: str, first_frame_graphs: bool | None, **config_fields
) -> EngineCore:
    """A fresh model each time: `weight_format="fp8"` quantizes it in place. `config_fields`:
    further `EngineConfig` fields."""
    model = load_model(golden_dir / "s2_tiny", device="cuda", dtype=torch.bfloat16)
    config = EngineConfig(
        device="cuda", dtype="bfloat16", num_pages=512, page_size=16, max_running_requests=16,
        weight_format=weight_format, first_frame_graphs=first_frame_graphs, **config_fields,
    )  # fmt: skip
    return EngineCore(model, config)


def resumed_requests(runner, count: int, salt: int) -> list:
    """Requests as they complete a prefill: fresh ones (frame index 0) and resumed ones (frames
    already, so a frame index > 0 and a window; main tokens repeat, so RAS can fire)."""
    from shoal.engine.request import Request

    c = runner.model.config
    requests = []
    for i in range(count):
        params = SamplingParams(
            seed=salt * 100 + i, temperature=0.5 + 0.05 * i, top_p=0.7 + 0.02 * i, top_k=(3, 30, 32)[i % 3]
        )
        request = Request(
            f"ff{salt}-{i}", torch.zeros(runner.num_rows, 2, dtype=torch.long), params, max_new_frames=30
        )
        g = torch.Generator().manual_seed(salt * 100 + i)
        for f in range((0, 1, 4, 13)[i % 4]):
            frame = torch.randint(0, c.codebook_size, (runner.num_rows,), generator=g, dtype=torch.int32)
            frame[0] = c.semantic_begin_id + (f % 3)
            request.append_frame(frame)
        requests.append(request)
    return requests


def fresh_first_frames(runner, requests, hidden, normed, last_rows) -> torch.Tensor:
    """The eager path of `ModelRunner.prefill` (fresh buffers of n rows, whole-row sampling)."""
    buffers = runner.fresh_first_frame_buffers(requests)
    rows = torch.tensor(last_rows, device="cuda")
    with torch.no_grad():
        runner.step.frames_from_hidden(hidden[rows], normed[rows], buffers, capped=False)
    return buffers.frames


@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_first_frame_graph_replay_equals_eager_and_makes_no_host_sync(golden_dir, weight_format: str):
    """Replay == the same static buffers run eagerly, for every bucket size class (exact fit and
    padded, stale rows from a larger batch before); == the eager whole-row path where the row
    count is a bucket (the same GEMM shapes); and no host sync inside `first_frames`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    core = first_frame_core(golden_dir, weight_format, None)
    runner = core.runner
    batch, graphs = runner.first_frame, runner.first_frame_graphs
    assert batch is not None and graphs is not None and graphs.buckets == runner.graphs.buckets
    assert graphs.pool == runner.graphs.pool  # one memory pool for both sets of graphs
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(40, runner.model.config.dim, generator=g).to("cuda", torch.bfloat16)
    with torch.no_grad():
        normed = runner.model.norm(hidden)
    for salt, n in enumerate((16, 3, 1, 12, 2, 5, 4)):
        requests = resumed_requests(runner, n, salt)
        last_rows = [(7 * i + salt) % 40 for i in range(n)]
        with torch.no_grad():
            bucket = batch.fill(requests, hidden, normed, last_rows)
            batch.buffers.frames.fill_(-1)
            batch.compute(bucket)
            want = batch.buffers.frames[:n].clone()
            batch.buffers.frames.fill_(-1)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = runner.first_frames(requests, hidden, normed, last_rows)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got, want), (n, bucket)
        if n == bucket:
            assert torch.equal(got, fresh_first_frames(runner, requests, hidden, normed, last_rows)), n


@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_engine_first_frames_with_graphs_equal_without(golden_dir, weight_format: str):
    """Waves of requests that all complete in one prefill step (max_new_frames=1), through two
    engines: first-frame graphs (default) and the eager path (`first_frame_graphs=False`). Waves
    whose size is a bucket run the same GEMM shapes both ways and must give the same frames."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    waves = (1, 3, 2, 12, 4, 16)
    outputs = {}
    for graphs in (None, False):
        core = first_frame_core(golden_dir, weight_format, graphs)
        runner = core.runner
        assert (runner.first_frame_graphs is not None) == (graphs is None)
        replays = []
        if runner.first_frame_graphs is not None:
            replay = runner.first_frame_graphs.replay
            runner.first_frame_graphs.replay = lambda bucket, replay=replay, seen=replays: (
                seen.append(bucket),
                replay(bucket),
            )
        frames = {}
        for wave, size in enumerate(waves):
            requests = []
            for i in range(size):
                prompt = build_prompt(
                    core.model.config, core.model.tokenizer, "text " * (1 + (wave + i) % 7), []
                )
                params = SamplingParams(
                    seed=100 * wave + i,
                    temperature=0.6 + 0.02 * i,
                    top_p=0.7 + 0.015 * i,
                    top_k=(5, 30, 32)[i % 3],
                )
                requests.append(core.new_request(prompt, params, max_new_frames=1))
                core.add(requests[-1])
            assert len(core.step()) == size  # one prefill step completes the whole wave
            core.run_until_idle()
            frames[wave] = torch.stack([r.frames[0] for r in requests])
        if graphs is None:
            assert replays == [runner.first_frame.bucket_for(size) for size in waves]
        assert core.kv.pool.num_used == 0
        outputs[graphs] = frames
    for wave, size in enumerate(waves):
        if size in core.runner.graphs.buckets:
            assert torch.equal(outputs[None][wave], outputs[False][wave]), (wave, size)


@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_prefill_graph_replay_equals_eager_and_makes_no_host_sync(golden_dir, weight_format: str):
    """`prefill_graphs=None` (captured with the decode graphs): a chunk's replay equals the same
    static buffers run eagerly, bit for bit, for padded and exact buckets and a chunk continuing
    after a cached one; it agrees with the exact-length fused prefill (other GEMM row counts, so
    up to summation order); fill + replay make no host sync; and requests through the engine take
    the replay and finish."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    core = first_frame_core(
        golden_dir, weight_format, None, prefill_graphs=None, prefill_graph_buckets=(16, 32, 64, 128),
        ignore_eos=True,
    )  # fmt: skip
    model, runner = core.model, core.runner
    batch, graphs = runner.prefill_batch, runner.prefill_graphs
    assert batch is not None and graphs is not None and graphs.buckets == (16, 32, 64, 128)
    c = model.config
    pages = list(range(5, 13))  # 128 keys
    g = torch.Generator().manual_seed(0)
    for count, start in ((100, 0), (20, 100), (64, 0), (1, 0), (17, 40)):
        columns = torch.zeros(count, c.num_codebooks + 1, dtype=torch.long)
        columns[:, 0] = torch.randint(0, 300, (count,), generator=g)
        with torch.no_grad():
            bucket = batch.fill(columns, start, pages)
            batch.compute(bucket)
            want = batch.states[:, :count].clone()
            batch.states.fill_(float("nan"))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                assert batch.fill(columns, start, pages) == bucket
                graphs.replay(bucket)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            got = batch.states[:, :count].clone()
            runner.kv.set_varlen([(0, count, start + count, pages)])
            positions = torch.arange(start, start + count, device="cuda")
            exact = runner.step.prefill(columns.cuda(), positions, runner.kv._slots, runner.kv._prefill_meta)
        assert torch.equal(got, want), (count, start)
        for mine, theirs in zip(got, exact, strict=True):
            torch.testing.assert_close(mine.float(), theirs.float(), rtol=0.05, atol=0.05)
    replays = []
    replay = graphs.replay
    graphs.replay = lambda bucket: (replays.append(bucket), replay(bucket))
    requests = []
    for i in range(3):
        # 75, 90 and 105 tokens: each fits the tiny model's 128-token context with its 4 frames.
        prompt = build_prompt(model.config, model.tokenizer, "text " * (2 + 3 * i), [])
        requests.append(core.new_request(prompt, SamplingParams(seed=i, top_k=30), max_new_frames=4))
        core.add(requests[-1])
        core.run_until_idle()  # one at a time: each prefill is a single chunk
    assert len(replays) == 3
    states = [(r.prompt_len, r.finish_reason, r.num_frames, r.max_new_frames) for r in requests]
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_frames == 4 for r in requests), states


@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_packed_prefill_graph_replay_equals_eager_static_run(golden_dir, weight_format: str):
    """`prefill_graph_segments=4`: several requests' chunks packed into one replay equal the same
    static buffers run eagerly, bit for bit, with no host sync; requests submitted together take
    one packed replay and finish with all their frames."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    core = first_frame_core(
        golden_dir, weight_format, None, prefill_graphs=None, prefill_graph_buckets=(16, 32, 64, 128, 256),
        prefill_graph_segments=4, ignore_eos=True,
    )  # fmt: skip
    model, runner = core.model, core.runner
    batch, graphs = runner.prefill_batch, runner.prefill_graphs
    assert batch is not None and graphs is not None and batch.segments == 4
    c = model.config
    g = torch.Generator().manual_seed(1)
    tables = (list(range(5, 9)), list(range(9, 13)), list(range(13, 17)), list(range(17, 21)))
    for chunks in ([(30, 0), (20, 10), (1, 40)], [(16, 0), (16, 16), (16, 0), (16, 32)]):
        packed = []
        for (count, start), pages in zip(chunks, tables, strict=False):
            columns = torch.zeros(count, c.num_codebooks + 1, dtype=torch.long)
            columns[:, 0] = torch.randint(0, 300, (count,), generator=g)
            packed.append((columns, start, pages))
        with torch.no_grad():
            bucket = batch.fill_chunks(packed)
            batch.compute(bucket)
            want = batch.states.clone()
            batch.states.fill_(float("nan"))
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                assert batch.fill_chunks(packed) == bucket
                graphs.replay(bucket)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        total = sum(count for count, _ in chunks)
        assert torch.equal(batch.states[:, :total], want[:, :total]), chunks
    replays = []
    replay = graphs.replay
    graphs.replay = lambda bucket: (replays.append(bucket), replay(bucket))
    requests = []
    for i in range(3):
        prompt = build_prompt(model.config, model.tokenizer, "text " * (2 + i), [])
        requests.append(core.new_request(prompt, SamplingParams(seed=i, top_k=30), max_new_frames=4))
        core.add(requests[-1])
    core.run_until_idle()  # all three (75-85 tokens each) admitted in one step: one packed replay
    assert len(replays) == 1
    states = [(r.prompt_len, r.finish_reason, r.num_frames) for r in requests]
    assert all(r.finish_reason is FinishReason.LENGTH and r.num_frames == 4 for r in requests), states


@pytest.mark.parametrize("weight_format", ["bf16", "fp8"])
def test_advancing_on_the_device_gives_the_same_frames(golden_dir, weight_format: str) -> None:
    """`EngineConfig.advance_on_device` (the step's last kernel advances the metadata and stores
    the frames into pinned host memory) through the CUDA graphs, staggered requests at several
    batch sizes: the frames of the default engine exactly, and steady steps upload nothing."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from model_testing import staggered_request_frames

    frames, uploads = {}, {}
    for advance in (False, True):
        core = first_frame_core(golden_dir, weight_format, None, ignore_eos=True, advance_on_device=advance)
        assert (core.runner.frame_ring is not None) == advance
        sent = []
        launch = core.runner.launch_decode

        def recording(*args, _launch=launch, _sent=sent, _runner=core.runner, **kwargs):
            pending = _launch(*args, **kwargs)
            _sent.append(_runner.last_upload)
            return pending

        core.runner.launch_decode = recording
        frames[advance] = staggered_request_frames(core, seed=11)
        uploads[advance] = sent
        del core
        torch.cuda.empty_cache()
    assert len(frames[True]) == len(frames[False]) == 7
    for advanced, plain in zip(frames[True], frames[False], strict=True):
        assert torch.equal(advanced, plain)
    assert () in uploads[True] and () not in uploads[False]
