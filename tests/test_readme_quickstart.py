"""README.md's "Quickstart" section, run as written, so it cannot rot.

The section's commands run in a scratch copy of the checkout: `bash scripts/serve.sh` (the real
script: demo checkpoint, `--no-auth`, `shoal serve`) and the client's `.venv/bin/...` lines, then
the Python snippet with the official client. Only what needs the network is stood in for: the
copy's `scripts/setup.sh` is a no-op and its `.venv/bin` holds shims to this interpreter (`pip`
checks that the pinned client is what this suite runs instead of downloading it). Until the
section is copied into README.md it is read from docs/api.md.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from server_process import MAX_NEW_FRAMES, REPO, free_port

from shoal.server import audio

pytestmark = pytest.mark.slow
README_URL = "http://127.0.0.1:8080"  # where scripts/serve.sh serves without options
FENCE = re.compile(r"^```(\w*)\s*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)


def quickstart_section() -> str:
    """The text under the first "Quickstart" heading, up to the next heading of its level."""
    for document in (REPO / "README.md", REPO / "docs" / "api.md"):
        text = document.read_text()
        outside_code = FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)  # same offsets
        heading = re.search(r"^(#+) Quickstart\b.*$", outside_code, re.MULTILINE)
        if heading is None:
            continue
        level = len(heading.group(1))
        following = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(outside_code, heading.end())
        return text[heading.end() : following.start() if following else len(text)]
    raise AssertionError("no 'Quickstart' section in README.md or docs/api.md")


def code_blocks(section: str, language: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(section) if m.group(1) == language]


def shell_lines(blocks: list[str]) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def write_executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


PIP_SHIM = """#!{python}
# Quickstart test stand-in for pip: the suite already runs the client, so check the pin instead.
import importlib.metadata, sys
args = sys.argv[1:]
assert args and args[0] == "install", args
for requirement in (a for a in args[1:] if not a.startswith("-")):
    name, _, version = requirement.partition("==")
    installed = importlib.metadata.version(name)
    assert not version or installed == version, f"README pins {{requirement}}, the suite runs {{installed}}"
    print(f"Requirement already satisfied: {{name}}=={{installed}}")
"""


def scratch_checkout(root: Path) -> Path:
    """scripts/serve.sh beside a no-op setup.sh and a `.venv` of shims to this interpreter."""
    checkout = root / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "serve.sh", checkout / "scripts" / "serve.sh")
    write_executable(checkout / "scripts" / "setup.sh", "#!/usr/bin/env bash\nexit 0\n")
    bin_dir = checkout / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    write_executable(bin_dir / "shoal", f'#!/bin/sh\nexec "{sys.executable}" -m shoal.cli "$@"\n')
    write_executable(bin_dir / "python", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    write_executable(bin_dir / "pip", PIP_SHIM.format(python=sys.executable))
    return checkout


def wait_ready(process: subprocess.Popen, url: str, log: Path, timeout: float = 300.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"scripts/serve.sh exited {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            response = httpx.get(f"{url}/v1/health", timeout=2)
            if response.status_code == 200:
                return response.json()
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    raise AssertionError(f"scripts/serve.sh not serving after {timeout:.0f} s:\n{log.read_text()[-4000:]}")


def test_readme_quickstart_runs_as_written(tmp_path):
    section = quickstart_section()
    commands = shell_lines(code_blocks(section, "bash"))
    assert "bash scripts/serve.sh" in commands, commands
    client_commands = [c for c in commands if c.startswith(".venv/bin/")]
    assert any("pip install" in c and "fish-audio-sdk" in c for c in client_commands), commands
    (snippet,) = code_blocks(section, "python")
    assert README_URL in snippet and "fishaudio" in snippet

    checkout = scratch_checkout(tmp_path)
    port = free_port()
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "SHOAL_MAX_NEW_FRAMES": str(MAX_NEW_FRAMES),  # random weights would speak for 1024 frames
    }
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        server = subprocess.Popen(
            # 8080 may be taken on a shared machine: the port as a user would change it
            ["bash", "scripts/serve.sh", "--port", str(port)],
            cwd=checkout,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        health = wait_ready(server, url, log_path)
        assert health["status"] == "ok"
        assert (checkout / "demo" / "config.json").exists(), "serve.sh should write the demo checkpoint"
        assert (checkout / "demo" / "data").is_dir(), "the demo's data should stay in the checkout"
        assert "authentication is OFF" in log_path.read_text()

        first_line = snippet.lstrip().splitlines()[0]
        name = re.fullmatch(r"#\s*(\S+\.py)\s*", first_line)
        script = checkout / (name.group(1) if name else "quickstart.py")
        script.write_text(snippet.replace(README_URL, url))
        before = set(checkout.iterdir())
        if not any(script.name in c for c in client_commands):
            client_commands.append(f".venv/bin/python {script.name}")
        for command in client_commands:
            result = subprocess.run(
                command, shell=True, cwd=checkout, env=env, capture_output=True, text=True, timeout=300
            )
            assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"
        written = [p for p in set(checkout.iterdir()) - before if p.suffix in (".mp3", ".wav", ".opus")]
        assert written, "the snippet should save the audio it received"
        for path in written:
            assert len(audio.decode_audio(path.read_bytes(), silence_peak_dbfs=-200)) > 0, path
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
