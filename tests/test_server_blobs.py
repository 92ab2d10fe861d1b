"""Blob storage (`shoal/server/blobs.py`) on a local directory and on a real S3 server (moto's
server mode, `storage_servers.py`): the same put/get/delete/sweep behaviour on both; the disk
cache serves hits without asking the bucket, stays within its bound (least recently used out
first, whichever process wrote the entries) and never outlives a deleted blob in the pod that
deleted it; `--blob-url` forms and what a bad one, or an unusable bucket, says."""

from __future__ import annotations

import argparse
import os
import re
import time
from pathlib import Path

import pytest
from storage_servers import s3_client, use_s3

from shoal.server import blobs, cli
from shoal.server.blobs import (
    BlobStoreError,
    CachedBlobStore,
    DirectoryBlobStore,
    DiskCache,
    S3BlobStore,
    blob_store_for,
    parse_blob_url,
)

KIB = 1024


def count_requests(store: S3BlobStore) -> list[str]:
    """The names of the S3 operations the store's client sends from now on (botocore's own event
    hook, on the real client)."""
    sent: list[str] = []
    store.client.meta.events.register("before-send.s3", lambda **kwargs: sent.append(kwargs["event_name"]))
    return sent


@pytest.fixture(params=["directory", "s3"])
def backend(request, tmp_path, monkeypatch):
    """A bare backend: a directory, or a bucket under a key prefix."""
    if request.param == "directory":
        store = DirectoryBlobStore(tmp_path / "blobs")
    else:
        store = S3BlobStore(use_s3(monkeypatch), "deployments/one")
    yield store
    store.close()


def test_backends_put_get_delete_list_and_sweep(backend, monkeypatch):
    backend.put("voices/a/1.npy", b"codes")
    backend.put("voices/a/1.audio", b"audio")
    for position in range(5):
        backend.put(f"jobs/job_1/{position}.wav", b"x" * position)
    assert backend.get("voices/a/1.npy") == b"codes" and backend.get("jobs/job_1/3.wav") == b"xxx"
    monkeypatch.setattr(blobs, "S3_LIST_PAGE_SIZE", 2)  # the listing pages through the bucket
    listed = dict(backend.listing())
    assert set(listed) == {"voices/a/1.npy", "voices/a/1.audio"} | {f"jobs/job_1/{n}.wav" for n in range(5)}
    assert all(abs(modified - time.time()) < 60 for modified in listed.values())

    backend.delete("voices/a/1.audio")
    backend.delete("voices/a/1.audio")  # deleting what is gone is no error
    with pytest.raises(FileNotFoundError):
        backend.get("voices/a/1.audio")
    for bad in ("", "/etc/passwd", "voices/../../x", "voices//x", "voices\\x"):
        with pytest.raises(ValueError, match="blob key"):
            backend.put(bad, b"")

    keep = {"voices/a/1.npy", "jobs/job_1/0.wav"}
    assert backend.sweep(keep, older_than=time.time() - 300) == 0  # young blobs are never swept
    monkeypatch.setattr(blobs, "S3_DELETE_BATCH", 2)  # the orphans go in several requests
    assert backend.sweep(keep, older_than=time.time() + 5) == 4
    assert {key for key, _ in backend.listing()} == keep


def test_a_prefix_confines_the_store_to_its_part_of_the_bucket(tmp_path, monkeypatch):
    """Two deployments in one bucket under different prefixes: each lists and sweeps its own."""
    bucket = use_s3(monkeypatch)
    one, two = S3BlobStore(bucket, "one"), S3BlobStore(bucket, "/one-more/")
    one.put("voices/v/1.npy", b"1")
    two.put("voices/v/1.npy", b"2")
    assert one.sweep(set(), older_than=time.time() + 5) == 1
    assert two.get("voices/v/1.npy") == b"2" and [key for key, _ in two.listing()] == ["voices/v/1.npy"]
    names = {item["Key"] for item in s3_client().list_objects_v2(Bucket=bucket)["Contents"]}
    assert names == {"one-more/voices/v/1.npy"}


def test_the_cache_serves_hits_without_asking_the_bucket(tmp_path, monkeypatch):
    """A put leaves a copy in the cache and a read-through miss another; hits send no request
    at all, even for a blob the bucket has lost meanwhile. A pod that deletes a blob drops its
    copy too; the disk cache of a pod that never read it cannot serve it."""
    bucket = use_s3(monkeypatch)
    writer = blob_store_for(f"s3://{bucket}", tmp_path / "writer")
    reader = blob_store_for(f"s3://{bucket}", tmp_path / "reader")
    assert isinstance(writer, CachedBlobStore) and isinstance(reader, CachedBlobStore)
    writer.put("voices/v/1.npy", b"codes")
    written, read = count_requests(writer.backend), count_requests(reader.backend)
    assert writer.get("voices/v/1.npy") == b"codes" and written == []
    assert reader.get("voices/v/1.npy") == b"codes" and len(read) == 1  # a miss: one GetObject
    s3_client().delete_object(Bucket=bucket, Key="voices/v/1.npy")  # behind both stores' backs
    assert reader.get("voices/v/1.npy") == b"codes" and writer.get("voices/v/1.npy") == b"codes"
    assert written == [] and len(read) == 1
    assert list((tmp_path / "reader" / "blob-cache").rglob("*.tmp")) == []  # written by rename

    writer.put("voices/v/2.npy", b"more")
    writer.delete("voices/v/2.npy")
    with pytest.raises(FileNotFoundError):
        writer.get("voices/v/2.npy")
    with pytest.raises(FileNotFoundError):
        blob_store_for(f"s3://{bucket}", tmp_path / "third").get("voices/v/1.npy")
    writer.close()
    reader.close()


def age(cache: DiskCache, key: str, seconds_ago: float) -> None:
    moment = time.time() - seconds_ago
    os.utime(cache.path(key), (moment, moment))


def test_the_cache_evicts_the_least_recently_used_within_its_bound(tmp_path):
    """Two processes' caches on one directory (as API processes share a data directory): a
    write past the bound measures every entry and evicts the least recently used, a hit counts
    as a use, a blob too large to be worth caching is not kept, and a temporary file a crashed
    write left is removed once it is old."""
    bound = 10 * KIB
    cache, other_process = (DiskCache(tmp_path, "s3://bucket", bound) for _ in range(2))
    for index in range(8):
        (cache if index % 2 else other_process).write(f"k{index}", bytes(KIB))
        age(cache, f"k{index}", 100 - index)  # k0 the oldest
    assert cache.read("k0") == bytes(KIB)  # k0 is used again: now the most recent
    stale = cache.path("k0").parent / ".k0.crashed.tmp"
    stale.write_bytes(bytes(100))
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    other_process.write("too-large", bytes(2 * KIB))  # over the tenth the bound evicts down to
    assert other_process.read("too-large") is None

    for index in range(8, 11):
        cache.write(f"k{index}", bytes(KIB))  # 11 KiB: over the bound
    assert cache.read("k1") is None and cache.read("k2") is None  # the least recently used
    assert all(cache.read(f"k{index}") is not None for index in (0, *range(3, 11)))
    entries = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert sum(path.stat().st_size for path in entries) <= bound * blobs.CACHE_LOW_WATER
    assert not stale.exists()


def test_the_cache_namespace_keeps_buckets_apart(tmp_path):
    """One data directory used with two buckets (or endpoints): the same key is two entries."""
    first, second = DiskCache(tmp_path, "s3://one", 10 * KIB), DiskCache(tmp_path, "s3://two", 10 * KIB)
    first.write("voices/v/1.npy", b"one")
    assert second.read("voices/v/1.npy") is None and first.read("voices/v/1.npy") == b"one"


def test_blob_urls(tmp_path):
    assert isinstance(blob_store_for(None, tmp_path), DirectoryBlobStore)
    assert blob_store_for(None, tmp_path).root == tmp_path / "blobs"
    assert blob_store_for(str(tmp_path / "elsewhere"), tmp_path).root == tmp_path / "elsewhere"
    assert blob_store_for(f"file://{tmp_path}/there", tmp_path).root == tmp_path / "there"
    assert parse_blob_url("s3://my-bucket") == blobs.BlobLocation(bucket="my-bucket")
    location = parse_blob_url("s3://my.bucket/shoal/prod/?cache_mb=512")
    assert (location.bucket, location.prefix, location.cache_mb) == ("my.bucket", "shoal/prod", 512)
    assert parse_blob_url("s3://my-bucket?cache_mb=0").cache_mb == 0
    bad = {
        "": "empty blob URL",
        "gs://my-bucket": "unsupported blob URL",
        "s3:/my-bucket": "expected s3://bucket",
        "s3://": "expected s3://bucket",
        "s3://my%20bucket": "invalid S3 bucket name",
        "s3://bücket": "invalid S3 bucket name",
        "s3://key:secret@my-bucket": "credentials and endpoints do not go in the URL",
        "s3://localhost:9000/my-bucket": "credentials and endpoints do not go in the URL",
        "s3://my-bucket/a/../b": "invalid key prefix",
        "s3://my-bucket?region=eu": "unknown option 'region'",
        "s3://my-bucket?cache_mb=lots": "invalid cache_mb='lots'",
        "s3://my-bucket?cache_mb=-1": "invalid cache_mb='-1'",
        "file://host/srv/blobs": "expected file:///absolute/path",
        "file:relative/blobs": "expected file:///absolute/path",
    }
    for url, message in bad.items():
        with pytest.raises(BlobStoreError, match=re.escape(message)):
            parse_blob_url(url)
    (tmp_path / "a-file").write_bytes(b"")
    with pytest.raises(BlobStoreError, match="cannot use the blob directory"):
        blob_store_for(str(tmp_path / "a-file" / "blobs"), tmp_path)


def test_an_unusable_bucket_stops_serve_before_the_engine_loads(tmp_path, monkeypatch, caplog):
    """A missing bucket, or no credentials: `shoal serve` logs the reason and exits 1 before it
    loads a checkpoint (this one does not even exist)."""
    bucket = use_s3(monkeypatch)
    with pytest.raises(BlobStoreError, match="the bucket does not exist"):
        blob_store_for(f"s3://{bucket}-missing", tmp_path)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    argv = ["--checkpoint", str(tmp_path / "none"), "--data-dir", str(tmp_path)]
    assert cli.run(parser.parse_args([*argv, "--blob-url", f"s3://{bucket}-missing"])) == 1
    assert f"cannot use s3://{bucket}-missing at http://127.0.0.1" in caplog.text
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    assert cli.run(parser.parse_args([*argv, "--blob-url", f"s3://{bucket}"])) == 1
    assert "no AWS credentials" in caplog.text and "AWS_ACCESS_KEY_ID" in caplog.text
    assert not (tmp_path / "blob-cache").exists() or not any((tmp_path / "blob-cache").iterdir())


def test_store_paths_stay_inside_the_directory(tmp_path):
    """A key that resolves outside the blob directory through a link is refused."""
    store = DirectoryBlobStore(tmp_path / "blobs")
    (tmp_path / "outside").mkdir()
    Path(tmp_path / "blobs" / "link").symlink_to(tmp_path / "outside")
    with pytest.raises(ValueError, match="escapes the blob directory"):
        store.put("link/x", b"")
