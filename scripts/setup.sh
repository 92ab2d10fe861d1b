#!/usr/bin/env bash
# Create .venv and install Shoal into it. On a machine without an NVIDIA GPU the CPU build of
# torch is pinned first (so pip never pulls the multi-GB CUDA build); with a GPU, pip takes the
# normal PyTorch wheel from PyPI. Usage: scripts/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install -q "torch==2.13.0" "triton==3.6.0"
fi
if [ "${1:-}" = "--test" ]; then
  python -m pip install -q -e ".[test]"
  # The S1-era reference implementation, used only as a parity oracle in the tests.
  python -m pip install -q --no-deps "fish-speech==0.1.0"
else
  python -m pip install -q -e .
fi
