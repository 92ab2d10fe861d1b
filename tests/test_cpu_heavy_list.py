"""The `cpu_heavy` list in conftest.py names tests that exist: a renamed test or parameter would
otherwise leave the list silently, and the heavy test would run in the default suite again."""

from __future__ import annotations

import subprocess
import sys

from conftest import CPU_HEAVY, GOLDEN


def test_every_cpu_heavy_test_exists():
    modules = sorted({nodeid.split("::")[0] for nodeid in CPU_HEAVY})
    collected = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-m",
            "cpu_heavy",
            "-p",
            "no:cacheprovider",
            *modules,
        ],
        cwd=GOLDEN.parents[1],
        capture_output=True,
        text=True,
        check=False,
    )
    ids = {line.strip() for line in collected.stdout.splitlines() if "::" in line}
    assert ids == CPU_HEAVY, (sorted(CPU_HEAVY - ids), collected.stdout[-2000:], collected.stderr[-2000:])
