"""Blob storage: voice audio, codec codes and job outputs, as opaque bytes under relative keys
like `voices/<id>/<sample>.npy`. Either a local directory (the default: one server, or a volume
its pods share) or an S3-compatible bucket with a disk cache in front, so that any pod serves any
voice while the pods share nothing but the database and the bucket (`blob_store_for`).

Keys are written once. The store puts a fresh random part into every key it writes and keeps the
key in the row that names the blob, so the bytes under a key never change: a cached copy can
never be stale on any pod, and a deleted key is never asked for again (its cached copy just ages
out). That is why the cache serves hits without asking the bucket.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol
from urllib.parse import parse_qs, unquote, urlsplit

log = logging.getLogger("shoal.server.blobs")

DEFAULT_CACHE_MB = 2048.0  # `s3://...?cache_mb=N` changes it; 0 turns the cache off
MIB = 1024 * 1024
# After an eviction the cache holds at most this share of its bound, so that not every write
# that follows needs another scan of the directory.
CACHE_LOW_WATER = 0.9
# Each process rescans the cache after writing this share of the bound: it sees only its own
# writes in between, so several processes sharing a directory overshoot by at most this each.
CACHE_RESCAN_SHARE = 0.1
CACHE_TEMP_SUFFIX = ".tmp"
CACHE_STALE_TEMP_SECONDS = 600.0  # a cache write left this long was cut off by a crash
S3_DELETE_BATCH = 1000  # the most keys one DeleteObjects request takes
S3_LIST_PAGE_SIZE = 1000  # the most keys one ListObjectsV2 answer holds
S3_MAX_CONNECTIONS = 32  # the routes call the store from anyio's worker threads (40 by default)
# What botocore itself accepts: the names of today's buckets and of older, laxer ones.
BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
URL_FORMS = "a directory, file:///absolute/path or s3://bucket[/prefix][?cache_mb=N]"


class BlobStoreError(RuntimeError):
    """Blob storage that cannot be used: a malformed URL, a bucket that is missing or refused."""


class BlobStore(Protocol):
    """What the store needs from a blob backend."""

    def put(self, key: str, data: bytes) -> None: ...

    def get(self, key: str) -> bytes:
        """The blob's bytes; FileNotFoundError when there is none under `key`."""
        ...

    def delete(self, key: str) -> None:
        """Remove the blob; nothing happens when there is none."""
        ...

    def listing(self) -> Iterator[tuple[str, float]]:
        """(key, last written as a `time.time()`) of every stored blob."""
        ...

    def sweep(self, keep: set[str], older_than: float) -> int:
        """Delete every blob not in `keep` last written before `older_than`; returns how many."""
        ...

    def close(self) -> None: ...


def check_key(key: str) -> str:
    """A key is a relative path of plain names: no backend may be steered outside its root."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(part in ("", ".", "..") for part in parts):
        raise ValueError(f"invalid blob key: {key!r}")
    return key


class DirectoryBlobStore:
    """Blobs as files under one directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise BlobStoreError(f"cannot use the blob directory {root}: {error}") from error

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if self.root.resolve() not in path.parents:
            raise ValueError(f"blob key escapes the blob directory: {key!r}")
        return path

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(path.suffix + ".tmp")
        temporary.write_bytes(data)
        os.replace(temporary, path)  # atomic: a crash never leaves half a blob

    def get(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def listing(self) -> Iterator[tuple[str, float]]:
        for path in self.root.rglob("*"):
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile
                if path.is_file():
                    yield path.relative_to(self.root).as_posix(), path.stat().st_mtime

    def sweep(self, keep: set[str], older_than: float) -> int:
        """Delete every file not named in `keep` (a key, or a `.tmp` left by a crashed `put`)
        last written before `older_than` (a `time.time()`), then the directories left empty;
        returns the files deleted. Younger files may belong to a write whose row is about to
        commit (in this process or another sharing the directory)."""
        removed = 0
        for path in sorted(self.root.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            if path.is_dir():
                with contextlib.suppress(OSError):  # not empty
                    path.rmdir()
                continue
            key = path.relative_to(self.root).as_posix()
            if key not in keep and path.stat().st_mtime < older_than:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def close(self) -> None:
        pass


class S3BlobStore:
    """Blobs as objects in an S3-compatible bucket, under an optional key prefix. boto3 finds the
    endpoint (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, for MinIO and the like), the credentials
    and the region itself, from the standard AWS variables and files. The bucket is checked on
    construction, so a server that cannot use it stops at start-up with the reason."""

    def __init__(self, bucket: str, prefix: str = "") -> None:
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        config = Config(max_pool_connections=S3_MAX_CONNECTIONS, connect_timeout=10, read_timeout=60)
        self.client = boto3.session.Session().client("s3", config=config)
        self._check_bucket()

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def _check_bucket(self) -> None:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            EndpointConnectionError,
            NoCredentialsError,
        )

        where = f"{self.url} at {self.client.meta.endpoint_url}"
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except NoCredentialsError as error:
            raise BlobStoreError(
                f"no AWS credentials for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE, or give the machine a role)"
            ) from error
        except EndpointConnectionError as error:
            raise BlobStoreError(
                f"cannot connect to the S3 endpoint for {where} (set by AWS_ENDPOINT_URL_S3 or "
                f"AWS_ENDPOINT_URL): {error}"
            ) from error
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            if code in ("404", "NoSuchBucket"):
                reason = "the bucket does not exist"
            elif code in ("403", "AccessDenied"):
                reason = "access denied: check the AWS credentials and the bucket's policy"
            else:
                reason = str(error)
            raise BlobStoreError(f"cannot use {where}: {reason}") from error
        except BotoCoreError as error:
            raise BlobStoreError(f"cannot use {where}: {error}") from error

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + check_key(key), Body=data)

    def get(self, key: str) -> bytes:
        try:
            response = self.client.get_object(Bucket=self.bucket, Key=self.prefix + check_key(key))
        except self.client.exceptions.NoSuchKey as error:
            raise FileNotFoundError(f"no blob {key!r} in {self.url}") from error
        return response["Body"].read()

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self.prefix + check_key(key))

    def listing(self) -> Iterator[tuple[str, float]]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.prefix, PaginationConfig={"PageSize": S3_LIST_PAGE_SIZE}
        )
        for page in pages:
            for item in page.get("Contents", []):
                yield item["Key"][len(self.prefix) :], item["LastModified"].timestamp()

    def sweep(self, keep: set[str], older_than: float) -> int:
        return len(self.sweep_keys(keep, older_than))

    def sweep_keys(self, keep: set[str], older_than: float) -> list[str]:
        """Delete every object under the prefix that `keep` does not name and that was last
        written before `older_than`; returns their keys. The bucket, or the prefix, belongs to
        this store alone."""
        doomed = [key for key, modified in self.listing() if key not in keep and modified < older_than]
        for start in range(0, len(doomed), S3_DELETE_BATCH):
            batch = [{"Key": self.prefix + key} for key in doomed[start : start + S3_DELETE_BATCH]]
            response = self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
            )
            if response.get("Errors"):
                first = response["Errors"][0]
                raise BlobStoreError(
                    f"could not delete {len(response['Errors'])} orphan objects in {self.url}, e.g. "
                    f"{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )
        return doomed

    def close(self) -> None:
        self.client.close()


class DiskCache:
    """Blobs on local disk, at most `max_bytes`, the least recently used evicted first. Several
    processes may share the directory: entries appear by rename (a reader sees a whole file or
    none), a hit renews the entry's mtime (its last use, whatever the mount's atime policy), and
    an entry evicted while another process reads it stays readable through the open file."""

    def __init__(self, root: Path, namespace: str, max_bytes: int) -> None:
        self.root = root
        self.namespace = namespace  # the backend's identity: one directory may serve several
        self.max_bytes = max_bytes
        self.low_water = int(max_bytes * CACHE_LOW_WATER)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise BlobStoreError(f"cannot use the blob cache directory {root}: {error}") from error
        self._lock = threading.Lock()
        self._bytes: int | None = None  # the cache's size at the last scan plus this process's writes
        self._written_since_scan = 0

    def path(self, key: str) -> Path:
        digest = hashlib.sha256(f"{self.namespace}\0{key}".encode()).hexdigest()
        return self.root / digest[:2] / digest[2:]

    def read(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            with path.open("rb") as file:
                data = file.read()
        except FileNotFoundError:
            return None
        except OSError as error:
            log.warning("blob cache: cannot read %s (%s): fetching it again", path, error)
            return None
        with contextlib.suppress(OSError):  # evicted meanwhile: the bytes read are still right
            os.utime(path)
        return data

    def write(self, key: str, data: bytes) -> None:
        """Keep a copy; a full or broken disk only costs the copy (the backend has the blob)."""
        if len(data) > self.max_bytes - self.low_water:
            return  # one blob this large could evict everything else at once
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)  # the directory may have been removed
            descriptor, temporary = tempfile.mkstemp(
                dir=path.parent, prefix=f".{path.name}.", suffix=CACHE_TEMP_SUFFIX
            )
            try:
                with os.fdopen(descriptor, "wb") as file:
                    file.write(data)
                os.replace(temporary, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
        except OSError as error:
            log.warning("blob cache: cannot write %s (%s)", path, error)
            return
        with self._lock:
            self._written_since_scan += len(data)
            if self._bytes is not None:
                self._bytes += len(data)
            if (
                self._bytes is None
                or self._bytes > self.max_bytes
                or self._written_since_scan > self.max_bytes * CACHE_RESCAN_SHARE
            ):
                try:
                    self._evict()
                except OSError as error:  # the cache is only a copy: never fail the caller for it
                    log.warning("blob cache: cannot measure %s (%s)", self.root, error)

    def discard(self, key: str) -> None:
        with contextlib.suppress(OSError):
            self.path(key).unlink()

    def _evict(self) -> None:
        """Measure the directory (every process's entries) and, over the bound, delete the least
        recently used entries down to the low-water mark. Called with the lock held."""
        entries: list[tuple[float, int, str]] = []
        stale = time.time() - CACHE_STALE_TEMP_SECONDS
        for shard in os.scandir(self.root):
            if not shard.is_dir():
                continue
            for entry in os.scandir(shard.path):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(CACHE_TEMP_SUFFIX):
                    if stat.st_mtime < stale:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    continue
                entries.append((stat.st_mtime, stat.st_size, entry.path))
        total = sum(size for _, size, _ in entries)
        if total > self.max_bytes:
            for _, size, path in sorted(entries):
                if total <= self.low_water:
                    break
                with contextlib.suppress(FileNotFoundError):  # another process evicted it first
                    os.unlink(path)
                total -= size
        self._bytes = total
        self._written_since_scan = 0


class CachedBlobStore:
    """A remote backend with a `DiskCache` in front: reads go through the cache, writes go to the
    backend first, then to the cache (so the cache never holds what the backend lacks)."""

    def __init__(self, backend: S3BlobStore, cache: DiskCache) -> None:
        self.backend = backend
        self.cache = cache

    def put(self, key: str, data: bytes) -> None:
        self.backend.put(key, data)
        self.cache.write(key, data)

    def get(self, key: str) -> bytes:
        data = self.cache.read(check_key(key))
        if data is None:
            data = self.backend.get(key)
            self.cache.write(key, data)
        return data

    def delete(self, key: str) -> None:
        self.backend.delete(key)
        self.cache.discard(key)

    def listing(self) -> Iterator[tuple[str, float]]:
        return self.backend.listing()

    def sweep(self, keep: set[str], older_than: float) -> int:
        deleted = self.backend.sweep_keys(keep, older_than)
        for key in deleted:
            self.cache.discard(key)
        return len(deleted)

    def close(self) -> None:
        self.backend.close()


@dataclass(frozen=True)
class BlobLocation:
    """A parsed `--blob-url`: a directory, or a bucket with a key prefix and a cache size."""

    directory: Path | None = None
    bucket: str = ""
    prefix: str = ""
    cache_mb: float = DEFAULT_CACHE_MB


def parse_blob_url(url: str) -> BlobLocation:
    """`--blob-url`: a directory path, `file:///absolute/path` or `s3://bucket[/prefix]`, the
    latter with an optional `?cache_mb=N` (the local cache's bound; 0 turns it off). Only the
    form is checked here; the bucket itself when the store opens it."""
    text = url.strip()
    if not text:
        raise BlobStoreError(f"empty blob URL: expected {URL_FORMS}")
    if not re.match(r"[A-Za-z][A-Za-z0-9+.-]*:", text):
        return BlobLocation(directory=Path(text).expanduser())
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "file":
        path = unquote(parts.path)
        if parts.netloc not in ("", "localhost") or not path.startswith("/") or parts.query or parts.fragment:
            raise BlobStoreError(f"invalid file URL {url!r}: expected file:///absolute/path")
        return BlobLocation(directory=Path(path))
    if scheme != "s3":
        raise BlobStoreError(f"unsupported blob URL {url!r}: expected {URL_FORMS}")
    if text[: len("s3://")].lower() != "s3://" or not parts.netloc:
        raise BlobStoreError(f"invalid S3 URL {url!r}: expected s3://bucket[/prefix]")
    if "@" in parts.netloc or ":" in parts.netloc:
        raise BlobStoreError(
            f"invalid S3 URL {url!r}: credentials and endpoints do not go in the URL; set "
            "AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL_S3 (or AWS_ENDPOINT_URL)"
        )
    bucket = parts.netloc
    if not BUCKET_NAME.fullmatch(bucket):
        raise BlobStoreError(
            f"invalid S3 bucket name {bucket!r} in {url!r}: letters, digits, '.', '-' and '_' only "
            "(new buckets: 3 to 63 lower-case letters, digits, '.' and '-')"
        )
    prefix = unquote(parts.path).strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise BlobStoreError(f"invalid key prefix {prefix!r} in {url!r}: use plain names separated by '/'")
    if parts.fragment:
        raise BlobStoreError(f"invalid S3 URL {url!r}: no '#' fragment is allowed")
    return BlobLocation(bucket=bucket, prefix=prefix, cache_mb=cache_size(url, parts.query))


def cache_size(url: str, query: str) -> float:
    """`cache_mb=N` from an S3 URL's query, the only parameter there is."""
    try:
        options = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as error:
        raise BlobStoreError(f"invalid query in {url!r}: expected ?cache_mb=N") from error
    unknown = set(options) - {"cache_mb"}
    if unknown:
        raise BlobStoreError(f"unknown option {sorted(unknown)[0]!r} in {url!r}: the only one is cache_mb")
    if "cache_mb" not in options:
        return DEFAULT_CACHE_MB
    value = options["cache_mb"][-1]
    try:
        size = float(value)
    except ValueError:
        size = -1.0
    if not size >= 0 or size == float("inf"):
        raise BlobStoreError(f"invalid cache_mb={value!r} in {url!r}: expected a number of MiB >= 0")
    return size


def blob_store_for(url: str | None, data_dir: Path) -> BlobStore:
    """The blob store for `--blob-url`: none means `data_dir/blobs` (the single-node default), a
    path or file URL that directory, and an S3 URL the bucket with its disk cache in
    `data_dir/blob-cache`."""
    if url is None or not url.strip():
        return DirectoryBlobStore(data_dir / "blobs")
    location = parse_blob_url(url)
    if location.directory is not None:
        return DirectoryBlobStore(location.directory)
    backend = S3BlobStore(location.bucket, location.prefix)
    if location.cache_mb == 0:
        return backend
    namespace = f"{backend.client.meta.endpoint_url} {backend.url}"
    try:
        cache = DiskCache(data_dir / "blob-cache", namespace, int(location.cache_mb * MIB))
    except BaseException:
        backend.close()
        raise
    return CachedBlobStore(backend, cache)


__all__ = [
    "BlobLocation",
    "BlobStore",
    "BlobStoreError",
    "CachedBlobStore",
    "DirectoryBlobStore",
    "DiskCache",
    "S3BlobStore",
    "blob_store_for",
    "check_key",
    "parse_blob_url",
]
