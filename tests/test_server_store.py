"""Keys, voices and jobs survive a restart, on the single-node default (SQLite, a blob directory)
and on what pods that share no disk use (a real PostgreSQL server from `pgserver`, a real S3 server
from moto, with the disk cache in front; `storage_servers.py`): a fresh database and bucket per
test. Pods that share the database and the bucket never read each other's stale blobs. The keys
CLI creates, lists and revokes; settings come from the environment as well as options."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from storage_servers import fresh_database, use_s3

from shoal.server import cli, keys_cli
from shoal.server.auth import hash_api_key
from shoal.server.store import NewSample, Store, VoiceExistsError, database_url_for

# (database, blob storage): the single-node default, and the one for pods sharing no disk.
BACKENDS = ["sqlite+directory", "postgresql+s3"]


@dataclass
class StoreOpener:
    """`open_store()`: a Store on `data_dir` with these database and blob URLs (the same ones
    each call, so a second call is a restart)."""

    data_dir: Path
    database_url: str | None = None
    blob_url: str | None = None
    opened: list[Store] = field(default_factory=list)

    def __call__(self) -> Store:
        self.opened.append(Store.in_directory(self.data_dir, self.database_url, self.blob_url))
        return self.opened[-1]

    def close(self) -> None:
        for store in self.opened:
            store.close()


def stored_keys(store: Store) -> set[str]:
    return {key for key, _ in store.blobs.listing()}


@pytest.fixture(params=BACKENDS)
def open_store(request, tmp_path, monkeypatch):
    opener = StoreOpener(tmp_path)
    if request.param == "postgresql+s3":
        opener.database_url = fresh_database()
        opener.blob_url = f"s3://{use_s3(monkeypatch)}/shoal"
    yield opener
    opener.close()


def test_voices_and_keys_survive_reopen(open_store):
    store = open_store()
    codes = np.arange(20, dtype=np.int64).reshape(2, 10)
    row = store.create_voice("t1", "Voice", [NewSample(text="hi", audio=b"RIFF...", codes=codes)], tags=["x"])
    key = store.add_key(hash_api_key("secret"), "t1")
    store.close()

    reopened = open_store()
    voice = reopened.get_voice(row.id)
    assert voice is not None and voice.tags == ["x"] and voice.samples[0].text == "hi"
    [(text, loaded)] = reopened.voice_codes(voice)
    assert text == "hi" and np.array_equal(loaded, codes)
    assert reopened.find_key(hash_api_key("secret")).id == key.id
    assert reopened.revoke_key(key.id) and reopened.find_key(hash_api_key("secret")) is None
    assert reopened.delete_voice(row.id) and reopened.get_voice(row.id) is None
    assert not [key for key in stored_keys(reopened) if key.startswith(f"voices/{row.id}/")]


def test_reused_voice_id_never_touches_another_voices_blobs(open_store):
    """fish-speech's rename keeps the blobs; anyone may then take the old id. The new voice must
    neither overwrite nor (when deleted) remove the renamed voice's audio and codes."""
    store = open_store()
    mine = np.full((2, 5), 7, np.int64)
    theirs = np.full((2, 5), 9, np.int64)
    store.create_voice("a", "orig", [NewSample(text="a", audio=b"audio-a", codes=mine)], voice_id="orig")
    assert store.rename_voice("orig", "moved", "moved")
    assert store.get_voice("moved").title == "moved"
    store.create_voice("b", "orig", [NewSample(text="b", audio=b"audio-b", codes=theirs)], voice_id="orig")
    assert np.array_equal(store.voice_codes(store.get_voice("moved"))[0][1], mine)
    assert store.delete_voice("orig")
    moved = store.get_voice("moved")
    assert np.array_equal(store.voice_codes(moved)[0][1], mine)
    assert store.blobs.get(moved.samples[0].audio_blob) == b"audio-a"


def test_duplicate_voice_id_is_refused_without_damage(open_store):
    """Two creates racing for one id (both passed the route's existence check): the loser gets
    VoiceExistsError (409), leaves no blobs behind, and the winner's codes are intact."""
    store = open_store()
    first = np.full((2, 5), 1, np.int64)
    store.create_voice("a", "x", [NewSample(text="", audio=b"1", codes=first)], voice_id="dup")
    with pytest.raises(VoiceExistsError):
        store.create_voice("b", "x", [NewSample(text="", audio=b"2", codes=first + 1)], voice_id="dup")
    row = store.get_voice("dup")
    assert row.tenant == "a" and np.array_equal(store.voice_codes(row)[0][1], first)
    assert len([key for key in stored_keys(store) if key.startswith("voices/dup/")]) == 2


def test_visibility_filters_in_listing(open_store):
    store = open_store()
    sample = [NewSample(text="", audio=b"a", codes=np.zeros((1, 1), np.int64))]
    store.create_voice("a", "mine", sample)
    store.create_voice("b", "theirs public", sample, visibility="public")
    store.create_voice("b", "theirs private", sample)
    store.create_voice("b", "theirs unlisted", sample, visibility="unlist")
    total, rows = store.list_voices(visible_to="a", own_only=False)
    assert total == 2 and {r.title for r in rows} == {"mine", "theirs public"}
    assert store.list_voices(visible_to="a", own_only=True)[0] == 1


def test_a_job_and_its_items_checkpoint_and_survive_reopen(open_store):
    """A bulk job as the jobs worker drives it: items finish concurrently (SQL increments), one
    fails, a finish recorded twice counts once; after a restart the job is where it was, and the
    finished job is no longer one a restart resumes."""
    store = open_store()
    reference = np.arange(6, dtype=np.int64).reshape(2, 3)
    job = store.create_job(
        "acme", {"format": "wav"}, [("ref", reference)], [("a", "x"), ("b", "y"), ("c", "z")]
    )
    assert store.active_job_ids() == [job.id] and store.count_active_jobs("acme") == 1
    assert store.set_job_status(job.id, "running")
    for position in range(3):
        store.mark_job_item_running(job.id, position)
    store.finish_job_item(job.id, 0, b"audio-a", "wav", 1.5)
    store.finish_job_item(job.id, 0, b"audio-again", "wav", 1.5)  # a retried item: counted once
    store.mark_job_item_running(job.id, 0)  # a done item stays done
    store.finish_job_item(job.id, 2, b"audio-c", "wav", 2.25)
    assert store.reset_running_job_items(job.id) == 1  # the runner died while item 1 ran
    assert store.job_item(job.id, "b").status == "pending"
    store.fail_job_item(job.id, 1, "too long")
    reopened = open_store()
    row = reopened.get_job(job.id)
    assert (row.status, row.items_done, row.items_total, row.audio_seconds) == ("running", 2, 3, 3.75)
    assert row.options == {"format": "wav"} and row.references[0]["text"] == "ref"
    items = reopened.job_items(job.id)
    assert [(i.item_id, i.status) for i in items] == [("a", "done"), ("b", "failed"), ("c", "done")]
    assert reopened.blobs.get(items[0].audio_blob) == b"audio-a" and items[1].error == "too long"
    assert reopened.job_item(job.id, "c").audio_seconds == 2.25
    assert reopened.set_job_status(job.id, "done") and not reopened.set_job_status(job.id, "cancelled")
    assert reopened.active_job_ids() == [] and reopened.count_active_jobs("acme") == 0
    total, rows = reopened.list_jobs("acme")
    assert total == 1 and rows[0].status == "done" and rows[0].finished_at is not None
    assert reopened.list_jobs("other") == (0, [])


def test_a_job_lease_belongs_to_one_runner_until_it_runs_out(open_store):
    """Servers sharing the database split the jobs: a live lease keeps other runners off, its
    holder renews and releases it, and a lapsed lease (its server died) goes to the next claim,
    after which the old holder's renewal says it lost the job."""
    first, second = open_store(), open_store()  # two servers on the same database
    job = first.create_job("acme", {}, [], [("a", "x")])
    other = first.create_job("acme", {}, [], [("b", "y")])
    assert first.claim_job(job.id, "runner-1", 30)
    assert not second.claim_job(job.id, "runner-2", 30)
    assert first.claim_job(job.id, "runner-1", 30)  # its holder may claim again
    assert second.claim_job(other.id, "runner-2", 30)
    assert first.renew_job_leases("runner-1", {job.id, other.id}, 30) == {job.id}
    # What each runner may run: its own jobs and the unleased ones, never another's live lease.
    assert first.active_job_ids("runner-1") == [job.id] and second.active_job_ids("runner-2") == [other.id]
    assert first.active_job_ids() == [job.id, other.id]
    first.release_job(job.id, "runner-2")  # not its lease: nothing happens
    assert not second.claim_job(job.id, "runner-2", 30)
    first.release_job(job.id, "runner-1")
    assert second.claim_job(job.id, "runner-2", -1)  # a lease that has already run out
    assert first.claim_job(job.id, "runner-1", 30)  # taken over
    assert second.renew_job_leases("runner-2", {job.id, other.id}, 30) == {other.id}
    assert first.renew_job_leases("runner-1", set(), 30) == set()


def test_stores_opening_an_empty_postgresql_database_together_all_open(tmp_path):
    """Pods starting at once on a new database: table creation is serialized (an advisory
    lock), so none fails on the tables another is creating."""
    url = fresh_database()
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda n: Store.in_directory(tmp_path / str(n), url), range(4)))
    try:
        stores[0].add_key(hash_api_key("k"), "t")
        assert all(store.find_key(hash_api_key("k")) is not None for store in stores)
    finally:
        for store in stores:
            store.close()


def test_database_urls_name_an_installed_driver() -> None:
    """`postgresql://...` (SQLAlchemy's default driver, psycopg2, is not installed) means
    psycopg 3, the driver `shoal[postgres]` installs; an explicit driver and SQLite stay."""
    assert database_url_for("postgresql://u:p@db/shoal") == "postgresql+psycopg://u:p@db/shoal"
    assert database_url_for("postgres://u@db/shoal") == "postgresql+psycopg://u@db/shoal"
    assert database_url_for("postgresql+asyncpg://db/x") == "postgresql+asyncpg://db/x"
    assert database_url_for("sqlite:////tmp/x.db") == "sqlite:////tmp/x.db"


def parse(module, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def test_keys_cli_lifecycle(tmp_path, capsys):
    data = ["--data-dir", str(tmp_path)]
    assert keys_cli.run(parse(keys_cli, [*data, "create", "--tenant", "acme", "--priority", "batch"])) == 0
    out = capsys.readouterr().out
    key = next(line.split()[1] for line in out.splitlines() if line.startswith("key:"))
    key_id = next(line.split()[1] for line in out.splitlines() if line.startswith("id:"))
    store = Store.in_directory(tmp_path)
    row = store.find_key(hash_api_key(key))
    assert row.tenant == "acme" and row.priority == "batch"
    assert keys_cli.run(parse(keys_cli, [*data, "list"])) == 0
    listing = capsys.readouterr().out
    assert key_id in listing and key not in listing
    assert keys_cli.run(parse(keys_cli, [*data, "revoke", key_id])) == 0
    assert keys_cli.run(parse(keys_cli, [*data, "revoke", key_id])) == 1
    assert store.find_key(hash_api_key(key)) is None


def test_serve_options_from_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SHOAL_CHECKPOINT", "some/repo")
    monkeypatch.setenv("SHOAL_PORT", "9191")
    monkeypatch.setenv("SHOAL_NO_AUTH", "1")
    monkeypatch.setenv("SHOAL_DATA_DIR", str(tmp_path))
    args = parse(cli, [])
    assert (args.checkpoint, args.port, args.no_auth, args.data_dir) == ("some/repo", 9191, True, tmp_path)
    assert parse(cli, ["--port", "1234"]).port == 1234
    monkeypatch.delenv("SHOAL_CHECKPOINT")
    with pytest.raises(SystemExit):
        parse(cli, [])


def test_default_data_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("SHOAL_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert keys_cli.default_data_dir() == tmp_path / "shoal"


def test_serve_reads_the_blob_url_and_refuses_a_malformed_one(monkeypatch, capsys):
    monkeypatch.setenv("SHOAL_CHECKPOINT", "some/repo")
    monkeypatch.setenv("SHOAL_BLOB_URL", "s3://voices-bucket/shoal")
    assert parse(cli, []).blob_url == "s3://voices-bucket/shoal"
    assert parse(cli, ["--blob-url", "/srv/blobs"]).blob_url == "/srv/blobs"
    monkeypatch.delenv("SHOAL_BLOB_URL")
    assert parse(cli, []).blob_url is None
    with pytest.raises(SystemExit):
        parse(cli, ["--blob-url", "gs://voices-bucket"])
    assert "unsupported blob URL 'gs://voices-bucket'" in capsys.readouterr().err


CRASH_SCRIPT = """
import os, sys
from pathlib import Path
import numpy as np
from shoal.server.store import NewSample, Store

data_dir, job_id, stage = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
store = Store.in_directory(data_dir, database_url=sys.argv[4], blob_url=sys.argv[5] or None)
def killed(*args, **kwargs):
    os._exit(9)  # a crash: no exception handler, no cleanup
if stage == "item":  # the item's audio is written, its row never commits
    store.sessions.begin = killed
    store.finish_job_item(job_id, 1, b"orphan audio", "wav", 1.0)
elif stage == "voice":  # a voice's samples are written, its row never commits
    store.sessions.begin = killed
    codes = np.zeros((2, 3), np.int64)
    store.create_voice("acme", "lost", [NewSample(text="t", audio=b"a", codes=codes)])
elif stage == "put":  # killed at the rename that ends a file's write (a blob's, or its cached copy's)
    os.replace = killed
    store.blobs.put("voices/half/sample.audio", b"half")
"""


def test_blobs_a_crash_leaves_are_swept_at_start_up(open_store):
    """Killed processes leave a job item's audio, a voice's samples and a half-written blob (a
    `.tmp` file in a directory; in a bucket, where a put is atomic, a whole object) with no row
    naming them; the start-up sweep removes those (and the directories they leave empty), never
    a blob a row names nor one young enough to belong to a write in flight."""
    import subprocess
    import sys

    store = open_store()
    codes = np.ones((2, 3), np.int64)
    kept_voice = store.create_voice("acme", "kept", [NewSample(text="t", audio=b"kept", codes=codes)])
    job = store.create_job("acme", {"format": "wav"}, [("ref", codes)], [("a", "x"), ("b", "y")])
    store.finish_job_item(job.id, 0, b"kept audio", "wav", 1.0)
    url = store.engine.url.render_as_string(hide_password=False)  # the same database, either backend
    for stage in ("item", "voice", "put"):
        command = [sys.executable, "-c", CRASH_SCRIPT, str(open_store.data_dir), job.id, stage, url]
        crashed = subprocess.run([*command, open_store.blob_url or ""], capture_output=True)
        assert crashed.returncode == 9, crashed.stderr.decode()
    files = stored_keys(store)
    referenced = store.referenced_blobs()
    orphans = files - referenced
    assert len(referenced) == 4  # the voice's audio + codes, the job's reference, item 0's audio
    assert referenced <= files and len(orphans) == 4  # item 1's audio, the lost voice's two, the half
    half = "voices/half/sample.audio" + (".tmp" if open_store.blob_url is None else "")
    assert half in orphans

    restarted = open_store()
    assert restarted.sweep_orphan_blobs() == 0  # all of them are younger than the grace period
    assert restarted.sweep_orphan_blobs(grace_seconds=0) == 4
    assert stored_keys(restarted) == referenced
    blob_root = open_store.data_dir / "blobs"
    assert not [d for d in blob_root.rglob("*") if d.is_dir() and not any(d.iterdir())]
    assert restarted.voice_codes(restarted.get_voice(kept_voice.id))[0][0] == "t"
    assert restarted.blobs.get(restarted.job_items(job.id)[0].audio_blob) == b"kept audio"


def test_pods_sharing_the_database_and_bucket_never_read_stale_blobs(tmp_path, monkeypatch):
    """Two pods: one PostgreSQL database and one bucket, each its own data directory (so its own
    disk cache). A voice one pod created is served by the other; when a pod deletes it and
    creates another under the same id, the pod that had cached the first one's codes serves the
    new codes (every write has a key of its own, named by the row), and a retried job item's
    audio never replaces the one recorded."""
    database, bucket = fresh_database(), use_s3(monkeypatch)
    pod_a = StoreOpener(tmp_path / "a", database, f"s3://{bucket}")
    pod_b = StoreOpener(tmp_path / "b", database, f"s3://{bucket}")
    try:
        a, b = pod_a(), pod_b()
        first, second = np.full((2, 4), 1, np.int64), np.full((2, 4), 2, np.int64)
        a.create_voice("acme", "v", [NewSample(text="one", audio=b"one", codes=first)], voice_id="v")
        assert np.array_equal(b.voice_codes(b.get_voice("v"))[0][1], first)  # b caches it now
        assert np.array_equal(a.voice_codes(a.get_voice("v"))[0][1], first)  # a cached it on put
        assert b.delete_voice("v")
        b.create_voice("acme", "v", [NewSample(text="two", audio=b"two", codes=second)], voice_id="v")
        [(text, codes)] = a.voice_codes(a.get_voice("v"))
        assert text == "two" and np.array_equal(codes, second)

        job = a.create_job("acme", {"format": "wav"}, [], [("a", "x")])
        a.finish_job_item(job.id, 0, b"first take", "wav", 1.0)
        b.finish_job_item(job.id, 0, b"retried take", "wav", 1.0)  # a second runner's retry
        assert b.blobs.get(b.job_item(job.id, "a").audio_blob) == b"first take"
        assert a.blobs.get(a.job_item(job.id, "a").audio_blob) == b"first take"
        assert stored_keys(a) == a.referenced_blobs()  # the retry's audio was removed again
    finally:
        pod_a.close()
        pod_b.close()


def test_voice_uses_are_added_in_one_write_on_every_backend(open_store):
    store = open_store()
    first = store.create_voice("t1", "one", [])
    second = store.create_voice("t1", "two", [])
    store.count_uses({first.id: 3, second.id: 1, "deleted-meanwhile": 2})
    store.count_uses({first.id: 1})
    assert (store.get_voice(first.id).task_count, store.get_voice(second.id).task_count) == (4, 1)


def test_sqlite_runs_with_a_write_ahead_log(tmp_path):
    """Several API processes share the file: with the log a write never blocks their reads."""
    store = Store.in_directory(tmp_path)
    try:
        with store.engine.connect() as connection:
            assert connection.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert connection.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
            assert connection.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    finally:
        store.close()


def test_a_voices_uses_are_written_after_the_request_and_at_shutdown(tmp_path):
    """`VoiceResolver.count_use` books in memory; one write per `USE_FLUSH_SECONDS` adds them,
    and closing writes what is still pending, so no use is lost and no request waits."""
    import asyncio

    from shoal.server import voices
    from shoal.server.settings import ServerSettings

    store = Store.in_directory(tmp_path)
    voice = store.create_voice("t1", "v", [])

    async def scenario() -> tuple[int, int, int]:
        resolver = voices.VoiceResolver(None, store, ServerSettings())
        resolver.count_use(voice.id)
        resolver.count_use(voice.id)
        right_after = store.get_voice(voice.id).task_count
        await asyncio.sleep(voices.USE_FLUSH_SECONDS + 0.5)
        flushed = store.get_voice(voice.id).task_count
        resolver.count_use(voice.id)
        await resolver.close()
        return right_after, flushed, store.get_voice(voice.id).task_count

    try:
        assert asyncio.run(scenario()) == (0, 2, 3)
    finally:
        store.close()
