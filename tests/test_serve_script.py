"""scripts/serve.sh passes options through with and without a checkpoint argument, and sets up
once: the `shoal` it starts is a shim here that prints what it was given."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SHOAL_SHIM = """#!/bin/sh
if [ "$1" = demo-checkpoint ]; then mkdir -p "$2" && echo '{}' > "$2/config.json"; echo wrote demo; exit 0; fi
echo "data_dir=${SHOAL_DATA_DIR:-}"
echo "args=$*"
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copy2(REPO / "scripts" / "serve.sh", root / "scripts" / "serve.sh")
    (root / "scripts" / "setup.sh").write_text("#!/usr/bin/env bash\nexit 0\n")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    shim = bin_dir / "shoal"
    shim.write_text(SHOAL_SHIM)
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return root


def serve(checkout: Path, *args: str, env: dict[str, str] | None = None) -> list[str]:
    environment = {"PATH": "/usr/bin:/bin"} | (env or {})
    result = subprocess.run(
        ["bash", "scripts/serve.sh", *args], cwd=checkout, capture_output=True, text=True, env=environment
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_options_without_a_checkpoint_serve_the_demo(checkout: Path) -> None:
    lines = serve(checkout, "--port", "18080")
    assert lines[0] == "wrote demo"
    assert lines[1:] == ["data_dir=demo/data", "args=serve --checkpoint demo --no-auth --port 18080"]
    # the second start reuses the demo checkpoint
    assert serve(checkout, "--port", "18080") == lines[1:]


def test_no_arguments_serve_the_demo_and_the_data_dir_can_be_moved(checkout: Path) -> None:
    assert serve(checkout)[1:] == ["data_dir=demo/data", "args=serve --checkpoint demo --no-auth"]
    assert serve(checkout, env={"SHOAL_DATA_DIR": "/srv/shoal"})[0] == "data_dir=/srv/shoal"


def test_a_checkpoint_then_options(checkout: Path) -> None:
    lines = serve(checkout, "./s2-pro", "--port", "9000", "--weight-format", "fp8")
    assert lines == ["data_dir=", "args=serve --checkpoint ./s2-pro --port 9000 --weight-format fp8"]
    assert not (checkout / "demo").exists()
