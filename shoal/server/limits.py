"""Per-key stream limits: how many synthesis streams (`/v1/tts`, OpenAI speech, live sessions)
one API key may hold at once before a new one gets 429.

`StreamLimiter` counts in memory, for a server of one process. `SharedStreamLimiter` counts for
every API process of one server (`shoal serve --api-workers N`) with lock files: a stream holds
an exclusive `flock` on one slot file of its key, and the kernel drops every lock of a process
that dies, so the slots of a crashed worker free themselves with no lease to expire.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import os
import re
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
GUARD_SUFFIX = ".guard"


class SharedStreamLimiter:
    """Stream slots shared by the API processes of one server, as files in `directory` (local,
    per server run): slot i of a key is `<key>.<i>`, held by an exclusive flock on its own open
    file for as long as its stream lasts. Slot files are created in order and never removed.

    `acquire` counts the held slots of the key and takes a free one while holding the key's
    guard file (`<key>.guard`), so two processes never both take the last slot; `total` counts
    under the same guard, so its probing never makes `acquire` see a free slot as held. Each
    call opens its own guard file: flock excludes other open files, in this process too."""

    def __init__(self, directory: Path, default_limit: int) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.default_limit = default_limit
        self._held: dict[str, list[int]] = defaultdict(list)  # key -> this process's slot files

    def _name(self, key_id: str) -> str:
        if SAFE_NAME.fullmatch(key_id):
            return key_id
        return "k" + hashlib.sha256(key_id.encode()).hexdigest()[:32]

    @contextlib.contextmanager
    def _guard(self, name: str) -> Iterator[None]:
        fd = os.open(self.directory / f"{name}{GUARD_SUFFIX}", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # drops the lock

    def _open_slot(self, name: str, index: int, create: bool) -> int | None:
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            return os.open(self.directory / f"{name}.{index}", flags, 0o600)
        except FileNotFoundError:
            return None

    @staticmethod
    def _try_lock(fd: int, mode: int) -> bool:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return False
            raise
        return True

    def acquire(self, principal: Principal) -> None:
        limit = principal.max_streams or self.default_limit
        name = self._name(principal.key_id)
        taken: int | None = None
        held = 0
        with self._guard(name):
            # Slots past the limit exist when a key's limit was lowered: they count while held.
            for index in itertools.count():
                fd = self._open_slot(name, index, create=index < limit)
                if fd is None:
                    break
                if taken is None and index < limit and self._try_lock(fd, fcntl.LOCK_EX):
                    taken = fd
                    continue
                if not self._try_lock(fd, fcntl.LOCK_SH):
                    held += 1
                os.close(fd)
            if taken is not None and held >= limit:
                os.close(taken)
                taken = None
        if taken is None:
            raise too_many_streams(limit)
        self._held[name].append(taken)

    def release(self, principal: Principal) -> None:
        """Free one of this process's slots of the key (they are interchangeable)."""
        name = self._name(principal.key_id)
        slots = self._held.get(name)
        if slots:
            os.close(slots.pop())
            if not slots:
                del self._held[name]

    def held(self, name: str) -> int:
        """Slots of one key (its file name) held by any process."""
        count = 0
        with self._guard(name):
            for index in itertools.count():
                fd = self._open_slot(name, index, create=False)
                if fd is None:
                    break
                if not self._try_lock(fd, fcntl.LOCK_SH):
                    count += 1
                os.close(fd)
        return count

    @property
    def total(self) -> int:
        """Streams open in every process of the server."""
        names = {
            entry.name.removesuffix(GUARD_SUFFIX)
            for entry in os.scandir(self.directory)
            if entry.name.endswith(GUARD_SUFFIX)
        }
        return sum(self.held(name) for name in names)


__all__ = ["Limiter", "SharedStreamLimiter", "StreamLimiter", "too_many_streams"]
