"""The overlapped schedule (`EngineConfig.overlap_steps`): decode step n+1 is launched before
step n is booked, so bookkeeping lags one step. On the CPU the same lagged logic runs
synchronously; outputs must stay those of `reference.generate`, wasted rows of finished or
aborted requests must not leak, and pages must all come back."""

from __future__ import annotations

import asyncio

import pytest
import torch
from model_testing import tiny_s2
from test_engine_batching import (
    TEXTS,
    Collector,
    assert_starts_as_reference,
    expected,
    make_core,
    submit,
    voice,
)

from shoal.config import EngineConfig
from shoal.engine.api import FinishReason, Priority
from shoal.engine.engine import LocalEngine
from shoal.engine.request import SamplingParams
from shoal.models.prompt import build_prompt


@pytest.fixture(scope="module")
def model(golden_dir):
    return tiny_s2(golden_dir, torch.float64, max_seq_len=384)


def test_config_switch():
    from shoal.tuning import Tuning

    assert EngineConfig().overlap_steps is Tuning().overlap_steps is True  # on by default
    assert Tuning.from_environment({"SHOAL_OVERLAP_STEPS": "0"}).overlap_steps is False
    assert EngineConfig(overlap_steps=True).overlap_steps is True


def test_steady_decoding_runs_ahead_and_equals_plain_steps(model):
    """Four requests of one length: every decode step after the first is launched ahead, no
    row is wasted (the last frame is known in advance), the step count is unchanged."""
    frames = 20
    outputs, steps = {}, {}
    for overlap in (False, True):
        core = make_core(model, ignore_eos=True, overlap_steps=overlap, max_prefill_tokens=512)
        sink = Collector()
        for i in range(4):
            submit(core, model, sink, f"s{i}", TEXTS[i], [], SamplingParams(seed=70 + i), frames)
        core.run_until_idle()
        outputs[overlap] = {f"s{i}": sink.output(f"s{i}") for i in range(4)}
        steps[overlap] = core.steps
        assert (core.stats().steps, core.stats().steps_ahead) == (core.steps, core.steps_ahead)  # /metrics
        assert core.kv.pool.num_used == core.kv.prefix_cache_pages
        if overlap:
            # Prefill (frame 0), one plain decode (frame 1), then frames 2 .. frames-1 ahead.
            assert core.steps_ahead == frames - 2 and core.rows_discarded == 0
        else:
            assert core.steps_ahead == 0
    assert steps[True] == steps[False] == frames
    for name, frames_plain in outputs[False].items():
        assert torch.equal(outputs[True][name], frames_plain), name


def test_sixteen_staggered_requests_equal_reference_with_overlap(model):
    core = make_core(model, overlap_steps=True)
    sink = Collector()
    lagged = []  # (request, its pages) when it finished while a step ahead ran a row for it

    def watch(request, frames, reason):
        sink(request, frames, reason)
        ahead = core.inflight
        if reason is not None and ahead is not None and ahead.runs(request):
            assert request.block_table  # pages kept while the step ahead writes them
            lagged.append((request, list(request.block_table)))

    jobs = []
    for i in range(16):
        refs = voice(i % 3, (0, 6, 14)[i % 3])
        params = SamplingParams(temperature=0.6 + 0.05 * i, top_p=0.7 + 0.015 * i, top_k=5 + i, seed=1000 + i)
        jobs.append((f"r{i}", TEXTS[i % len(TEXTS)] * (1 + i % 3), refs, params, 4 + 2 * i))
    pending = list(jobs)
    prompts = {}
    widest = 0
    while pending or core.has_work:
        for _ in range(2):
            if pending:
                name, text, refs, params, max_frames = pending.pop(0)
                prompts[name] = submit(core, model, watch, name, text, refs, params, max_frames)[1]
        widest = max(widest, len(core.step()))
        for request, _ in lagged:
            if core.inflight is None or not core.inflight.runs(request):
                assert not request.block_table  # freed once the step ahead was booked
    assert widest >= 8
    for name, _, _, params, max_frames in jobs:
        assert torch.equal(sink.output(name), expected(model, prompts[name], params, max_frames)), name
    stops = [r for r, _ in lagged if r.finish_reason is FinishReason.STOP]
    assert core.steps_ahead > 10 and stops and core.rows_discarded >= len(stops)
    assert core.inflight is None
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages
    assert core.kv.prefix_cache_pages > 0


def test_abort_during_a_step_ahead_frees_pages_after_it(model):
    core = make_core(model, ignore_eos=True, overlap_steps=True)
    sink = Collector()
    params = {i: SamplingParams(seed=20 + i) for i in range(3)}
    prompts = {}
    for i in range(3):
        prompts[i] = submit(core, model, sink, f"a{i}", TEXTS[i], [], params[i], 30)[1]
    while core.inflight is None:
        core.step()
    victim = core.requests["a1"]
    assert core.inflight.runs(victim)
    own = victim.block_table[victim.num_shared_pages :]
    frames_before = victim.num_frames
    core.abort("a1")
    assert sink.reasons["a1"] is FinishReason.ABORTED and victim not in core.scheduler.running
    assert all(core.kv.pool.ref_count(p) == 1 for p in own)  # the step ahead still writes them
    discarded = core.rows_discarded
    served = core.step()  # books the step ahead: a1's row dropped, its pages freed
    assert victim not in served and core.rows_discarded == discarded + 1
    assert all(core.kv.pool.ref_count(p) == 0 for p in own)
    assert victim.num_frames == frames_before and len(sink.frames["a1"]) == frames_before
    core.run_until_idle()
    for i in (0, 2):
        assert sink.reasons[f"a{i}"] is FinishReason.LENGTH
        assert_starts_as_reference(model, sink, f"a{i}", prompts[i], params[i], 30)
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages
    core.kv.evict_prefixes(core.kv.pool.num_pages)
    assert core.kv.pool.num_used == 0


def test_realtime_preempts_batch_with_overlap_and_outputs_are_unchanged(model):
    core = make_core(model, max_running_requests=3, ignore_eos=True, overlap_steps=True)
    sink = Collector()
    batch = []
    for i in range(3):
        params = SamplingParams(seed=40 + i, temperature=0.9)
        batch.append((submit(core, model, sink, f"b{i}", TEXTS[i], [], params, 25, Priority.BATCH), params))
    for _ in range(4):
        core.step()
    assert len(core.scheduler.running) == 3 and core.inflight is not None
    rt_params = SamplingParams(seed=99)
    realtime, rt_prompt = submit(core, model, sink, "rt", "urgent", [], rt_params, 10, Priority.REALTIME)
    core.step()  # the step ahead is booked; nothing launched ahead of it (a request waits)
    assert core.inflight is None and realtime.num_computed == 0
    core.step()  # scheduled normally: the realtime request preempts one batch request
    assert realtime.num_computed > 0
    preempted = [r for (r, _), _ in batch if r.num_preemptions]
    assert len(preempted) == 1
    core.run_until_idle()
    for (request, prompt), params in batch:
        assert_starts_as_reference(model, sink, request.request_id, prompt, params, 25)
    assert_starts_as_reference(model, sink, "rt", rt_prompt, rt_params, 10)
    assert core.steps_ahead > 0
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages


def decoding_core(model, count: int, frames: int):
    """An overlapped core whose `count` requests all decode, each holding the pages its next
    step needs, so that tests can fill and upload host batches by hand."""
    core = make_core(model, ignore_eos=True, overlap_steps=True)
    sink = Collector()
    params = [SamplingParams(seed=i) for i in range(count)]
    requests = [submit(core, model, sink, f"d{i}", TEXTS[i], [], params[i], frames)[0] for i in range(count)]
    while not all(r.is_decoding for r in requests):
        core.step()
    for request in requests:  # the pages the next step would get
        core.kv.grow(request, request.seq_len)
    return core, requests


def test_host_copies_pad_their_own_rows(model):
    """Two host copies used in turn: shrinking the batch pads the dropped rows in both (a
    graph bucket uploads them), not only in the copy filled last."""
    core, requests = decoding_core(model, 5, 30)
    host = core.runner.host
    assert len(host.copies) == 2
    host.invalidate()
    host.fill(requests)
    host.fill(requests)
    assert all(copy.live == 5 for copy in host.copies)
    host.fill(requests[:3])
    host.fill(requests[:3])
    scratch = core.runner.kv.scratch_page
    for copy in host.copies:
        assert copy.live == 3
        assert (copy.arrays["slots"][3:5] == scratch * core.runner.kv.page_size).all()
        assert (copy.arrays["block_tables"][3:5] == scratch).all()
        assert (copy.arrays["kv_lens"][3:5] == 1).all()
    with pytest.raises(RuntimeError):
        host.invalidate()
        host.fill(requests[:3], ahead=1)  # the rows are not on the device
    host.invalidate()
    core.run_until_idle()
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages


def test_uploads_send_scalars_together_and_tables_only_when_changed(model):
    """The four per-row scalars are views of one buffer (one copy per step); the block tables
    travel only when they differ from what the device holds: a stale device table survives an
    upload of equal host tables (proof the copy was skipped), a grown table or `invalidate`
    sends them again."""
    core, requests = decoding_core(model, 3, 40)
    runner, host = core.runner, core.runner.host
    device = runner.buffers
    storage = device.scalars.untyped_storage().data_ptr()
    for name in ("positions", "slots", "frame_index", "kv_lens"):
        assert getattr(device, name).untyped_storage().data_ptr() == storage, name
    assert device.view(2).scalars is None and "scalars" not in device.names

    def upload() -> None:
        host.upload(device, host.fill(requests), len(requests))

    host.invalidate()
    upload()
    for name in ("positions", "slots", "frame_index", "kv_lens", "block_tables"):
        assert torch.equal(getattr(device, name)[:3], getattr(host.host, name)[:3]), name
    device.block_tables[0, 0] = -7  # stale on the device behind the host's back
    upload()  # same tables: not sent
    assert int(device.block_tables[0, 0]) == -7
    assert torch.equal(device.positions[:3], host.host.positions[:3])  # the scalars were
    core.kv.grow(requests[1], requests[1].seq_len + runner.kv.page_size)  # row 1 gains a page
    upload()
    assert torch.equal(device.block_tables[:3], host.host.block_tables[:3])
    device.block_tables[0, 0] = -7
    host.invalidate()
    upload()
    assert torch.equal(device.block_tables[:3], host.host.block_tables[:3])
    host.invalidate()
    core.run_until_idle()
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages


def test_streaming_consumers_get_frames_in_order_with_overlap(model):
    async def scenario():
        config = EngineConfig(
            device="cpu",
            dtype="float64",
            num_pages=256,
            page_size=4,
            max_prefill_tokens=48,
            overlap_steps=True,
        )
        engine = LocalEngine(model, config)
        engine.start_thread()
        try:
            prompts = [
                build_prompt(model.config, model.tokenizer, TEXTS[i], voice(i, 6 * (i % 2))) for i in range(4)
            ]
            params = [SamplingParams(seed=300 + i, temperature=0.7) for i in range(4)]
            lengths = [12, 30, 7, 24]

            async def consume(i: int):
                if i:
                    await asyncio.sleep(0.01 * i)  # staggered arrivals
                stream = engine.submit_frames(prompts[i], params[i], max_new_frames=lengths[i])
                chunks = []
                async for frames in stream:
                    assert frames.shape[0] == 1  # one frame per step, delivered as booked
                    chunks.append(frames)
                return stream.finish_reason, torch.cat(chunks).t()

            results = await asyncio.wait_for(asyncio.gather(*(consume(i) for i in range(4))), 120)
            # A consumer going away aborts its request; its pages come back.
            gone = engine.submit_frames(prompts[1], SamplingParams(seed=9), max_new_frames=50)
            iterator = gone.__aiter__()
            await asyncio.wait_for(iterator.__anext__(), 60)
            await iterator.aclose()
            for _ in range(200):
                await asyncio.sleep(0.01)
                if engine.stats().running == 0:
                    break
            await asyncio.sleep(0.05)
            stats = engine.stats()
            core = engine.core
        finally:
            engine.stop_thread()
        return prompts, params, lengths, results, stats, core

    prompts, params, lengths, results, stats, core = asyncio.run(scenario())
    for prompt, p, length, (reason, frames) in zip(prompts, params, lengths, results, strict=True):
        assert reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert torch.equal(frames, expected(model, prompt, p, length))
    assert core.steps_ahead > 0 and core.inflight is None
    assert stats.running == 0 and stats.pages_used == core.kv.prefix_cache_pages
