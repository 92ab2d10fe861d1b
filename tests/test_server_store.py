"""Keys, voices and jobs survive a restart, on SQLite (the default) and on a real PostgreSQL server
(`pgserver`: PostgreSQL's own binaries from PyPI, started for the session; a fresh database per
test); the keys CLI creates, lists and revokes; settings come from the environment as well as
options."""

from __future__ import annotations

import argparse
import uuid

import numpy as np
import pytest

from shoal.server import cli, keys_cli
from shoal.server.auth import hash_api_key
from shoal.server.store import NewSample, Store, VoiceExistsError, database_url_for


@pytest.fixture(scope="session")
def postgres(tmp_path_factory):
    """A PostgreSQL server for the session: (admin connection string, URL template)."""
    pgserver = pytest.importorskip("pgserver")
    psycopg = pytest.importorskip("psycopg")
    server = pgserver.get_server(tmp_path_factory.mktemp("postgres"), cleanup_mode="stop")
    uri = server.get_uri()  # postgresql://postgres:@/postgres?host=<socket directory>
    yield psycopg, uri, uri.replace("@/postgres?", "@/{database}?")
    server.cleanup()


@pytest.fixture(params=["sqlite", "postgresql"])
def open_store(request, tmp_path):
    """`open_store()`: a Store on tmp_path's blobs and this backend's database (the same database
    each call, so a second call is a restart)."""
    url = None
    if request.param == "postgresql":
        psycopg, admin, template = request.getfixturevalue("postgres")
        database = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(admin, autocommit=True) as connection:
            connection.execute(f"CREATE DATABASE {database}")
        url = template.format(database=database)
    opened: list[Store] = []

    def open_() -> Store:
        opened.append(Store.in_directory(tmp_path, database_url=url))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()


def test_voices_and_keys_survive_reopen(open_store, tmp_path):
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
    assert not list((tmp_path / "blobs" / "voices" / row.id).glob("*"))


def test_reused_voice_id_never_touches_another_voices_blobs(open_store, tmp_path):
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


def test_duplicate_voice_id_is_refused_without_damage(open_store, tmp_path):
    """Two creates racing for one id (both passed the route's existence check): the loser gets
    VoiceExistsError (409), leaves no blobs behind, and the winner's codes are intact."""
    store = open_store()
    first = np.full((2, 5), 1, np.int64)
    store.create_voice("a", "x", [NewSample(text="", audio=b"1", codes=first)], voice_id="dup")
    with pytest.raises(VoiceExistsError):
        store.create_voice("b", "x", [NewSample(text="", audio=b"2", codes=first + 1)], voice_id="dup")
    row = store.get_voice("dup")
    assert row.tenant == "a" and np.array_equal(store.voice_codes(row)[0][1], first)
    assert len(list((tmp_path / "blobs" / "voices" / "dup").glob("*"))) == 2


def test_visibility_filters_in_listing(open_store, tmp_path):
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


CRASH_SCRIPT = """
import os, sys
from pathlib import Path
import numpy as np
from shoal.server import store as store_module
from shoal.server.store import NewSample, Store

data_dir, job_id, stage = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
store = Store.in_directory(data_dir, database_url=sys.argv[4])
def killed(*args, **kwargs):
    os._exit(9)  # a crash: no exception handler, no cleanup
if stage == "item":  # the item's audio is written, its row never commits
    store.sessions.begin = killed
    store.finish_job_item(job_id, 1, b"orphan audio", "wav", 1.0)
elif stage == "voice":  # a voice's samples are written, its row never commits
    store.sessions.begin = killed
    codes = np.zeros((2, 3), np.int64)
    store.create_voice("acme", "lost", [NewSample(text="t", audio=b"a", codes=codes)])
elif stage == "put":  # killed halfway through writing a blob
    store_module.os.replace = killed
    store.blobs.put("voices/half/sample.audio", b"half")
"""


def test_blobs_a_crash_leaves_are_swept_at_start_up(open_store, tmp_path):
    """Killed processes leave a job item's audio, a voice's samples and a half-written `.tmp`
    with no row naming them; the start-up sweep removes those (and the directories they leave
    empty), never a blob a row names nor one young enough to belong to a write in flight."""
    import subprocess
    import sys

    store = open_store()
    codes = np.ones((2, 3), np.int64)
    kept_voice = store.create_voice("acme", "kept", [NewSample(text="t", audio=b"kept", codes=codes)])
    job = store.create_job("acme", {"format": "wav"}, [("ref", codes)], [("a", "x"), ("b", "y")])
    store.finish_job_item(job.id, 0, b"kept audio", "wav", 1.0)
    url = store.engine.url.render_as_string(hide_password=False)  # the same database, either backend
    for stage in ("item", "voice", "put"):
        crashed = subprocess.run(
            [sys.executable, "-c", CRASH_SCRIPT, str(tmp_path), job.id, stage, url], capture_output=True
        )
        assert crashed.returncode == 9, crashed.stderr.decode()
    blob_root = tmp_path / "blobs"
    files = {p.relative_to(blob_root).as_posix() for p in blob_root.rglob("*") if p.is_file()}
    referenced = store.referenced_blobs()
    orphans = files - referenced
    assert len(referenced) == 4  # the voice's audio + codes, the job's reference, item 0's audio
    assert referenced <= files and len(orphans) == 4  # item 1's audio, the lost voice's two, a .tmp
    assert any(name.endswith(".tmp") for name in orphans)

    restarted = open_store()
    assert restarted.sweep_orphan_blobs() == 0  # all of them are younger than the grace period
    assert restarted.sweep_orphan_blobs(grace_seconds=0) == 4
    left = {p.relative_to(blob_root).as_posix() for p in blob_root.rglob("*") if p.is_file()}
    assert left == referenced
    assert not [d for d in blob_root.rglob("*") if d.is_dir() and not any(d.iterdir())]
    assert restarted.voice_codes(restarted.get_voice(kept_voice.id))[0][0] == "t"
    assert restarted.blobs.get(restarted.job_items(job.id)[0].audio_blob) == b"kept audio"
