"""Realtime admission end to end: the real app on the demo engine, with a capacity the test sets.

`RealtimePolicy(min_speed=...)` far above what any machine reaches makes the engine's capacity one
wave of streams: once their first step is measured, nothing new is admitted until they end. The
excess waits `max_queue_wait_seconds`, then gets a 503 with Retry-After in the Fish error shape;
the admitted streams play to their end; nothing leaks (KV pages, stream slots, handles)."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

import httpx
import pytest
from server_process import app_in_thread

from shoal.config import EngineConfig, RealtimePolicy
from shoal.demo import write_demo_checkpoint
from shoal.engine import load_engine

MAX_WAIT = 1.0
FRAMES = 200  # long enough that the first wave is still playing when the others time out


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("admission") / "demo")


@contextmanager
def one_wave_server(tmp_path, demo_dir, policy: RealtimePolicy):
    from shoal.server.app import create_app
    from shoal.server.settings import ServerSettings
    from shoal.server.store import Store

    config = EngineConfig(realtime=policy, num_pages=256)
    engine = load_engine(demo_dir, device="cpu", config=config, warmup=False)
    app = create_app(engine, Store.in_directory(tmp_path), ServerSettings(auth=False))
    with app_in_thread(app) as url:
        yield url, engine


async def speak(client: httpx.AsyncClient, url: str, seed: int) -> tuple[int, dict, bytes, float]:
    """(status, headers, body, seconds to the response) of one pcm /v1/tts request."""
    body = {"text": f"stream {seed}", "format": "pcm", "max_new_tokens": FRAMES, "seed": seed}
    start = time.monotonic()
    async with client.stream("POST", f"{url}/v1/tts", json=body) as response:
        answered = time.monotonic() - start
        data = await response.aread()
        return response.status_code, dict(response.headers), data, answered


def test_excess_waits_then_gets_503_while_the_admitted_wave_plays_out(tmp_path, demo_dir) -> None:
    policy = RealtimePolicy(enabled=True, min_speed=1e9, max_queue_wait_seconds=MAX_WAIT)
    with one_wave_server(tmp_path, demo_dir, policy) as (url, engine):

        async def scenario():
            async with httpx.AsyncClient(timeout=120) as client:
                first = asyncio.create_task(speak(client, url, 1))
                while engine.stats().running == 0:  # the wave is admitted and decoding
                    await asyncio.sleep(0.01)
                await asyncio.sleep(0.2)
                late = [asyncio.create_task(speak(client, url, seed)) for seed in (2, 3, 4)]
                return await first, await asyncio.gather(*late)

        (status, _, audio, _), refused = asyncio.run(scenario())
        assert status == 200 and len(audio) > 0  # the admitted stream played to its end
        for status, headers, body, answered in refused:
            assert status == 503, body
            assert headers.get("retry-after") and b"capacity" in body and b'"status":503' in body
            assert MAX_WAIT * 0.8 <= answered <= MAX_WAIT + 5
        deadline = time.monotonic() + 10
        while engine.stats().running and time.monotonic() < deadline:
            time.sleep(0.05)
        stats = engine.stats()
        assert stats.queue_timeouts == 3 and stats.running == 0 and sum(stats.waiting.values()) == 0
        assert stats.pages_used == stats.prefix_cache_pages and not engine._handles
        assert stats.queue_wait_count >= 1 and stats.queue_wait_buckets[-1] == stats.queue_wait_count
        health = httpx.get(f"{url}/v1/health").json()
        assert health["active_streams"] == 0


def test_an_open_gate_admits_everyone(tmp_path, demo_dir) -> None:
    """The same burst with the default policy: all four complete (a CPU demo keeps up easily
    with its tiny model, or the gate measures otherwise and the test says so)."""
    with one_wave_server(tmp_path, demo_dir, RealtimePolicy(enabled=True, min_speed=0.0)) as (url, engine):

        async def burst():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*(speak(client, url, seed) for seed in range(4)))

        results = asyncio.run(burst())
        assert [status for status, *_ in results] == [200] * 4
        assert engine.stats().queue_timeouts == 0


def test_the_policy_is_on_by_default_on_a_gpu_only() -> None:
    assert EngineConfig(device="cuda").resolved_realtime().enabled
    assert not EngineConfig(device="cpu").resolved_realtime().enabled
    given = RealtimePolicy(enabled=True, min_speed=3.0)
    assert EngineConfig(device="cpu", realtime=given).resolved_realtime() is given
    auto = EngineConfig(device="cpu", realtime=RealtimePolicy(min_speed=3.0)).resolved_realtime()
    assert not auto.enabled and auto.min_speed == 3.0
    assert EngineConfig(realtime={"enabled": True, "min_speed": 2.0}).realtime == RealtimePolicy(True, 2.0)
