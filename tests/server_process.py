"""Start a real `shoal serve` subprocess on 127.0.0.1 (a free port, the demo checkpoint, a fresh
data directory and three API keys) for the client-compatibility tests: in one process
(`api_workers=0`) or split into an engine process and API processes (`api_workers=N`), whose
process ids the helpers find under /proc (to kill one). `app_in_thread` serves an app built in
the test's own process instead (an engine the test configures or inspects)."""

from __future__ import annotations

import argparse
import io
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from shoal.engine.compile_cache import CACHE_FOLDERS
from shoal.server import audio, keys_cli

REPO = Path(__file__).resolve().parents[1]
MAX_BODY_MB = 4
MAX_UPLOAD_MB = 2
# Per-engine metric names, exported only beside several engines (`shoal serve --gpus`;
# tests/test_data_parallel.py checks the documented ones there).
PER_ENGINE_METRIC = re.compile(r"shoal_engine_(?!up$)")
MAX_NEW_FRAMES = 24  # keeps every synthesis short on a CPU
# The engine refuses batch-priority work outright: its real overload path (503) on demand.
BATCH_QUEUE_LIMIT = 0


def wav_clip(seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A 300 Hz tone as a wav file: reference audio for the voices the tests create."""
    t = np.arange(int(seconds * rate)) / rate
    tone = (0.3 * np.sin(2 * np.pi * 300 * t)).astype(np.float32)
    return audio.encode_audio(tone, "wav", input_sample_rate=rate, sample_rate=rate)


def create_voice(server: ShoalServer, title: str = "agent", text: str = "a reference") -> str:
    """A voice stored on `server` through `POST /model` (key A); its id."""
    files = [("voices", ("clip.wav", wav_clip(), "audio/wav"))]
    headers = {"Authorization": f"Bearer {server.key_a}"}
    response = httpx.post(
        f"{server.url}/model", data={"title": title, "texts": text}, files=files, headers=headers
    )
    assert response.status_code == 201, response.text
    return response.json()["_id"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def app_in_thread(app) -> Iterator[str]:
    """An ASGI app served by uvicorn on a free port in a thread of this process: its base URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{server.config.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def shoal(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shoal.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        **kwargs,
    )


def create_key(data_dir: Path, tenant: str, *extra: str) -> str:
    """`shoal keys create` with these options, run in this process (a server start makes four;
    test_server_store.py runs the CLI as its own process): the new key. Thread-safe: what it
    prints goes to a buffer of its own, not through sys.stdout."""
    parser = argparse.ArgumentParser()
    keys_cli.add_arguments(parser)
    args = parser.parse_args(["--data-dir", str(data_dir), "create", "--tenant", tenant, *extra])
    output = io.StringIO()
    assert keys_cli.run(args, output) == 0, output.getvalue()
    match = re.search(r"^key:\s+(\S+)$", output.getvalue(), re.MULTILINE)
    assert match, output.getvalue()
    return match.group(1)


def demo_checkpoint(root: Path) -> Path:
    """The demo checkpoint, written once per machine (cached beside the test data)."""
    directory = Path(os.environ.get("SHOAL_TEST_DEMO_DIR", root / "demo-checkpoint"))
    if not (directory / "config.json").exists():
        shoal("demo-checkpoint", str(directory), timeout=600)
    return directory


def child_processes(parent: int) -> dict[int, str]:
    """pid -> command line of the live children of `parent` (Linux /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent and fields[0] != "Z":  # ppid; not a zombie
                command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                children[int(stat.parent.name)] = command
        except (OSError, IndexError, ValueError):
            continue  # a process that ended while being read
    return children


@dataclass
class ShoalServer:
    url: str
    process: subprocess.Popen
    key_a: str
    key_b: str
    key_limited: str
    key_batch: str  # a key whose requests run at batch priority
    api_workers: int = 0  # 0: one process; N: an engine process and N API processes
    data_dir: Path | None = None
    max_body_bytes: int = MAX_BODY_MB * 1024 * 1024
    max_upload_bytes: int = MAX_UPLOAD_MB * 1024 * 1024

    @classmethod
    @contextmanager
    def start(cls, workdir: Path, *extra_args: str, api_workers: int = 0):
        data_dir = workdir / "data"
        keys = [create_key(data_dir, "tenant-a"), create_key(data_dir, "tenant-b")]
        keys.append(create_key(data_dir, "tenant-c", "--max-streams", "1"))
        keys.append(create_key(data_dir, "tenant-a", "--priority", "batch"))
        port = free_port()
        # SHOAL_TEST_SERVE replaces `shoal serve ...` (e.g. to point the suite at another build).
        command = shlex.split(os.environ.get("SHOAL_TEST_SERVE", "")) or [
            sys.executable, "-m", "shoal.cli", "serve", "--checkpoint", str(demo_checkpoint(workdir.parent)),
        ]  # fmt: skip
        command += ["--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir)]
        command += ["--max-new-frames", str(MAX_NEW_FRAMES), "--max-body-mb", str(MAX_BODY_MB)]
        command += ["--max-upload-mb", str(MAX_UPLOAD_MB), "--queue-limit", f"batch={BATCH_QUEUE_LIMIT}"]
        command += ["--api-workers", str(api_workers), *extra_args]
        log = (workdir / "server.log").open("w")
        # As a user's shell starts it: not with the compiler cache locations that torch exports
        # into this test process once it has compiled something (they would win over the data
        # directory's, `engine/compile_cache.py`).
        environment = {k: v for k, v in os.environ.items() if k not in CACHE_FOLDERS}
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=environment)
        server = cls(f"http://127.0.0.1:{port}", process, *keys, api_workers=api_workers, data_dir=data_dir)
        try:
            server.wait_ready(workdir / "server.log")
            yield server
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                for child in child_processes(process.pid):  # API processes outlive a killed parent
                    os.kill(child, signal.SIGKILL)
                process.kill()
                process.wait()
            log.close()

    def wait_ready(self, log_path: Path, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"shoal serve exited:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/v1/health", timeout=2).status_code == 200:
                    if self.api_workers < 2 or len(self.api_pids()) >= self.api_workers:
                        return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"shoal serve not ready after {timeout:.0f} s:\n{log_path.read_text()[-4000:]}")

    def wait_healthy(self, timeout: float = 120.0) -> dict:
        """/v1/health's answer once it is 200 (after an engine restart, say) and the engine idle."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = httpx.get(f"{self.url}/v1/health", timeout=5)
            health = response.json()
            if response.status_code == 200 and health["running"] == health["active_streams"] == 0:
                if health["pages_used"] == health["prefix_cache_pages"]:
                    return health
            time.sleep(0.1)
        raise AssertionError(f"the server is not healthy and idle after {timeout:.0f} s: {health}")

    def job_runner_pid(self) -> int | None:
        """The process holding the data directory's jobs.lock (/proc/locks), if any."""
        assert self.data_dir is not None
        inode = (self.data_dir / "jobs.lock").stat().st_ino
        for line in Path("/proc/locks").read_text().splitlines():
            fields = line.split()
            if len(fields) > 5 and fields[1] == "FLOCK" and fields[5].rsplit(":", 1)[-1] == str(inode):
                return int(fields[4])
        return None

    def engine_pid(self) -> int:
        """The engine process of a server started with api_workers >= 1."""
        pids = self.engine_pids()
        assert len(pids) == 1, child_processes(self.process.pid)
        return pids[0]

    def engine_pids(self) -> list[int]:
        """The engine processes (several with --data-parallel), in no particular order."""
        children = child_processes(self.process.pid).items()
        return [pid for pid, command in children if "shoal.engine.process" in command]

    def api_pids(self) -> set[int]:
        """The API processes uvicorn runs for a server started with api_workers >= 2 (with 1, the
        main process serves the API itself)."""
        children = child_processes(self.process.pid).items()
        return {pid for pid, command in children if "spawn_main" in command}

    def connections_to_each_api_process(self, attempts: int = 200) -> dict[int, httpx.Client]:
        """One kept-alive connection per API process (pid -> client): the kernel hands each new
        connection to one process, and a connection stays with it."""
        clients: dict[int, httpx.Client] = {}
        for _ in range(attempts):
            if len(clients) == max(1, self.api_workers):
                return clients
            client = httpx.Client(base_url=self.url, timeout=60)
            pid = client.get("/v1/health").json()["api_process"]
            if pid in clients:
                client.close()
            else:
                clients[pid] = client
        for client in clients.values():
            client.close()
        raise AssertionError(
            f"reached {len(clients)} of {self.api_workers} API processes in {attempts} connections"
        )
