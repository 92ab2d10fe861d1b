"""Start a real `shoal serve` subprocess on 127.0.0.1 (a free port, the demo checkpoint, a fresh
data directory and three API keys) for the client-compatibility tests."""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
MAX_BODY_MB = 4
MAX_UPLOAD_MB = 2
MAX_NEW_FRAMES = 24  # keeps every synthesis short on a CPU
# The engine refuses batch-priority work outright: its real overload path (503) on demand.
BATCH_QUEUE_LIMIT = 0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


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
    output = shoal("keys", "--data-dir", str(data_dir), "create", "--tenant", tenant, *extra).stdout
    match = re.search(r"^key:\s+(\S+)$", output, re.MULTILINE)
    assert match, output
    return match.group(1)


def demo_checkpoint(root: Path) -> Path:
    """The demo checkpoint, written once per machine (cached beside the test data)."""
    directory = Path(os.environ.get("SHOAL_TEST_DEMO_DIR", root / "demo-checkpoint"))
    if not (directory / "config.json").exists():
        shoal("demo-checkpoint", str(directory), timeout=600)
    return directory


@dataclass
class ShoalServer:
    url: str
    process: subprocess.Popen
    key_a: str
    key_b: str
    key_limited: str
    key_batch: str  # a key whose requests run at batch priority
    max_body_bytes: int = MAX_BODY_MB * 1024 * 1024
    max_upload_bytes: int = MAX_UPLOAD_MB * 1024 * 1024

    @classmethod
    @contextmanager
    def start(cls, workdir: Path, *extra_args: str):
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
        command += extra_args
        log = (workdir / "server.log").open("w")
        process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        server = cls(f"http://127.0.0.1:{port}", process, *keys)
        try:
            server.wait_ready(workdir / "server.log")
            yield server
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
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
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"shoal serve not ready after {timeout:.0f} s:\n{log_path.read_text()[-4000:]}")
