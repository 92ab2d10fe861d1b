"""Per-key stream limits: how many synthesis streams (`/v1/tts`, OpenAI speech, live sessions)
one API key may hold at once before a new one gets 429.

`StreamLimiter` counts in memory, for a server of one process. `SharedStreamLimiter` counts for
every API process of one server (`shoal serve --api-workers N`) in files: each process keeps its
count of a key's streams in a file it holds an exclusive `flock` on, and the kernel drops every
lock of a process that dies, so the streams of a crashed worker stop counting with no lease to
expire.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from shoal.server.auth import Principal
from shoal.server.errors import ApiError


def too_many_streams(limit: int) -> ApiError:
    return ApiError(429, f"too many concurrent streams for this key (limit {limit})")


class Limiter(Protocol):
    """What the routes call: `acquire` before a stream starts (raises the 429), `release` once
    it ended, `total` for /v1/health and /metrics."""

    def acquire(self, principal: Principal) -> None: ...

    def release(self, principal: Principal) -> None: ...

    @property
    def total(self) -> int: ...


class StreamLimiter:
    """Counts open synthesis streams per key in this process; over the limit a new one gets 429."""

    def __init__(self, default_limit: int) -> None:
        self.default_limit = default_limit
        self.active: dict[str, int] = defaultdict(int)

    def acquire(self, principal: Principal) -> None:
        limit = principal.max_streams or self.default_limit
        if self.active[principal.key_id] >= limit:
            raise too_many_streams(limit)
        self.active[principal.key_id] += 1

    def release(self, principal: Principal) -> None:
        self.active[principal.key_id] = max(0, self.active[principal.key_id] - 1)
        if self.active[principal.key_id] == 0:
            del self.active[principal.key_id]

    @property
    def total(self) -> int:
        return sum(list(self.active.values()))  # a copy: /metrics reads it from another thread


SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
GUARD = ".guard"
COUNT_WIDTH = 20  # bytes of a count file: a right-aligned decimal, rewritten in place


class SharedStreamLimiter:
    """Stream counts shared by the API processes of one server, as files in `directory` (local,
    per server run). Each key has a folder; in it each process (each limiter) that holds streams
    of the key keeps one count file, exclusively `flock`ed for as long as it exists, and the
    kernel drops the lock of a process that dies: a count file nobody holds is a crashed
    process's, and its streams no longer count.

    `acquire` sums the live count files of the key while holding the key's guard file, so two
    processes never both take the last stream, then raises its own count. An acquire costs a few
    system calls per API process, whatever the limit. Each call opens its own guard file: flock
    excludes other open files, in this process too."""

    def __init__(self, directory: Path, default_limit: int) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.default_limit = default_limit
        self.owner = f"{os.getpid()}-{secrets.token_hex(4)}"  # this limiter's count file name
        self._mine: dict[str, tuple[int, int]] = {}  # key folder -> (its count file's fd, count)

    def _name(self, key_id: str) -> str:
        if SAFE_NAME.fullmatch(key_id):
            return key_id
        return "k" + hashlib.sha256(key_id.encode()).hexdigest()[:32]

    @contextlib.contextmanager
    def _guard(self, name: str) -> Iterator[Path]:
        folder = self.directory / name
        folder.mkdir(exist_ok=True)
        fd = os.open(folder / GUARD, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield folder
        finally:
            os.close(fd)  # drops the lock

    def _others(self, folder: Path) -> int:
        """Streams the other live limiters hold in this key's folder (guard held); the count
        files of dead ones are removed."""
        count = 0
        for entry in os.scandir(folder):
            if entry.name == GUARD or entry.name == self.owner:
                continue
            try:
                fd = os.open(entry.path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError as error:
                    if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise
                    count += int(os.pread(fd, COUNT_WIDTH, 0) or b"0")  # held: its owner lives
                else:
                    os.unlink(entry.path)  # nobody holds it: its process died
            finally:
                os.close(fd)
        return count

    def _my_count(self, name: str) -> int:
        """This limiter's streams of a key (its folder name)."""
        return self._mine.get(name, (None, 0))[1]

    def _write_mine(self, folder: Path, name: str, count: int) -> None:
        """Set this limiter's count for the key (guard held); at 0 its file goes."""
        fd = self._mine.pop(name, (None, 0))[0]
        if count == 0:
            if fd is not None:
                os.unlink(folder / self.owner)
                os.close(fd)
            return
        if fd is None:
            fd = os.open(folder / self.owner, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.pwrite(fd, str(count).rjust(COUNT_WIDTH).encode(), 0)
        self._mine[name] = (fd, count)

    def acquire(self, principal: Principal) -> None:
        limit = principal.max_streams or self.default_limit
        name = self._name(principal.key_id)
        with self._guard(name) as folder:
            mine = self._my_count(name)
            # A lowered limit counts the streams opened under the old one until they end.
            if mine + self._others(folder) >= limit:
                raise too_many_streams(limit)
            self._write_mine(folder, name, mine + 1)

    def release(self, principal: Principal) -> None:
        name = self._name(principal.key_id)
        if name not in self._mine:
            return
        with self._guard(name) as folder:
            self._write_mine(folder, name, max(0, self._my_count(name) - 1))

    def held(self, name: str) -> int:
        """Streams of one key (its folder name) held by any process."""
        with self._guard(name) as folder:
            return self._my_count(name) + self._others(folder)

    @property
    def total(self) -> int:
        """Streams open in every process of the server."""
        return sum(self.held(entry.name) for entry in os.scandir(self.directory) if entry.is_dir())


__all__ = ["Limiter", "SharedStreamLimiter", "StreamLimiter", "too_many_streams"]
