"""Page pool, prefix cache and scheduler bookkeeping, without a model."""

from __future__ import annotations

import pytest
import torch

from shoal.config import EngineConfig
from shoal.engine.api import EngineOverloaded, FinishReason, Priority
from shoal.engine.kv_cache import KVCacheManager, OutOfPages, PagedKV, PagePool
from shoal.engine.request import Request, RequestStatus, SamplingParams
from shoal.engine.scheduler import Scheduler
from shoal.models.prompt import voice_prefix_key


def make_request(name: str, length: int, priority=Priority.STANDARD, prefix_len=0, voice=0) -> Request:
    prompt = torch.zeros(3, length, dtype=torch.long)
    prompt[0] = torch.arange(length) + 1000 * voice
    prompt[0, prefix_len:] += 100_000 + hash(name) % 1000  # text part differs per request
    return Request(
        name, prompt, SamplingParams(), max_new_frames=50, priority=priority, prefix_len=prefix_len
    )


def fake_step(scheduler: Scheduler) -> list[Request]:
    """Apply a plan as the engine would, with a constant frame instead of a model."""
    plan = scheduler.schedule()
    for request in plan.decodes:
        request.num_computed += 1
        request.append_frame(torch.ones(3, dtype=torch.int32))
    for request, count in plan.prefills:
        request.num_computed += count
        scheduler.kv.register_prefix(request)
        if request.num_computed == request.seq_len:
            request.append_frame(torch.ones(3, dtype=torch.int32))
    return plan


def test_page_pool_reference_counts():
    pool = PagePool(4)
    pages = pool.allocate(3)
    pool.retain(pages[:2])
    pool.release(pages)
    assert pool.num_free == 2  # two pages still held once
    pool.release(pages[:2])
    assert pool.num_free == 4
    with pytest.raises(OutOfPages):
        pool.allocate(5)
    with pytest.raises(RuntimeError):
        pool.release([0])


def test_prefix_shared_by_whole_pages_and_evicted_lru():
    kv = KVCacheManager(num_pages=16, page_size=4)
    first = make_request("a", 14, prefix_len=10)  # 2 whole pages of voice prefix
    kv.attach_prefix(first)
    kv.grow(first, 14)
    first.num_computed = 14
    assert kv.register_prefix(first)
    second = make_request("b", 12, prefix_len=10)
    kv.attach_prefix(second)
    assert second.block_table == first.block_table[:2] and second.num_computed == 8
    assert [kv.pool.ref_count(p) for p in second.block_table] == [3, 3]
    kv.free(first)
    kv.free(second)
    assert kv.pool.num_used == 2 and kv.prefix_cache_pages == 2  # idle, still cached
    other = make_request("c", 64)
    kv.grow(other, 64)  # needs all 16 pages: the idle prefix is evicted
    assert kv.prefix_cache_pages == 0 and kv.pool.num_free == 0


def test_prefix_cache_shares_pages_by_the_key_each_request_carries():
    """A request's voice key is taken once, when it is built (the prefix columns' content key
    unless the caller gives the one it computed): admissions look pages up by that key and
    never hash prompt columns again."""
    kv = KVCacheManager(num_pages=16, page_size=4)
    same, other_text, other_voice = (
        make_request("a", 14, prefix_len=10),
        make_request("b", 12, prefix_len=10),
        make_request("c", 14, prefix_len=10, voice=1),
    )
    assert same.prefix_key == other_text.prefix_key == voice_prefix_key(same.prompt[:, :10])
    assert other_voice.prefix_key != same.prefix_key and make_request("plain", 14).prefix_key is None

    def keyed(name: str, fill: int, prefix_len: int = 10) -> Request:
        prompt = torch.full((3, 14), fill, dtype=torch.long)
        return Request(
            name, prompt, SamplingParams(), max_new_frames=5, prefix_len=prefix_len, prefix_key="v"
        )

    first, second = keyed("first", 1), keyed("second", 2)  # other columns, the same key: shared
    kv.attach_prefix(first)
    kv.grow(first, 14)
    first.num_computed = 14
    assert kv.register_prefix(first)
    kv.attach_prefix(second)
    assert second.block_table == first.block_table[:2] and second.num_computed == 8
    kv.free(first)
    kv.free(second)
    kv.evict_prefixes(16)
    short = keyed("short", 3, prefix_len=3)  # under one page: nothing to share
    kv.attach_prefix(short)
    kv.grow(short, 14)
    short.num_computed = 14
    assert not kv.register_prefix(short) and kv.prefix_cache_pages == 0


def test_decodes_first_then_chunked_prefill_within_budget():
    config = EngineConfig(device="cpu", max_prefill_tokens=8, page_size=4, max_running_requests=8)
    scheduler = Scheduler(config, KVCacheManager(64, 4), max_seq_len=256)
    long_request, short = make_request("long", 20), make_request("short", 3)
    scheduler.add(long_request)
    scheduler.add(short)
    plan = fake_step(scheduler)
    assert [(r.request_id, n) for r, n in plan.prefills] == [("long", 8)]
    plan = fake_step(scheduler)
    assert [(r.request_id, n) for r, n in plan.prefills] == [("long", 8)]
    plan = fake_step(scheduler)
    assert [(r.request_id, n) for r, n in plan.prefills] == [("long", 4), ("short", 3)]
    plan = fake_step(scheduler)
    assert {r.request_id for r in plan.decodes} == {"long", "short"} and not plan.prefills
    late = make_request("late", 2)
    scheduler.add(late)
    plan = fake_step(scheduler)  # joins at the very next step, beside the running decodes
    assert len(plan.decodes) == 2 and [r.request_id for r, _ in plan.prefills] == ["late"]


def test_realtime_preempts_batch_when_slots_are_full():
    config = EngineConfig(device="cpu", max_running_requests=2, page_size=4)
    scheduler = Scheduler(config, KVCacheManager(64, 4), max_seq_len=256)
    batch = [make_request(f"b{i}", 5, Priority.BATCH) for i in range(3)]
    for r in batch:
        scheduler.add(r)
    fake_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["b0", "b1"]
    realtime = make_request("rt", 5, Priority.REALTIME)
    scheduler.add(realtime)
    plan = fake_step(scheduler)
    assert [r.request_id for r in plan.preempted] == ["b1"]  # the latest batch arrival
    assert realtime in scheduler.running and batch[1].status is RequestStatus.WAITING
    assert batch[1].num_frames == 1 and batch[1].block_table == []  # keeps frames, frees pages
    scheduler.finish(realtime, FinishReason.STOP)
    resumed_len = batch[1].seq_len  # prompt + its frame so far, all re-prefilled
    plan = fake_step(scheduler)
    assert batch[1] in scheduler.running  # resumes (earlier arrival than b2)
    assert [r for r, _ in plan.prefills] == [batch[1]] and plan.prefills[0][1] == resumed_len


def test_page_shortage_preempts_lower_class_only():
    config = EngineConfig(device="cpu", max_running_requests=8, page_size=4, max_prefill_tokens=64)
    scheduler = Scheduler(config, KVCacheManager(6, 4), max_seq_len=256)
    low = make_request("low", 16, Priority.BATCH)  # 4 pages (+1 for its first decode)
    scheduler.add(low)
    fake_step(scheduler)
    standard = make_request("std", 7, Priority.STANDARD)  # 2 pages: only 2 free after low grows
    scheduler.add(standard)
    plan = fake_step(scheduler)
    assert plan.preempted == [low] and standard in scheduler.running
    same_class = make_request("std2", 24, Priority.STANDARD)
    scheduler.add(same_class)
    plan = fake_step(scheduler)
    assert not plan.preempted and same_class.status is RequestStatus.WAITING


def test_bounded_queue_raises_overloaded():
    config = EngineConfig(device="cpu", queue_limits={"realtime": 1, "standard": 2, "batch": 0})
    scheduler = Scheduler(config, KVCacheManager(8, 4), max_seq_len=64)
    scheduler.add(make_request("a", 3))
    scheduler.add(make_request("b", 3))
    with pytest.raises(EngineOverloaded):
        scheduler.add(make_request("c", 3))
    with pytest.raises(EngineOverloaded):
        scheduler.add(make_request("d", 3, Priority.BATCH))
    scheduler.add(make_request("e", 3, Priority.REALTIME))  # other classes have their own room
    fake_step(scheduler)
    scheduler.add(make_request("f", 3))  # admitted ones no longer count


def test_varlen_slots_follow_each_segments_block_table():
    """`PagedKV.set_varlen`'s slots (computed per segment with numpy) are `slot_of` of every new
    token's position: chunks that start mid-page, continue a cached prefix, or fill one page."""
    kv = PagedKV(1, 40, 4, 2, 8, torch.float32, "cpu")
    segments = [(0, 7, 7, [3, 9]), (7, 5, 11, [1, 2, 30]), (12, 4, 4, [5]), (16, 1, 10, [6, 7, 8])]
    kv.set_varlen(segments)
    want = [
        kv.slot_of(pages, p) for _, count, kv_len, pages in segments for p in range(kv_len - count, kv_len)
    ]
    assert kv._slots.dtype == torch.long and kv._slots.tolist() == want
