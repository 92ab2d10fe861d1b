"""`shoal serve --api-workers 2` on the demo checkpoint, as a real process tree (the main
process, the engine process, two API processes): what holds across the API processes (stream
limits, metrics, one job runner) and what happens when a process is killed with SIGKILL: the
engine (in-flight requests end with a 503 or a truncated stream, the supervisor restarts it, a
job resumes with every item made once), an API process (only its own connections are lost;
its stream slots are freed, another process takes over the jobs, uvicorn replaces it), the main
process (every other one stops)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import httpx
import ormsgpack
import pytest
from server_process import PER_ENGINE_METRIC, REPO, ShoalServer, child_processes
from websockets.sync.client import connect

from shoal.server import audio

pytestmark = pytest.mark.slow

# Several speaker turns: with chunk_length=100 each is a text batch of up to MAX_NEW_FRAMES
# frames, so a request runs for seconds on the CPU and can be interrupted mid-stream.
LONG_TEXT = "".join(
    f"<|speaker:{i % 2}|>Some text that takes a while to speak, turn {i}. " for i in range(20)
)
ITEM_TEXT = "".join(f"<|speaker:{i % 2}|>Line {{n}}, turn {i}, of a long bulk job. " for i in range(4))
JOB_ITEMS = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ShoalServer:
    # Batch work allowed (the client suite's server refuses it to test overload): jobs run.
    workdir = tmp_path_factory.mktemp("shoal-processes")
    with ShoalServer.start(workdir, "--queue-limit", "batch=64", api_workers=2) as running:
        yield running


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def tts_body(text: str = "Short.", **options) -> dict:
    return {"text": text, "format": "pcm", "chunk_length": 100, "seed": 3, **options}


def metric(text: str, sample: str) -> float:
    """The value of one sample line of a /metrics page (0 when absent)."""
    match = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def wait_for_job(client: httpx.Client, job_id: str, headers: dict, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}", headers=headers).json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job not finished after {timeout:.0f} s: {job}")


def start_long_job(client: httpx.Client, headers: dict) -> str:
    """A job of JOB_ITEMS multi-batch items, returned once its first item is done (the next
    ones running)."""
    items = [{"id": f"line-{n}", "text": ITEM_TEXT.format(n=n)} for n in range(JOB_ITEMS)]
    created = client.post("/v1/jobs", json={"items": items, **tts_body(""), "text": ""}, headers=headers)
    assert created.status_code == 202, created.text
    job_id = created.json()["id"]
    deadline = time.monotonic() + 60
    while (job := client.get(f"/v1/jobs/{job_id}", headers=headers).json())["items_done"] < 1:
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    assert job["items_done"] < JOB_ITEMS, "the job ended before anything could interrupt it"
    return job_id


def assert_every_item_made_once(
    server: ShoalServer, client: httpx.Client, job_id: str, headers: dict
) -> None:
    """Done, each item's audio recorded once: one file per item in the job's blob directory."""
    job = wait_for_job(client, job_id, headers)
    assert job["status"] == "done" and job["items_done"] == job["items_total"] == JOB_ITEMS, job
    assert all(item["status"] == "done" and item["audio_seconds"] > 0 for item in job["items"])
    for item in job["items"]:
        data = client.get(f"/v1/jobs/{job_id}/items/{item['id']}", headers=headers).content
        assert len(data) == round(item["audio_seconds"] * audio.SAMPLE_RATE) * 2  # s16 PCM
    files = [path.name for path in (server.data_dir / "blobs" / "jobs" / job_id).iterdir()]
    assert sorted(name.split("-")[0] for name in files) == [str(n) for n in range(JOB_ITEMS)], files


def test_metrics_sum_every_api_process_and_show_the_engine_once(server):
    server.wait_healthy()
    connections = server.connections_to_each_api_process()
    try:
        assert len(connections) == 2
        route = 'shoal_requests_total{route="/wallet/{user_id}/package",status="200"}'
        first_audio = 'shoal_time_to_first_audio_seconds_count{route="tts"}'
        api_sum, engine_sum = (
            'shoal_time_to_first_audio_seconds_sum{route="tts"}',
            "shoal_engine_time_to_first_audio_seconds_sum",
        )
        engine_count = "shoal_engine_time_to_first_audio_seconds_count"
        lag_count, lag_sum = (
            'shoal_audio_delivery_lag_seconds_count{route="tts"}',
            'shoal_audio_delivery_lag_seconds_sum{route="tts"}',
        )
        page = httpx.get(f"{server.url}/metrics").text
        before, audio_before = metric(page, route), metric(page, first_audio)
        lags_before = metric(page, lag_count), metric(page, lag_sum)
        sums_before = metric(page, api_sum), metric(page, engine_sum), metric(page, engine_count)
        headers = {**bearer(server.key_a), "Content-Type": "application/msgpack"}
        for count, client in zip((3, 2), connections.values(), strict=True):
            for _ in range(count):
                assert client.get("/wallet/self/package", headers=bearer(server.key_a)).status_code == 200
            assert (
                client.post("/v1/tts", content=ormsgpack.packb(tts_body()), headers=headers).status_code
                == 200
            )
        for client in connections.values():  # whichever process answers the scrape: the same sums
            page = client.get("/metrics").text
            assert metric(page, route) == before + 5 and metric(page, first_audio) == audio_before + 2
            assert len(re.findall(r"^shoal_kv_pages_used ", page, re.MULTILINE)) == 1
            for name in (
                "shoal_engine_up",
                "shoal_admitting",
                "shoal_generation_speed",
                "shoal_active_streams",
            ):
                assert len(re.findall(rf"^{name} ", page, re.MULTILINE)) == 1, name
            assert metric(page, "shoal_engine_up") == 1.0
            assert 'shoal_queue_wait_seconds_bucket{le="+Inf"}' in page
            # Every chunk of both responses, timed from the engine process's handover to its
            # bytes on the connection in this process: the shared monotonic clock, so positive.
            chunks = metric(page, lag_count) - lags_before[0]
            assert chunks >= 2 and 0 < metric(page, lag_sum) - lags_before[1] < 5 * chunks
        # The engine's own first-audio time (booked as each stream ends, seen with the next
        # heartbeat) lies inside the server's for the same two requests.
        deadline = time.monotonic() + 10
        while metric(page, engine_count) < sums_before[2] + 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            page = httpx.get(f"{server.url}/metrics").text
        assert metric(page, engine_count) == sums_before[2] + 2
        engine_part = metric(page, engine_sum) - sums_before[1]
        assert 0 < engine_part < metric(page, api_sum) - sums_before[0]
        # Each process froze its start-up heap out of the collector's walks (engine/gc_pauses.py).
        log_text = (server.data_dir.parent / "server.log").read_text()
        assert len(re.findall(r"garbage collector: \d+ start-up objects frozen", log_text)) >= 3, log_text[
            -3000:
        ]
        assert metric(page, "shoal_engine_gc_longest_pause_seconds") >= 0
        names = set(re.findall(r"^# TYPE (\w+) ", page, re.MULTILINE))
        documented = set(re.findall(r"`(shoal_\w+)", (REPO / "docs" / "deployment.md").read_text()))
        documented = {name for name in documented if not PER_ENGINE_METRIC.match(name)}
        assert documented and documented <= names, documented - names
    finally:
        for client in connections.values():
            client.close()


def test_the_engine_process_keeps_its_compiled_kernels_in_the_data_directory(server):
    """Triton's and Inductor's caches outlive a restarted engine process or container."""
    environ = Path(f"/proc/{server.engine_pid()}/environ").read_bytes().split(b"\0")
    variables = dict(entry.decode().split("=", 1) for entry in environ if b"=" in entry)
    cache = server.data_dir / "compile-cache"
    assert variables["TRITON_CACHE_DIR"] == str(cache / "triton")
    assert variables["TORCHINDUCTOR_CACHE_DIR"] == str(cache / "inductor")


def test_a_keys_stream_limit_holds_across_api_processes(server):
    server.wait_healthy()
    connections = server.connections_to_each_api_process()
    holder, other = connections.values()
    limited = {**bearer(server.key_limited), "Content-Type": "application/msgpack"}
    try:
        with holder.stream(
            "POST", "/v1/tts", content=ormsgpack.packb(tts_body(LONG_TEXT)), headers=limited
        ) as held:
            chunks = held.iter_raw()  # kept: a dropped iterator would close the response at once
            assert held.status_code == 200 and next(chunks)
            refused = other.post("/v1/tts", content=ormsgpack.packb(tts_body()), headers=limited)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert other.get("/v1/health").json()["active_streams"] == 1  # counted in every process
        server.wait_healthy()
        assert other.post("/v1/tts", content=ormsgpack.packb(tts_body()), headers=limited).status_code == 200
    finally:
        for client in connections.values():
            client.close()


def test_an_api_process_killed_loses_only_its_connections(server):
    """Kill the API process that runs the jobs while it streams the limited key's one stream:
    that stream breaks; the other process serves on, the slot is free at once, a job started
    before the kill finishes with every item made once, and uvicorn starts a replacement."""
    server.wait_healthy()
    connections = server.connections_to_each_api_process()
    headers = bearer(server.key_a)
    try:
        job_id = start_long_job(next(iter(connections.values())), headers)
        victim = server.job_runner_pid()
        assert victim in connections
        (survivor,) = set(connections) - {victim}
        limited = {**bearer(server.key_limited), "Content-Type": "application/msgpack"}
        body = ormsgpack.packb(tts_body(LONG_TEXT))
        with connections[victim].stream("POST", "/v1/tts", content=body, headers=limited) as doomed:
            chunks = doomed.iter_raw()
            assert doomed.status_code == 200 and next(chunks)
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(httpx.TransportError):
                for _ in chunks:
                    pass
        served = connections[survivor].post("/v1/tts", content=ormsgpack.packb(tts_body()), headers=limited)
        assert served.status_code == 200 and served.content  # the killed process's slot is free
        assert_every_item_made_once(server, connections[survivor], job_id, headers)
        assert server.job_runner_pid() not in (None, victim)
        deadline = time.monotonic() + 60
        while victim in (pids := server.api_pids()) or len(pids) < 2:
            assert time.monotonic() < deadline, pids
            time.sleep(0.2)
        server.wait_healthy()  # the engine aborted the killed process's requests
    finally:
        for client in connections.values():
            client.close()


def test_engine_lost_mid_stream_ends_streams_with_503_and_recovers(server):
    """The engine stops answering while an HTTP stream and a live session speak (SIGSTOP: so it
    stays down, with no restart, for as long as the test looks): the HTTP body is cut short (its
    status was sent), the live session ends with an error event, a request gets 503 with
    Retry-After, health says 503 and `shoal_engine_up` 0. Then SIGKILL: the supervisor starts a
    new engine process, and the next request is served."""
    server.wait_healthy()
    engine = server.engine_pid()
    headers = {**bearer(server.key_a), "Content-Type": "application/msgpack"}
    live_url = server.url.replace("http://", "ws://") + "/v1/tts/live"
    body = ormsgpack.packb(tts_body(LONG_TEXT))
    try:
        with (
            httpx.stream("POST", f"{server.url}/v1/tts", content=body, headers=headers) as response,
            connect(live_url, additional_headers=bearer(server.key_b)) as live,
        ):
            chunks = response.iter_raw()
            assert response.status_code == 200 and next(chunks)
            live.send(ormsgpack.packb({"event": "start", "request": tts_body("")}))
            live.send(ormsgpack.packb({"event": "text", "text": LONG_TEXT}))
            live.send(ormsgpack.packb({"event": "flush"}))
            assert ormsgpack.unpackb(live.recv(timeout=30))["event"] == "audio"
            os.kill(engine, signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(httpx.RemoteProtocolError):  # an unterminated chunked body
                for _ in chunks:
                    pass
            while (event := ormsgpack.unpackb(live.recv(timeout=30)))["event"] == "audio":
                pass
            assert event["reason"] == "error" and "unavailable" in event["message"]
        detected = time.monotonic() - stopped
        post = ormsgpack.packb(tts_body())
        for _ in range(4):  # each API process: none has an engine
            refused = httpx.post(f"{server.url}/v1/tts", content=post, headers=headers, timeout=30)
            assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
            assert set(refused.json()) == {"status", "message"} and "unavailable" in refused.json()["message"]
            assert httpx.get(f"{server.url}/v1/health").status_code == 503
            assert metric(httpx.get(f"{server.url}/metrics").text, "shoal_engine_up") == 0.0
    finally:
        os.kill(engine, signal.SIGKILL)
    killed = time.monotonic()
    server.wait_healthy()
    restarted = time.monotonic() - killed
    assert server.engine_pid() != engine
    served = httpx.post(f"{server.url}/v1/tts", content=post, headers=headers, timeout=60)
    assert served.status_code == 200 and served.content
    assert metric(httpx.get(f"{server.url}/metrics").text, "shoal_engine_up") == 1.0
    print(
        f"\nengine lost: streams ended after {detected:.1f} s; killed, serving again after {restarted:.1f} s"
    )


def test_a_job_resumes_after_an_engine_kill_with_every_item_made_once(server):
    server.wait_healthy()
    headers = bearer(server.key_a)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        job_id = start_long_job(client, headers)
        os.kill(server.engine_pid(), signal.SIGKILL)
        assert_every_item_made_once(server, client, job_id, headers)


def still_running(pid: int, command: str) -> bool:
    """Whether process `pid` still runs `command` (not a later process that reused the pid)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() == command
    except OSError:
        return False


def test_killing_the_main_process_stops_every_process(tmp_path):
    """SIGKILL on `shoal serve` itself (no shutdown runs there): the engine and the API
    processes notice their parent is gone and stop, so none keeps the port."""
    with ShoalServer.start(tmp_path, api_workers=2) as killed:
        for client in killed.connections_to_each_api_process().values():  # both started up
            client.close()
        children = child_processes(killed.process.pid)
        assert killed.engine_pid() in children and len(killed.api_pids()) == 2
        # The runtime directory, which only the main process removes: this test does instead.
        runtime = Path(re.search(r"ipc://(\S+)/engine-0\.sock", children[killed.engine_pid()]).group(1))
        killed.process.kill()
        killed.process.wait()
        try:
            deadline = time.monotonic() + 15
            while alive := {pid: command for pid, command in children.items() if still_running(pid, command)}:
                assert time.monotonic() < deadline, alive
                time.sleep(0.1)
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"{killed.url}/v1/health")
        finally:
            for pid, command in children.items():  # whatever did not stop
                if still_running(pid, command):
                    os.kill(pid, signal.SIGKILL)
            shutil.rmtree(runtime, ignore_errors=True)
