"""`shoal serve --data-parallel 2` on the demo checkpoint: two engine processes (CPU engines here;
one per GPU with `--gpus`) behind one API process. A voice's requests stay on one engine;
requests without a voice spread by capacity; health and metrics show each engine; an engine
killed mid-run fails only its own streams, a job's items are re-run on the other engine, and the
supervisor brings the engine back."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import ormsgpack
import pytest
from browser_testing import PageErrors, artifacts_dir, chromium
from server_process import REPO, ShoalServer, create_voice

pytestmark = pytest.mark.slow

LONG_TEXT = "".join(f"<|speaker:{i % 2}|>A turn that takes a while to speak, number {i}. " for i in range(12))
ITEM_TEXT = "".join(f"<|speaker:{i % 2}|>Line {{n}}, turn {i}, of a bulk job. " for i in range(3))
JOB_ITEMS = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ShoalServer:
    workdir = tmp_path_factory.mktemp("shoal-data-parallel")
    with ShoalServer.start(
        workdir, "--data-parallel", "2", "--queue-limit", "batch=64", api_workers=1
    ) as running:
        yield running


def headers(server: ShoalServer) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.key_a}", "Content-Type": "application/msgpack"}


def body(text: str = "Short.", **options) -> bytes:
    return ormsgpack.packb({"text": text, "format": "pcm", "chunk_length": 100, "seed": 3, **options})


def engines(server: ShoalServer) -> list[dict]:
    return httpx.get(f"{server.url}/v1/health", timeout=10).json()["engines"]


def admitted(server: ShoalServer) -> list[int]:
    return [engine["admitted"] for engine in engines(server)]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"not {what} after {timeout:.0f} s")


def test_health_and_metrics_show_each_engine(server):
    server.wait_healthy()
    listed = engines(server)
    assert [engine["index"] for engine in listed] == [0, 1]
    assert all(engine["up"] and engine["admitting"] for engine in listed)
    assert sorted(engine["pid"] for engine in listed) == sorted(server.engine_pids())
    text = httpx.get(f"{server.url}/metrics").text
    assert re.search(r'^shoal_engine_process_up\{engine="0"\} 1\.0$', text, re.MULTILINE)
    assert re.search(r'^shoal_engine_process_up\{engine="1"\} 1\.0$', text, re.MULTILINE)
    assert re.search(r"^shoal_engine_up 1\.0$", text, re.MULTILINE)  # the total, as with one engine
    exported = set(re.findall(r"^# TYPE (\w+) ", text, re.MULTILINE))
    documented = set(re.findall(r"`(shoal_engine_\w+)", (REPO / "docs" / "deployment.md").read_text()))
    assert len(documented) > 5 and documented <= exported, documented - exported


def test_the_dashboard_shows_each_engine(server):
    """The dashboard page (docs/playground.md) in Chromium, on this server's own /metrics: the
    server's totals and one group per engine, both up."""
    server.wait_healthy()
    with chromium() as browser:
        page = browser.new_page()
        errors = PageErrors(page)
        page.set_default_timeout(30_000)
        page.goto(f"{server.url}/dashboard?interval=300")
        for engine in ("0", "1"):
            page.wait_for_selector(f"[data-engine='{engine}'] [data-metric=running] .value[data-value]")
            assert "up" in page.inner_text(f"[data-engine='{engine}'] h2")
        page.screenshot(path=str(artifacts_dir() / "dashboard-two-engines.png"), full_page=True)
        errors.assert_none()


def test_a_voices_requests_stay_on_the_engine_that_holds_its_prefix(server):
    server.wait_healthy()
    voice = create_voice(server, "router voice")
    before = admitted(server)
    for _ in range(3):
        response = httpx.post(
            f"{server.url}/v1/tts", content=body(reference_id=voice), headers=headers(server), timeout=60
        )
        assert response.status_code == 200 and response.content
    delta = [after - first for after, first in zip(admitted(server), before, strict=True)]
    assert sorted(delta) == [0, 3], delta
    home = delta.index(3)
    holding = [engine["prefix_cache_pages"] > 0 for engine in engines(server)]
    assert holding[home], engines(server)


def test_requests_without_a_voice_spread_over_both_engines(server):
    server.wait_healthy()
    before = admitted(server)

    def speak(_: int) -> int:
        response = httpx.post(f"{server.url}/v1/tts", content=body(), headers=headers(server), timeout=60)
        return response.status_code

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(speak, range(4))) == [200] * 4
    delta = [after - first for after, first in zip(admitted(server), before, strict=True)]
    assert sum(delta) == 4 and min(delta) >= 1, delta


def test_an_engine_killed_mid_run_fails_only_its_streams_and_comes_back(server):
    """One long stream on each engine and a bulk job; SIGKILL one engine: its stream is cut
    short, the other stream finishes whole, new requests are served meanwhile, every job item
    is made once, and the engine answers again with a new process."""
    server.wait_healthy()
    client_headers = headers(server)
    outcomes: dict[int, str] = {}
    streaming = [threading.Event(), threading.Event()]

    def long_stream(slot: int) -> None:
        try:
            with httpx.stream(
                "POST", f"{server.url}/v1/tts", content=body(LONG_TEXT), headers=client_headers, timeout=120
            ) as response:
                assert response.status_code == 200
                for _ in response.iter_raw():
                    streaming[slot].set()  # audio came: a lost engine now cuts this stream
            outcomes[slot] = "whole"
        except httpx.RemoteProtocolError:
            outcomes[slot] = "cut"

    threads = [threading.Thread(target=long_stream, args=(slot,)) for slot in range(2)]
    for thread in threads:
        thread.start()
    wait_for(lambda: all(engine["running"] >= 1 for engine in engines(server)), 60, "running on both engines")
    assert all(event.wait(60) for event in streaming)
    job_headers = {"Authorization": f"Bearer {server.key_a}"}
    items = [{"id": f"line-{n}", "text": ITEM_TEXT.format(n=n)} for n in range(JOB_ITEMS)]
    job = {"items": items, "text": "", "format": "pcm", "chunk_length": 100, "seed": 3}
    created = httpx.post(f"{server.url}/v1/jobs", json=job, headers=job_headers, timeout=30)
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    victim = engines(server)[1]
    os.kill(victim["pid"], signal.SIGKILL)
    killed = time.monotonic()
    served = httpx.post(f"{server.url}/v1/tts", content=body(), headers=client_headers, timeout=60)
    assert served.status_code == 200 and served.content  # the other engine serves meanwhile
    for thread in threads:
        thread.join(120)
    assert sorted(outcomes.values()) == ["cut", "whole"], outcomes
    back = wait_for(
        lambda: (listed := engines(server))[1]["up"] and listed[1]["pid"] != victim["pid"] and listed, 120,
        "the killed engine back",
    )  # fmt: skip
    serving_again = time.monotonic() - killed
    assert back[1]["restarts"] >= 1 and back[0]["up"]
    finished = wait_for(
        lambda: (state := httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=job_headers).json())["status"]
        not in ("queued", "running") and state,
        180, "the job finished",
    )  # fmt: skip
    assert finished["status"] == "done" and finished["items_done"] == JOB_ITEMS, finished
    assert all(item["status"] == "done" and item["audio_seconds"] > 0 for item in finished["items"])
    print(f"\nengine killed: serving again on both engines after {serving_again:.1f} s")
