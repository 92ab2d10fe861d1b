"""Keys and voices survive a restart; the keys CLI creates, lists and revokes; settings come from
the environment as well as options."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from shoal.server import cli, keys_cli
from shoal.server.auth import hash_api_key
from shoal.server.store import NewSample, Store, VoiceExistsError


def test_voices_and_keys_survive_reopen(tmp_path):
    store = Store.in_directory(tmp_path)
    codes = np.arange(20, dtype=np.int64).reshape(2, 10)
    row = store.create_voice("t1", "Voice", [NewSample(text="hi", audio=b"RIFF...", codes=codes)], tags=["x"])
    key = store.add_key(hash_api_key("secret"), "t1")
    store.close()

    reopened = Store.in_directory(tmp_path)
    voice = reopened.get_voice(row.id)
    assert voice is not None and voice.tags == ["x"] and voice.samples[0].text == "hi"
    [(text, loaded)] = reopened.voice_codes(voice)
    assert text == "hi" and np.array_equal(loaded, codes)
    assert reopened.find_key(hash_api_key("secret")).id == key.id
    assert reopened.revoke_key(key.id) and reopened.find_key(hash_api_key("secret")) is None
    assert reopened.delete_voice(row.id) and reopened.get_voice(row.id) is None
    assert not list((tmp_path / "blobs" / "voices" / row.id).glob("*"))


def test_reused_voice_id_never_touches_another_voices_blobs(tmp_path):
    """fish-speech's rename keeps the blobs; anyone may then take the old id. The new voice must
    neither overwrite nor (when deleted) remove the renamed voice's audio and codes."""
    store = Store.in_directory(tmp_path)
    mine = np.full((2, 5), 7, np.int64)
    theirs = np.full((2, 5), 9, np.int64)
    store.create_voice("a", "orig", [NewSample(text="a", audio=b"audio-a", codes=mine)], voice_id="orig")
    assert store.rename_voice("orig", "moved")
    store.create_voice("b", "orig", [NewSample(text="b", audio=b"audio-b", codes=theirs)], voice_id="orig")
    assert np.array_equal(store.voice_codes(store.get_voice("moved"))[0][1], mine)
    assert store.delete_voice("orig")
    moved = store.get_voice("moved")
    assert np.array_equal(store.voice_codes(moved)[0][1], mine)
    assert store.blobs.get(moved.samples[0].audio_blob) == b"audio-a"


def test_duplicate_voice_id_is_refused_without_damage(tmp_path):
    """Two creates racing for one id (both passed the route's existence check): the loser gets
    VoiceExistsError (409), leaves no blobs behind, and the winner's codes are intact."""
    store = Store.in_directory(tmp_path)
    first = np.full((2, 5), 1, np.int64)
    store.create_voice("a", "x", [NewSample(text="", audio=b"1", codes=first)], voice_id="dup")
    with pytest.raises(VoiceExistsError):
        store.create_voice("b", "x", [NewSample(text="", audio=b"2", codes=first + 1)], voice_id="dup")
    row = store.get_voice("dup")
    assert row.tenant == "a" and np.array_equal(store.voice_codes(row)[0][1], first)
    assert len(list((tmp_path / "blobs" / "voices" / "dup").glob("*"))) == 2


def test_visibility_filters_in_listing(tmp_path):
    store = Store.in_directory(tmp_path)
    sample = [NewSample(text="", audio=b"a", codes=np.zeros((1, 1), np.int64))]
    store.create_voice("a", "mine", sample)
    store.create_voice("b", "theirs public", sample, visibility="public")
    store.create_voice("b", "theirs private", sample)
    store.create_voice("b", "theirs unlisted", sample, visibility="unlist")
    total, rows = store.list_voices(visible_to="a", own_only=False)
    assert total == 2 and {r.title for r in rows} == {"mine", "theirs public"}
    assert store.list_voices(visible_to="a", own_only=True)[0] == 1


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
