"""Two real `shoal serve` processes as two pods: each its own data directory, sharing only one
PostgreSQL database (`--database-url`) and one S3 bucket (`--blob-url`, moto's server; the
endpoint and credentials from the standard AWS variables). A voice uploaded through one is
served by the other, and a bulk job's audio is downloadable from both, whichever pod made it.
Jobs are leased in the database: when the pod running a job is killed, the other takes it over
once the lease runs out and finishes it with every item made once."""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from server_process import ShoalServer, create_voice, demo_checkpoint, wav_clip
from storage_servers import fresh_database, s3_client, use_s3

from shoal.server import audio
from shoal.server.blobs import DirectoryBlobStore
from shoal.server.store import JobLeaseRow, Store

pytestmark = pytest.mark.slow


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@contextmanager
def servers_started_together(workdirs: list[Path], *options: str) -> Iterator[list[ShoalServer]]:
    """`ShoalServer.start` for each directory at once: a start is mostly waiting on the processes
    it runs (`shoal keys`, the server's imports and warm-up), so two take little more than one."""
    demo_checkpoint(workdirs[0].parent)  # written once, before the starts could race for it
    contexts = [ShoalServer.start(workdir, *options) for workdir in workdirs]
    with ExitStack() as stack:
        with ThreadPoolExecutor(len(contexts)) as pool:
            entered = [pool.submit(context.__enter__) for context in contexts]
        for context, future in zip(contexts, entered, strict=True):
            if future.exception() is None:
                stack.push(context.__exit__)  # stopped on the way out, even if another failed
        yield [future.result() for future in entered]


def finished_job(server: ShoalServer, job_id: str, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = httpx.get(f"{server.url}/v1/jobs/{job_id}", headers=bearer(server.key_a)).json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.1)
    raise AssertionError(f"job not finished after {timeout:.0f} s: {job}")


LEASE_SECONDS = 2
LONG_ITEM = "".join(f"<|speaker:{i % 2}|>Line {{n}}, turn {i}, of a long bulk job. " for i in range(4))
JOB_ITEMS = 4


def lease_holder(database_url: str, job_id: str) -> str | None:
    """The name of the job runner holding the job's lease (a data directory's `jobs.runner`)."""
    store = Store(database_url, DirectoryBlobStore(Path(tempfile.mkdtemp())))
    try:
        with store.sessions() as session:
            lease = session.get(JobLeaseRow, job_id)
            return None if lease is None else lease.runner
    finally:
        store.close()


def test_pods_sharing_only_the_database_and_the_bucket(tmp_path_factory, monkeypatch):
    database_url = fresh_database()
    monkeypatch.setenv("SHOAL_DATABASE_URL", database_url)  # `shoal keys` and `shoal serve`
    bucket = use_s3(monkeypatch, endpoint_variable="AWS_ENDPOINT_URL")
    monkeypatch.setenv("SHOAL_BLOB_URL", f"s3://{bucket}/shoal")
    batch_allowed = ("--queue-limit", "batch=8")  # the test servers refuse batch work by default
    batch_allowed += ("--job-lease-seconds", str(LEASE_SECONDS))
    workdirs = [tmp_path_factory.mktemp("pod-a"), tmp_path_factory.mktemp("pod-b")]
    with servers_started_together(workdirs, *batch_allowed) as (first, second):
        voice_id = create_voice(first, text="a reference")  # tenant-a's key on either pod
        stored = {item["Key"] for item in s3_client().list_objects_v2(Bucket=bucket)["Contents"]}
        assert any(key.startswith(f"shoal/voices/{voice_id}/") for key in stored), stored

        body = {"text": "Hello from the other pod.", "reference_id": voice_id, "format": "pcm", "seed": 1}
        spoken = httpx.post(f"{second.url}/v1/tts", json=body, headers=bearer(second.key_a), timeout=120)
        assert spoken.status_code == 200, spoken.text
        assert len(spoken.content) > 0 and len(spoken.content) % 2 == 0
        model = httpx.get(f"{second.url}/model/{voice_id}", headers=bearer(second.key_a)).json()
        assert model["_id"] == voice_id
        clip = httpx.get(f"{second.url}/model/{voice_id}/samples/0/audio", headers=bearer(second.key_a))
        assert clip.status_code == 200 and clip.content == wav_clip()  # as uploaded to the first
        assert not [path for path in (second.data_dir / "blobs").rglob("*") if path.is_file()]
        assert any(path.is_file() for path in (second.data_dir / "blob-cache").rglob("*"))

        created = httpx.post(
            f"{second.url}/v1/jobs",
            json={"items": [{"id": "line", "text": "One line."}], "reference_id": voice_id, "format": "pcm"},
            headers=bearer(second.key_a),
        )
        assert created.status_code == 202, created.text
        job = finished_job(first, created.json()["id"])
        assert job["status"] == "done" and job["items_done"] == 1, job
        downloads = [
            httpx.get(f"{server.url}/v1/jobs/{job['id']}/items/line", headers=bearer(server.key_a))
            for server in (first, second)
        ]
        assert [response.status_code for response in downloads] == [200, 200]
        assert downloads[0].content == downloads[1].content
        assert len(downloads[0].content) == round(job["items"][0]["audio_seconds"] * audio.SAMPLE_RATE) * 2

        # The pod running a job dies mid-job: the other resumes it once the lease has run out.
        items = [{"id": f"line-{n}", "text": LONG_ITEM.format(n=n)} for n in range(JOB_ITEMS)]
        long_job = {"items": items, "format": "pcm", "chunk_length": 100, "seed": 3}
        created = httpx.post(f"{first.url}/v1/jobs", json=long_job, headers=bearer(first.key_a))
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]
        deadline = time.monotonic() + 60
        while (state := httpx.get(f"{first.url}/v1/jobs/{job_id}", headers=bearer(first.key_a)).json())[
            "items_done"
        ] < 1:
            assert time.monotonic() < deadline, state
            time.sleep(0.05)
        assert state["items_done"] < JOB_ITEMS, "the job ended before the kill"
        holder = lease_holder(database_url, job_id)
        names = [(server.data_dir / "jobs.runner").read_text().strip() for server in (first, second)]
        assert holder in names and names[0] != names[1], (holder, names)
        running, survivor = (first, second) if names[0] == holder else (second, first)
        running.process.kill()
        running.process.wait()
        killed = time.monotonic()
        job = finished_job(survivor, job_id)
        taken_over = time.monotonic() - killed
        assert job["status"] == "done" and job["items_done"] == JOB_ITEMS, job
        assert all(item["status"] == "done" and item["audio_seconds"] > 0 for item in job["items"])
        keys = [
            item["Key"]
            for item in s3_client().list_objects_v2(Bucket=bucket, Prefix=f"shoal/jobs/{job_id}/")["Contents"]
        ]
        positions = Counter(key.rsplit("/", 1)[1].split("-")[0] for key in keys if not key.endswith("npy"))
        assert sorted(positions) == [str(n) for n in range(JOB_ITEMS)], keys
        # One more object at most: the item the killed pod had stored but not yet recorded (an
        # orphan that the next start-up sweep removes); every item is recorded and served once.
        assert sum(positions.values()) <= JOB_ITEMS + 1, keys
        for item in job["items"]:
            download = httpx.get(
                f"{survivor.url}/v1/jobs/{job_id}/items/{item['id']}", headers=bearer(survivor.key_a)
            )
            assert download.status_code == 200, download.text
            assert len(download.content) == round(item["audio_seconds"] * audio.SAMPLE_RATE) * 2
        assert lease_holder(database_url, job_id) is None  # released when it finished
        print(f"\npod killed mid-job: the other finished it {taken_over:.1f} s later")
