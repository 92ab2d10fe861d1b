"""Tests of `scripts/`: a script loaded as a module, and run in a process without the CPU
interpreter (the sm_90 builds they inspect are compiled there)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """`scripts/<name>.py` as a module (registered under `name`; scripts/ goes on the path, as
    for a script run directly, so that one script can import another)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_compiled(name: str, *args: str) -> subprocess.CompletedProcess:
    """`python scripts/<name>.py args` without TRITON_INTERPRET, so Triton compiles for real."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    command = [sys.executable, str(SCRIPTS / f"{name}.py"), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
