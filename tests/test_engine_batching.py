"""The batching engine on a tiny S2 model (float64): every request's frames equal the
single-request oracle `reference.generate`, whatever the batch and whenever it arrived."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest
import torch
from model_testing import tiny_s2

from shoal.config import EngineConfig
from shoal.engine.api import EngineOverloaded, FinishReason, InvalidRequest, Priority
from shoal.engine.engine import EngineCore, LocalEngine
from shoal.engine.request import SamplingParams
from shoal.models.prompt import Reference, build_prompt, voice_prefix_length
from shoal.models.reference import generate

TEXTS = ["hi", "a longer sentence to say", "short", "numbers 1 2 3", "ok then", "the end"]


@pytest.fixture(scope="module")
def model(golden_dir):
    return tiny_s2(golden_dir, torch.float64, max_seq_len=384)  # room for several references


def voice(seed: int, frames: int) -> list[Reference]:
    if frames == 0:
        return []
    g = torch.Generator().manual_seed(seed)
    return [Reference(f"voice {seed}", torch.randint(0, 64, (4, frames), generator=g))]


def make_core(model, **overrides) -> EngineCore:
    settings = dict(device="cpu", dtype="float64", num_pages=256, page_size=4, max_prefill_tokens=48)
    settings.update(overrides)
    return EngineCore(model, EngineConfig(**settings))


class Collector:
    def __init__(self) -> None:
        self.frames: dict[str, list[torch.Tensor]] = {}
        self.reasons: dict[str, FinishReason] = {}

    def __call__(self, request, frames, reason) -> None:
        if frames is not None:
            self.frames.setdefault(request.request_id, []).append(frames)
        if reason is not None:
            self.reasons[request.request_id] = reason

    def output(self, request_id: str) -> torch.Tensor:
        return torch.cat(self.frames[request_id]).t()


def submit(core, model, sink, name, text, refs, params, max_frames, priority=Priority.STANDARD):
    prompt = build_prompt(model.config, model.tokenizer, text, refs)
    prefix = voice_prefix_length(model.config, model.tokenizer, refs)
    request = core.new_request(
        prompt,
        params,
        max_new_frames=max_frames,
        priority=priority,
        prefix_len=prefix,
        request_id=name,
        sink=sink,
    )
    core.add(request)
    return request, prompt


def expected(model, prompt, params: SamplingParams, max_frames: int) -> torch.Tensor:
    return generate(
        model,
        prompt,
        max_frames=max_frames,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        seed=params.seed,
    )


def assert_starts_as_reference(model, sink, name, prompt, params: SamplingParams, max_frames: int) -> None:
    """The request's frames begin with the reference's (which stops earlier at `<|im_end|>`)."""
    oracle = expected(model, prompt, params, max_frames)
    assert torch.equal(sink.output(name)[:, : oracle.shape[1]], oracle), name


def test_sixteen_staggered_requests_equal_reference(model):
    core = make_core(model)
    sink = Collector()
    jobs = []
    for i in range(16):
        refs = voice(i % 3, (0, 6, 14)[i % 3])  # three voices, one without reference
        params = SamplingParams(temperature=0.6 + 0.05 * i, top_p=0.7 + 0.015 * i, top_k=5 + i, seed=1000 + i)
        jobs.append((f"r{i}", TEXTS[i % len(TEXTS)] * (1 + i % 3), refs, params, 4 + 2 * i))
    pending = list(jobs)
    prompts = {}
    widest = 0
    while pending or core.has_work:
        for _ in range(2):  # two arrivals per step
            if pending:
                name, text, refs, params, max_frames = pending.pop(0)
                prompts[name] = submit(core, model, sink, name, text, refs, params, max_frames)[1]
        widest = max(widest, len(core.step()))
    assert widest >= 8  # the requests really shared steps
    for name, _, _, params, max_frames in jobs:
        assert torch.equal(sink.output(name), expected(model, prompts[name], params, max_frames)), name
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages  # only idle cached voices remain
    assert core.kv.prefix_cache_pages > 0


def test_request_submitted_during_decoding_joins_next_step(model):
    core = make_core(model)
    sink = Collector()
    first, _ = submit(core, model, sink, "first", "hello", [], SamplingParams(seed=1), 40)
    core.step()
    core.step()
    assert first.is_decoding
    late, _ = submit(core, model, sink, "late", "hi", [], SamplingParams(seed=2), 40)
    served = core.step()
    assert late in served and first in served


def test_abort_frees_pages_at_once_and_all_pages_return(model):
    core = make_core(model, ignore_eos=True)
    sink = Collector()
    requests = [
        submit(core, model, sink, f"a{i}", TEXTS[i], [], SamplingParams(seed=i), 30)[0] for i in range(4)
    ]
    for _ in range(3):
        core.step()
    used = core.kv.pool.num_used
    own = len(requests[1].block_table) - requests[1].num_shared_pages  # the system prompt is shared
    assert own > 0
    core.abort("a1")
    assert core.kv.pool.num_used == used - own and sink.reasons["a1"] is FinishReason.ABORTED
    core.run_until_idle()
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages  # idle cached prefix only
    core.kv.evict_prefixes(core.kv.pool.num_pages)
    assert core.kv.pool.num_used == 0
    assert all(sink.reasons[f"a{i}"] is FinishReason.LENGTH for i in (0, 2, 3))


def test_same_voice_shares_pages_and_outputs_are_unchanged(model):
    core = make_core(model, max_prefill_tokens=512)
    sink = Collector()
    refs = voice(7, 12)
    prefix = voice_prefix_length(model.config, model.tokenizer, refs)
    params_a, params_b = SamplingParams(seed=11), SamplingParams(seed=12, temperature=0.7)
    a, prompt_a = submit(core, model, sink, "a", "first text", refs, params_a, 20)
    core.step()  # prefix computed (one chunk covers it) and cached
    b, prompt_b = submit(core, model, sink, "b", "second one", refs, params_b, 20)
    core.step()
    whole = prefix // core.config.page_size
    assert core.kv.prefix_cache_pages == whole
    assert b.num_shared_pages == whole and b.block_table[:whole] == a.block_table[:whole]
    assert all(core.kv.pool.ref_count(p) == 3 for p in a.block_table[:whole])  # a, b, cache
    core.run_until_idle()
    assert torch.equal(sink.output("a"), expected(model, prompt_a, params_a, 20))
    assert torch.equal(sink.output("b"), expected(model, prompt_b, params_b, 20))


def test_prefilled_voice_is_reused(model):
    core = make_core(model)
    sink = Collector()
    refs = voice(3, 10)
    prefix_prompt = build_prompt(model.config, model.tokenizer, "", refs)
    prefix = voice_prefix_length(model.config, model.tokenizer, refs)
    assert core.prefill_voice(prefix_prompt[:, :prefix])
    cached = core.kv.prefix_cache_pages
    params = SamplingParams(seed=5)
    request, prompt = submit(core, model, sink, "v", "some words", refs, params, 15)
    core.step()
    assert cached > 0 and request.num_shared_pages == cached
    core.run_until_idle()
    assert torch.equal(sink.output("v"), expected(model, prompt, params, 15))


def test_realtime_preempts_batch_and_preempted_output_is_unchanged(model):
    # ignore_eos keeps all three running; the oracle's frames (up to its <|im_end|>) are a prefix.
    # Plain steps: the realtime request is served by the very next step (with overlap_steps, one
    # step later: test_engine_overlap.py).
    core = make_core(model, max_running_requests=3, ignore_eos=True, overlap_steps=False)
    sink = Collector()
    batch = []
    for i in range(3):
        params = SamplingParams(seed=40 + i, temperature=0.9)
        batch.append((submit(core, model, sink, f"b{i}", TEXTS[i], [], params, 25, Priority.BATCH), params))
    for _ in range(4):
        core.step()
    assert len(core.scheduler.running) == 3
    rt_params = SamplingParams(seed=99)
    realtime, rt_prompt = submit(core, model, sink, "rt", "urgent", [], rt_params, 10, Priority.REALTIME)
    served = core.step()
    assert realtime in served or realtime.num_computed > 0
    preempted = [r for (r, _), _ in batch if r.num_preemptions]
    assert len(preempted) == 1
    core.run_until_idle()
    for (request, prompt), params in batch:
        assert_starts_as_reference(model, sink, request.request_id, prompt, params, 25)
    assert_starts_as_reference(model, sink, "rt", rt_prompt, rt_params, 10)
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages


def test_overload_then_keeps_serving(model):
    async def scenario():
        config = EngineConfig(
            device="cpu", dtype="float64", num_pages=128, page_size=4, max_running_requests=1
        )
        config.queue_limits = {"realtime": 1, "standard": 1, "batch": 1}
        engine = LocalEngine(model, config)
        prompt = build_prompt(model.config, model.tokenizer, "hello", [])
        # Not started yet: the first request waits in the queue, the second overflows it.
        first = engine.submit_frames(prompt, SamplingParams(seed=3), max_new_frames=8)
        with pytest.raises(EngineOverloaded):
            engine.submit_frames(prompt, SamplingParams(seed=4), max_new_frames=8)
        engine.start_thread()
        try:
            got = await asyncio.wait_for(first.collect(), 60)
            again = engine.submit_frames(prompt, SamplingParams(seed=4), max_new_frames=8)
            got_again = await asyncio.wait_for(again.collect(), 60)
            # A consumer that goes away aborts its request and frees its pages.
            gone = engine.submit_frames(prompt, SamplingParams(seed=5), max_new_frames=50)
            iterator = gone.__aiter__()
            await asyncio.wait_for(iterator.__anext__(), 60)
            await iterator.aclose()
            await asyncio.sleep(0.05)
            stats = engine.stats()
        finally:
            engine.stop_thread()
        return got, got_again, stats

    got, got_again, stats = asyncio.run(scenario())
    prompt = build_prompt(model.config, model.tokenizer, "hello", [])
    assert torch.equal(got, expected(model, prompt, SamplingParams(seed=3), 8))
    assert torch.equal(got_again, expected(model, prompt, SamplingParams(seed=4), 8))
    assert stats.running == 0 and stats.pages_used == 0


def test_submit_abort_and_stats_do_not_wait_for_a_step(model):
    """The caller's thread never waits for the engine thread: with a step held open, submit,
    abort and stats return at once; the late request joins the next step, the abort frees
    the aborted request's pages at that boundary (plain steps: with overlap_steps both happen one
    step later, test_engine_overlap.py)."""
    config = EngineConfig(
        device="cpu", dtype="float64", num_pages=128, page_size=4, ignore_eos=True, overlap_steps=False
    )
    engine = LocalEngine(model, config)
    prompt = build_prompt(model.config, model.tokenizer, "hello", [])
    in_step, release = threading.Event(), threading.Event()
    steps: list[set[str]] = []
    pages_after: list[int] = []
    end_step = engine.core.end_step

    def held_end_step(pending):
        plan = pending.plan
        steps.append({r.request_id for r in plan.decodes} | {r.request_id for r, _ in plan.prefills})
        if len(steps) == 3:  # hold the third step open (the old engine held its lock here)
            in_step.set()
            release.wait(3)
        result = end_step(pending)
        pages_after.append(engine.core.kv.pool.num_used)
        return result

    engine.core.end_step = held_end_step

    async def scenario():
        engine.start_thread()
        try:
            first = engine.submit_frames(
                prompt, SamplingParams(seed=1), max_new_frames=40, request_id="first"
            )
            assert await asyncio.to_thread(in_step.wait, 60)
            start = time.perf_counter()
            late = engine.submit_frames(prompt, SamplingParams(seed=2), max_new_frames=6, request_id="late")
            engine.abort("first")
            stats = engine.stats()
            elapsed = time.perf_counter() - start
            release.set()
            first_frames = await asyncio.wait_for(first.collect(), 60)
            late_frames = await asyncio.wait_for(late.collect(), 60)
        finally:
            release.set()
            engine.stop_thread()
        return elapsed, stats, first, first_frames, late_frames

    elapsed, stats, first, first_frames, late_frames = asyncio.run(scenario())
    assert elapsed < 0.5, f"submit/abort/stats waited {elapsed:.2f} s for the engine thread"
    assert stats.running == 1 and stats.waiting["standard"] == 1  # "late" counted before it is drained
    assert steps[3] == {"late"}  # joined the very next step; "first" was aborted at that boundary
    assert first.finish_reason is FinishReason.ABORTED and first_frames.shape[1] == 3
    assert pages_after[3] == engine.core.kv.pages_for(prompt.shape[1])  # only "late"'s prompt pages
    oracle = expected(model, prompt, SamplingParams(seed=2), 6)
    assert torch.equal(late_frames[:, : oracle.shape[1]], oracle)
    assert engine.core.kv.pool.num_used == 0


def test_out_of_range_prompt_values_are_invalid_requests(model):
    """A code outside the codebook (or a token outside the vocabulary) is refused at submit:
    run inside a step it would be an index error that fails every request of the batch."""
    core = make_core(model)
    prompt = build_prompt(model.config, model.tokenizer, "hello", [])
    for row, value in ((1, model.config.codebook_size), (2, -1), (0, model.config.vocab_size)):
        bad = prompt.clone()
        bad[row, 0] = value
        with pytest.raises(InvalidRequest):
            core.new_request(bad, SamplingParams(), max_new_frames=4)
    with pytest.raises(InvalidRequest):
        core.prefill_voice(torch.full((prompt.shape[0], 8), 10_000))
    assert core.kv.pool.num_used == 0


def test_a_failing_sink_fails_only_its_own_request(model):
    """A sink that raises (its event loop closed) ends its own request with ERROR and frees its
    pages; the step and the other requests go on."""
    core = make_core(model, ignore_eos=True)
    sink = Collector()

    def broken(request, frames, reason):
        sink(request, frames, reason)
        if frames is not None and request.num_frames == 2:
            raise RuntimeError("Event loop is closed")

    params = SamplingParams(seed=8)
    _, prompt = submit(core, model, sink, "ok", "hello", [], params, 6)
    bad, _ = submit(core, model, broken, "bad", "hello", [], SamplingParams(seed=9), 6)
    core.run_until_idle()
    assert bad.finish_reason is FinishReason.ERROR and bad.num_frames == 2
    assert sink.reasons == {"ok": FinishReason.LENGTH}
    assert torch.equal(sink.output("ok"), expected(model, prompt, params, 6)[:, :6])
    assert core.kv.pool.num_used == core.kv.prefix_cache_pages and not core.requests


def test_a_closed_event_loop_does_not_stop_the_engine(model):
    """A consumer whose event loop closed while its request runs: the engine thread keeps
    serving the other requests and frees the orphan's pages."""
    engine = LocalEngine(
        model, EngineConfig(device="cpu", dtype="float64", num_pages=64, page_size=4, ignore_eos=True)
    )
    prompt = build_prompt(model.config, model.tokenizer, "hello", [])

    async def orphan():
        return engine.submit_frames(prompt, SamplingParams(seed=2), max_new_frames=30)

    async def scenario():
        stream = engine.submit_frames(prompt, SamplingParams(seed=1), max_new_frames=30)
        await asyncio.to_thread(asyncio.run, orphan())  # its loop is closed once it returns
        frames = await asyncio.wait_for(stream.collect(), 60)
        for _ in range(200):
            if engine.stats().pages_used == 0:
                break
            await asyncio.sleep(0.01)
        return stream, frames

    engine.start_thread()
    try:
        stream, frames = asyncio.run(scenario())
    finally:
        engine.stop_thread()
    assert stream.finish_reason is FinishReason.LENGTH and frames.shape[1] == 30
    assert engine.core.kv.pool.num_used == 0 and engine.last_error is None


def test_prefill_voice_on_a_busy_pool_keeps_the_cache(model):
    """With the pool in use, prefilling a voice gives up (False) instead of evicting the cached
    voices and then failing with OutOfPages."""
    core = make_core(model, num_pages=27, max_prefill_tokens=512, ignore_eos=True)
    first, second = (build_prompt(model.config, model.tokenizer, "", voice(s, 12)) for s in (1, 2))
    assert core.prefill_voice(first[:, :16])  # 4 pages, idle in the cache
    sink = Collector()
    prompt = build_prompt(model.config, model.tokenizer, "a longer sentence to say", [])
    core.add(core.new_request(prompt, SamplingParams(seed=1), max_new_frames=3, request_id="big", sink=sink))
    core.step()  # 89 prompt tokens, no voice prefix: 23 pages
    assert core.kv.pool.num_free == 0 and core.kv.prefix_cache_pages == 4
    assert not core.prefill_voice(second[:, :20])  # 5 pages: not even with the cache evicted
    assert core.kv.prefix_cache_pages == 4
    core.run_until_idle()
    assert core.kv.pool.num_used == 4 and sink.reasons["big"] is FinishReason.LENGTH


@pytest.mark.parametrize("overlap", [False, True])
def test_random_traffic_returns_every_page_and_ends_every_request(model, overlap):
    """Many small requests with random classes, voices, lengths, aborts and voice prefills on a
    small pool (preemption, prefix sharing and eviction): every request ends exactly once and
    every page comes back."""
    rng = random.Random(7 + overlap)
    voices = [[]] + [voice(s, 3 + 4 * s) for s in range(1, 4)]
    for trial in range(6):
        core = make_core(
            model,
            num_pages=rng.randint(14, 30),
            max_prefill_tokens=rng.choice([8, 16, 48]),
            max_running_requests=rng.randint(1, 5),
            overlap_steps=overlap,
            aging_seconds=0,
            queue_limits={},
        )
        ends: dict[str, list[FinishReason]] = {}

        def sink(request, frames, reason, ends=ends):
            if reason is not None:
                ends.setdefault(request.request_id, []).append(reason)

        names = []
        for _ in range(150):
            if len(names) < 16 and rng.random() < 0.5:
                refs = rng.choice(voices)
                name = f"t{trial}-{len(names)}"
                priority = rng.choice(list(Priority))
                max_frames = rng.randint(1, 10)
                params = SamplingParams(seed=len(names))
                try:
                    submit(core, model, sink, name, rng.choice(TEXTS), refs, params, max_frames, priority)
                except InvalidRequest:  # more pages than the pool has
                    continue
                names.append(name)
            live = [n for n in names if n not in ends]
            if live and rng.random() < 0.15:
                core.abort(rng.choice(live))
            if rng.random() < 0.05:
                core.prefill_voice(
                    build_prompt(model.config, model.tokenizer, "", rng.choice(voices[1:]))[:, :16]
                )
            core.step()
        core.run_until_idle(2000)
        assert all(len(ends.get(n, ())) == 1 for n in names), (trial, ends)
        assert not core.requests and not core.has_work
        assert all(entry.users == 0 for entry in core.kv._prefixes.values())
        assert core.kv.pool.num_used == core.kv.prefix_cache_pages
