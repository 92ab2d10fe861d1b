#!/usr/bin/env bash
# Set everything up and run the test suite (lint + pytest). This is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
. .venv/bin/activate
# Without a GPU, Triton kernels run in the interpreter (small shapes only).
if ! python -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
fi
ruff check .
ruff format --check . || { echo "ruff format: run 'ruff format .'"; exit 1; }
# One torch/OpenMP thread per process: two workers with a thread per core each oversubscribe the
# cores (OpenMP threads spin while they wait), which made the CPU suite about a third slower.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The suite starts a hundred-odd Python processes (servers, engines, CLIs): let the first to import
# a module write its bytecode for all the others (setup.sh compiles nothing ahead), whatever the
# environment says.
unset PYTHONDONTWRITEBYTECODE
# `--all` also runs the `cpu_heavy` tests (tests/conftest.py: interpreter runs of what the GPU
# tests cover, several minutes on two cores); by default they are left out.
MARKERS="not gpu and not cpu_heavy"
if [ "${1:-}" = "--all" ]; then
  MARKERS="not gpu"
  shift
fi
# Two workers (CI's machine has two cores), tests handed out one by one as workers free up;
# the slowest fifteen are listed at the end so they stay visible.
python -m pytest -q -n "${SHOAL_TEST_WORKERS:-2}" --dist worksteal --durations=15 -m "$MARKERS" "$@"
