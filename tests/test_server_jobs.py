"""Bulk jobs (`/v1/jobs`) in-process against the real engine on the demo checkpoint: background
synthesis at batch priority, per-item checkpoints, resume after a restart on the same data
directory, retry on overload, cancellation freeing the engine, limits and tenant isolation."""

from __future__ import annotations

import base64
import io
import time
import wave

import numpy as np
import pytest
from fastapi.testclient import TestClient
from server_process import wav_clip

from shoal.engine.api import EngineOverloaded, EngineUnavailable, FinishReason, InvalidRequest, Priority
from shoal.server import audio
from shoal.server.app import create_app
from shoal.server.auth import hash_api_key
from shoal.server.settings import ServerSettings
from shoal.server.store import Store

KEY_A = "shoal_jobs_key_tenant_a"
KEY_B = "shoal_jobs_key_tenant_b"
FRAMES = 6  # max_new_tokens of ordinary test jobs: a fraction of a second of audio each
SHORT = {"max_new_tokens": FRAMES, "seed": 7, "chunk_length": 100}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from shoal.demo import write_demo_checkpoint

    return write_demo_checkpoint(tmp_path_factory.mktemp("jobs-demo") / "demo")


def load(checkpoint):
    from shoal.engine import load_engine

    return load_engine(checkpoint, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def engine(checkpoint):
    return load(checkpoint)  # shared by the tests: each app starts and stops it


class DiesAfterFirstChunk:
    """A request whose engine process dies after its first chunk, as a RemoteEngine's handle
    sees it: the chunk, then EngineUnavailable (the request is aborted on the engine)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self.finish_reason = None

    async def __aiter__(self):
        async for chunk in self.handle:
            yield chunk
            break
        await self.handle.aclose()
        self.finish_reason = FinishReason.ERROR
        raise EngineUnavailable("the engine has not answered for 3.0 s (test)")

    async def aclose(self) -> None:
        await self.handle.aclose()


class Recorder:
    """Wraps `engine.submit`: records each request. `overload` (the first N calls, or True for
    all), `allow` (every call after N accepted requests) and `invalid` (a substring of the
    text) make it raise as a full queue or a bad prompt would; `die_mid_stream` (the first N
    accepted requests) end after one chunk as when the engine process dies."""

    def __init__(
        self,
        engine,
        monkeypatch,
        overload: int | bool = 0,
        allow: int | None = None,
        invalid: str | None = None,
        die_mid_stream: int = 0,
    ) -> None:
        self.engine = engine
        self.submit = engine.submit
        self.overload = overload
        self.allow = allow
        self.invalid = invalid
        self.die_mid_stream = die_mid_stream
        self.attempts = 0
        self.requests = []
        monkeypatch.setattr(engine, "submit", self)

    def __call__(self, request):
        self.attempts += 1
        full = self.allow is not None and len(self.requests) >= self.allow
        if full or self.overload is True or (self.overload and self.attempts <= self.overload):
            raise EngineOverloaded("batch queue is full (test)")
        if self.invalid and self.invalid in request.text:
            raise InvalidRequest("prompt too long (test)")
        self.requests.append(request)
        handle = self.submit(request)
        return DiesAfterFirstChunk(handle) if len(self.requests) <= self.die_mid_stream else handle


def make_client(engine, data_dir, jobs_lock=None, **settings) -> TestClient:
    store = Store.in_directory(data_dir)
    for key, tenant in ((KEY_A, "a"), (KEY_B, "b")):
        if store.find_key(hash_api_key(key)) is None:
            store.add_key(hash_api_key(key), tenant=tenant)
    defaults = {"max_text_length": 300, "max_new_frames": 4000, "max_job_items": 5, "max_jobs_per_tenant": 2}
    app = create_app(engine, store, ServerSettings(**(defaults | settings)), jobs_lock=jobs_lock)
    client = TestClient(app)
    client.headers["Authorization"] = f"Bearer {KEY_A}"
    return client


@pytest.fixture()
def client(engine, tmp_path):
    with make_client(engine, tmp_path) as test_client:
        yield test_client


def create(client, body: dict, key: str = KEY_A) -> dict:
    response = client.post("/v1/jobs", json=body, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 202, response.text
    return response.json()


def wait_for(client, job_id: str, done, timeout: float = 40.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if done(job):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job did not get there in {timeout} s: {job}")


def finished(job: dict) -> bool:
    return job["status"] in ("done", "failed", "cancelled")


def wait_idle(engine, timeout: float = 10.0) -> None:
    """No request running and no KV pages held beyond the pinned voice prefixes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.running == 0 and stats.pages_used == stats.prefix_cache_pages:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine did not go idle: {stats}")


def assert_fish_error(response, status: int) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"status", "message"} and body["status"] == status
    return body["message"]


def test_job_synthesizes_every_item_at_batch_priority(client, engine, monkeypatch):
    recorder = Recorder(engine, monkeypatch)
    items = [{"id": "ch-1", "text": "It was a dark night."}, {"id": "ch-2", "text": "Then the sun rose."}]
    items.append({"text": "The end."})  # no id: its position
    created = create(client, {"items": items, "format": "wav", "sample_rate": 16000, **SHORT})
    assert created["status"] == "queued" and created["items_total"] == 3 and created["items_done"] == 0
    job = wait_for(client, created["id"], finished)
    assert job["status"] == "done" and job["items_done"] == 3 and job["error"] is None
    assert [item["id"] for item in job["items"]] == ["ch-1", "ch-2", "2"]
    assert all(item["status"] == "done" and item["audio_seconds"] > 0 for item in job["items"])
    assert job["audio_seconds"] == pytest.approx(
        sum(item["audio_seconds"] for item in job["items"]), abs=1e-3
    )
    assert sorted(r.text for r in recorder.requests) == sorted(item["text"] for item in items)
    assert all(r.priority == Priority.BATCH and r.max_new_frames == FRAMES for r in recorder.requests)
    for item in job["items"]:
        response = client.get(f"/v1/jobs/{created['id']}/items/{item['id']}")
        assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
        with wave.open(io.BytesIO(response.content)) as reader:  # an exactly sized file
            assert reader.getframerate() == 16000
            assert abs(reader.getnframes() - item["audio_seconds"] * 16000) <= 2
            assert len(response.content) == 44 + 2 * reader.getnframes()
    page = client.get("/v1/jobs").json()
    assert (
        page["total"] == 1 and page["items"][0]["id"] == created["id"] and page["items"][0]["items"] is None
    )
    # Timestamps read back from the database keep their zone: the same UTC string everywhere.
    assert created["created_at"].endswith("Z")
    assert job["created_at"] == page["items"][0]["created_at"] == created["created_at"]
    assert job["finished_at"].endswith("Z") and job["updated_at"].endswith("Z")
    wait_idle(engine)


def test_overloaded_engine_is_retried_with_backoff(client, engine, monkeypatch):
    recorder = Recorder(engine, monkeypatch, overload=3)
    created = create(client, {"text": "Queue is full at first.", "format": "pcm", **SHORT})
    job = wait_for(client, created["id"], finished)
    assert job["status"] == "done" and job["items"][0]["id"] == "0"
    assert recorder.attempts == 4 and len(recorder.requests) == 1
    assert len(client.get(f"/v1/jobs/{created['id']}/items/0").content) > 0


def test_items_cut_short_by_an_engine_restart_start_over_and_are_kept_once(
    client, engine, monkeypatch, tmp_path
):
    recorder = Recorder(engine, monkeypatch, die_mid_stream=3)
    items = [{"id": f"line-{n}", "text": f"Line number {n}."} for n in range(2)]
    created = create(client, {"items": items, "format": "pcm", **SHORT})
    job = wait_for(client, created["id"], finished)
    assert job["status"] == "done" and job["items_done"] == 2 and len(recorder.requests) == 5
    for item in job["items"]:  # each file is its last attempt's audio, as long as recorded
        data = client.get(f"/v1/jobs/{created['id']}/items/{item['id']}").content
        assert 0 < len(data) == round(item["audio_seconds"] * audio.SAMPLE_RATE) * 2
    assert len(list((tmp_path / "blobs" / "jobs" / created["id"]).iterdir())) == 2
    wait_idle(engine)


def test_restart_resumes_at_the_first_unfinished_item(checkpoint, engine, tmp_path, monkeypatch):
    """Item 0 finishes, then the queue stays full; the server stops. A new server process (new
    engine, new app, same data directory) finishes items 1 and 2 and never redoes item 0."""
    clip = base64.b64encode(wav_clip(0.5)).decode()
    items = [{"id": f"line-{n}", "text": f"Line number {n}."} for n in range(3)]
    body = {"items": items, "references": [{"audio": clip, "text": "A voice."}], "format": "mp3", **SHORT}
    first = Recorder(engine, monkeypatch, allow=1)  # item 1 then waits for queue space, retrying
    with make_client(engine, tmp_path, job_concurrency=1) as client:
        job_id = create(client, body)["id"]
        job = wait_for(client, job_id, lambda job: job["items_done"] == 1 and first.attempts >= 3)
        assert job["status"] == "running" and [item["status"] for item in job["items"]][0] == "done"
        kept = client.get(f"/v1/jobs/{job_id}/items/line-0").content
        assert_fish_error(client.get(f"/v1/jobs/{job_id}/items/line-1"), 409)
    wait_idle(engine)
    assert [r.text for r in first.requests] == ["Line number 0."]
    reference_codes = first.requests[0].references[0].codes

    second_engine = load(checkpoint)
    second = Recorder(second_engine, monkeypatch)
    with make_client(second_engine, tmp_path, job_concurrency=1) as client:
        job = wait_for(client, job_id, finished)
        assert job["status"] == "done" and job["items_done"] == 3
        assert [r.text for r in second.requests] == ["Line number 1.", "Line number 2."]
        assert all(np.array_equal(r.references[0].codes, reference_codes) for r in second.requests)
        assert client.get(f"/v1/jobs/{job_id}/items/line-0").content == kept
        for n in range(3):
            data = client.get(f"/v1/jobs/{job_id}/items/line-{n}").content
            assert len(audio.decode_audio(data)) > 0
    wait_idle(second_engine)


def test_cancel_aborts_in_flight_requests_and_frees_pages(client, engine, monkeypatch):
    recorder = Recorder(engine, monkeypatch)
    items = [{"text": f"A very long chapter {n}."} for n in range(4)]
    created = create(client, {"items": items, "format": "pcm", "max_new_tokens": 2000, "seed": 1})
    job = wait_for(client, created["id"], lambda job: engine.stats().running == 2)
    assert engine.stats().pages_used > engine.stats().prefix_cache_pages
    assert len(recorder.requests) == 2  # job_concurrency (2): no third item while two run
    assert sum(item["status"] == "running" for item in job["items"]) == 2
    response = client.delete(f"/v1/jobs/{created['id']}")
    assert response.status_code == 200 and response.json()["status"] == "cancelled"
    wait_idle(engine)
    time.sleep(0.3)
    job = client.get(f"/v1/jobs/{created['id']}").json()
    assert job["status"] == "cancelled" and job["items_done"] == 0 and job["finished_at"]
    assert all(item["status"] == "pending" for item in job["items"])
    assert len(recorder.requests) == 2
    assert_fish_error(client.get(f"/v1/jobs/{created['id']}/items/0"), 409)
    assert client.delete(f"/v1/jobs/{created['id']}").json()["status"] == "cancelled"  # idempotent


def test_one_process_runs_the_jobs_another_creates_and_cancels(engine, tmp_path, monkeypatch):
    """Two API processes on one data directory: the one holding jobs.lock runs the job created
    through the other, whose GET sees its items running, and whose DELETE aborts them."""
    from server_fakes import ToneEngine

    recorder = Recorder(engine, monkeypatch)
    lock = tmp_path / "jobs.lock"
    with (
        make_client(engine, tmp_path, jobs_lock=lock) as runner,
        make_client(ToneEngine(), tmp_path, jobs_lock=lock) as other,
    ):
        assert runner.app.state.jobs.leading and not other.app.state.jobs.leading
        items = [{"text": f"A very long chapter {n}."} for n in range(3)]
        created = create(other, {"items": items, "format": "pcm", "max_new_tokens": 2000, "seed": 1})
        job = wait_for(other, created["id"], lambda job: engine.stats().running == 2)
        job = wait_for(
            other, created["id"], lambda job: sum(i["status"] == "running" for i in job["items"]) == 2
        )
        assert job["status"] == "running" and len(recorder.requests) == 2
        assert other.delete(f"/v1/jobs/{created['id']}").json()["status"] == "cancelled"
        wait_idle(engine)  # the runner aborted its requests
        job = runner.get(f"/v1/jobs/{created['id']}").json()
        assert job["status"] == "cancelled" and all(item["status"] == "pending" for item in job["items"])
        assert len(recorder.requests) == 2


def test_engine_failure_fails_the_job_with_the_item_named(client, engine, monkeypatch):
    Recorder(engine, monkeypatch, invalid="BROKEN")
    items = [{"id": "ok", "text": "Fine."}, {"id": "bad", "text": "BROKEN line."}]
    created = create(client, {"items": items, **SHORT})
    job = wait_for(client, created["id"], finished)
    assert job["status"] == "failed" and "bad" in job["error"] and "prompt too long" in job["error"]
    assert {item["id"]: item["status"] for item in job["items"]}["bad"] == "failed"
    wait_idle(engine)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ({}, 400),
        ({"text": "   "}, 400),
        ({"text": "both", "items": [{"text": "x"}]}, 400),
        ({"items": []}, 400),
        ({"items": [{"text": "x"}] * 6}, 413),
        ({"items": [{"id": "a", "text": "x" * 301}]}, 413),
        ({"items": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]}, 400),
        ({"items": [{"id": "a", "text": " "}]}, 400),
        ({"items": [{"id": "../etc", "text": "x"}]}, 422),
        ({"text": "x", "format": "mp3", "sample_rate": 12345}, 400),
        ({"text": "x", "format": "flac"}, 422),
        ({"text": "x", "reference_id": "no-such-voice"}, 404),
    ],
)
def test_bad_jobs_get_fish_errors_and_create_nothing(client, engine, monkeypatch, body, status):
    recorder = Recorder(engine, monkeypatch)
    assert_fish_error(client.post("/v1/jobs", json=body), status)
    assert client.get("/v1/jobs").json()["total"] == 0 and recorder.attempts == 0


def test_auth_tenants_pagination_and_the_unfinished_job_limit(client, engine, monkeypatch):
    Recorder(engine, monkeypatch, overload=True)  # jobs stay unfinished, retrying
    assert_fish_error(client.post("/v1/jobs", json={"text": "x"}, headers={"Authorization": ""}), 401)
    first = create(client, {"text": "First.", **SHORT})
    second = create(client, {"text": "Second.", **SHORT})
    refused = client.post("/v1/jobs", json={"text": "Third.", **SHORT})
    assert_fish_error(refused, 429)
    assert refused.headers["retry-after"] == "30"
    other = {"Authorization": f"Bearer {KEY_B}"}
    for method, path in [
        ("GET", f"/v1/jobs/{first['id']}"),
        ("GET", f"/v1/jobs/{first['id']}/items/0"),
        ("DELETE", f"/v1/jobs/{first['id']}"),
        ("GET", "/v1/jobs/job_unknown"),
    ]:
        assert_fish_error(client.request(method, path, headers=other), 404)
    assert client.get(f"/v1/jobs/{first['id']}").json()["status"] in ("queued", "running")
    assert client.get("/v1/jobs", headers=other).json() == {"total": 0, "items": [], "has_more": False}
    b_job = create(client, {"text": "Tenant b.", **SHORT}, key=KEY_B)  # b's own limit is separate
    assert_fish_error(client.get(f"/v1/jobs/{first['id']}/items/nope"), 404)
    page = client.get("/v1/jobs", params={"page_size": 1}).json()
    assert page["total"] == 2 and page["has_more"] and [job["id"] for job in page["items"]] == [second["id"]]
    page = client.get("/v1/jobs", params={"page_size": 1, "page_number": 2}).json()
    assert [job["id"] for job in page["items"]] == [first["id"]] and not page["has_more"]
    assert client.delete(f"/v1/jobs/{first['id']}").json()["status"] == "cancelled"
    create(client, {"text": "Room again.", **SHORT})  # a cancelled job no longer counts
    assert client.get(f"/v1/jobs/{b_job['id']}", headers=other).json()["status"] in ("queued", "running")
