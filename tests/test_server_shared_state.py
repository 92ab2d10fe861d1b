"""What the API processes of one server share, each piece across real processes: the per-key
stream counts (`limits.SharedStreamLimiter`), the job runner's role (`jobs.JobLeadership`), and
`shoal serve --api-workers`' default."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from shoal.server import cli
from shoal.server.auth import Principal
from shoal.server.errors import ApiError
from shoal.server.jobs import JobLeadership
from shoal.server.limits import SharedStreamLimiter

TWO_STREAMS = Principal(tenant="t", key_id="key_two", max_streams=2)
DEFAULT_LIMIT = Principal(tenant="t", key_id="key_default")


class Holder:
    """Another process that runs `code` (with `directory` bound), says "ready", then waits."""

    def __init__(self, directory: Path, code: str) -> None:
        program = textwrap.dedent(f"""
            import sys, time
            from pathlib import Path
            from shoal.server.auth import Principal
            from shoal.server.jobs import JobLeadership
            from shoal.server.limits import SharedStreamLimiter
            directory = Path({str(directory)!r})
            {code}
            print("ready", flush=True)
            time.sleep(600)
        """)
        self.process = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
        assert self.process.stdout.readline().strip() == "ready"

    def kill(self) -> None:
        os.kill(self.process.pid, signal.SIGKILL)  # no cleanup: only the kernel frees its locks
        self.process.wait()


@pytest.fixture
def holders():
    started: list[Holder] = []
    yield started
    for holder in started:
        if holder.process.poll() is None:
            holder.kill()


def test_stream_slots_hold_across_processes_and_free_when_one_dies(tmp_path, holders):
    limiter = SharedStreamLimiter(tmp_path, default_limit=3)
    limiter.acquire(TWO_STREAMS)
    other = Holder(
        tmp_path, "SharedStreamLimiter(directory, 3).acquire(Principal('t', 'key_two', max_streams=2))"
    )
    holders.append(other)
    with pytest.raises(ApiError) as refused:
        limiter.acquire(TWO_STREAMS)
    assert refused.value.status == 429 and "limit 2" in refused.value.message
    for _ in range(3):  # another key, the server-wide default
        limiter.acquire(DEFAULT_LIMIT)
    with pytest.raises(ApiError):
        limiter.acquire(DEFAULT_LIMIT)
    assert limiter.total == 5  # 2 + 3, in two processes
    other.kill()  # a crashed API process: its slot is free without a release
    assert limiter.total == 4
    limiter.acquire(TWO_STREAMS)
    limiter.release(TWO_STREAMS)
    limiter.release(TWO_STREAMS)
    assert limiter.total == 3
    limiter.acquire(TWO_STREAMS)


def test_a_lowered_limit_counts_the_streams_already_open(tmp_path):
    """Two streams are open (under a limit of 3, in the second process): with the key's limit
    lowered to 1, no new stream until both have ended."""
    first, second = SharedStreamLimiter(tmp_path, 16), SharedStreamLimiter(tmp_path, 16)  # two processes'
    three = Principal(tenant="t", key_id="key_x", max_streams=3)
    first.acquire(three)
    second.acquire(three)
    second.acquire(three)
    first.release(three)
    one = Principal(tenant="t", key_id="key_x", max_streams=1)
    for _ in range(2):
        with pytest.raises(ApiError):
            first.acquire(one)
        second.release(one)
    first.acquire(one)
    assert first.total == 1


def test_one_process_runs_the_jobs_until_it_dies(tmp_path, holders):
    lock = tmp_path / "jobs.lock"
    runner = Holder(tmp_path, "assert JobLeadership(directory / 'jobs.lock').try_acquire()")
    holders.append(runner)
    here = JobLeadership(lock)
    assert not here.try_acquire() and not here.held
    runner.kill()
    assert here.try_acquire() and here.held
    assert not JobLeadership(lock).try_acquire()  # excluded in this process too (another open file)
    here.release()
    assert JobLeadership(lock).try_acquire()
    assert JobLeadership(None).held  # no lock file: a server of one process always runs its jobs


def parse_serve(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(["--checkpoint", "x", *argv])


def test_api_workers_default_splits_on_a_gpu_only(monkeypatch):
    monkeypatch.delenv("SHOAL_API_WORKERS", raising=False)
    assert cli.api_workers(parse_serve(["--device", "cpu"])) == 0
    assert cli.api_workers(parse_serve(["--device", "cuda"])) == cli.default_api_workers(cli.usable_cores())
    assert cli.api_workers(parse_serve(["--device", "cuda", "--api-workers", "0"])) == 0
    assert cli.api_workers(parse_serve(["--device", "cpu", "--api-workers", "3"])) == 3
    monkeypatch.setenv("SHOAL_API_WORKERS", "2")
    assert cli.api_workers(parse_serve(["--device", "cpu"])) == 2
    with pytest.raises(SystemExit):
        parse_serve(["--api-workers", "-1"])


def test_default_api_workers_grow_with_the_cores_and_the_engines():
    """Half the cores (format encoding needs several per GPU), never fewer than the old
    min(4, cores), at most 8 per engine."""
    assert [cli.default_api_workers(cores) for cores in (1, 2, 4, 8, 16, 32, 128)] == [1, 2, 4, 4, 8, 8, 8]
    assert cli.default_api_workers(128, engines=8) == 64
    assert cli.default_api_workers(16, engines=2) == 8


def test_a_stream_costs_one_count_file_per_process_whatever_the_limit(tmp_path, holders):
    """The files of a key are its guard and one count per process holding its streams, so an
    acquire reads a few files, not one per allowed stream; a process whose streams all ended
    leaves none."""
    many = Principal(tenant="t", key_id="key_many", max_streams=1024)
    limiter = SharedStreamLimiter(tmp_path, default_limit=16)
    for _ in range(3):
        limiter.acquire(many)
    holders.append(
        Holder(
            tmp_path,
            "SharedStreamLimiter(directory, 16).acquire(Principal('t', 'key_many', max_streams=1024))",
        )
    )
    files = set(os.listdir(tmp_path / "key_many"))
    assert len(files) == 3 and {".guard", limiter.owner} < files and limiter.total == 4
    for _ in range(3):
        limiter.release(many)
    assert set(os.listdir(tmp_path / "key_many")) == files - {limiter.owner} and limiter.total == 1
