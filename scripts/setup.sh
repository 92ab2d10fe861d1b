#!/usr/bin/env bash
# Create .venv and install Shoal into it. On a machine without an NVIDIA GPU the CPU build of
# torch is pinned first (so pip never pulls the multi-GB CUDA build); with a GPU, pip takes the
# normal PyTorch wheel from PyPI. Usage: scripts/setup.sh [--test]
# A second run with the same pyproject.toml and setup script installs nothing (a stamp in .venv
# records what was installed); delete .venv/.shoal-setup-* to force a reinstall.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
MODE=${1:-serve}
[ "$MODE" = "--test" ] && MODE=test
STAMP=".venv/.shoal-setup-$MODE"

# The web page tests drive Debian's Chromium headless through Playwright, which never downloads a
# browser of its own here. Installed where apt-get is usable (root on Debian or Ubuntu); anywhere
# else the browser tests fail saying how to get one (SHOAL_SKIP_BROWSER_TESTS=1 skips them).
ensure_chromium() {
  if { command -v chromium || command -v chromium-browser; } >/dev/null 2>&1; then
    return 0
  fi
  if [ "${SHOAL_SKIP_BROWSER_TESTS:-}" = "1" ]; then
    return 0
  fi
  if ! command -v apt-get >/dev/null 2>&1 || [ "$(id -u)" != "0" ]; then
    echo "chromium is missing and apt-get is not usable: the browser tests will fail" >&2
    return 0
  fi
  echo "installing Debian's chromium for the browser tests (about half a minute)" >&2
  local install="apt-get install -y -q --no-install-recommends chromium"
  # The package lists may be stale or missing on a fresh machine: refresh them and try again.
  DEBIAN_FRONTEND=noninteractive $install >/dev/null 2>&1 ||
    { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive $install >/dev/null; } ||
    echo "could not install chromium: the browser tests will fail" >&2
}
# In the background, beside pip; waited for before this script ends.
chromium_pid=
if [ "$MODE" = "test" ]; then
  ensure_chromium &
  chromium_pid=$!
fi
wait_for_chromium() {
  if [ -n "$chromium_pid" ]; then wait "$chromium_pid" || true; fi
}

FINGERPRINT=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$FINGERPRINT" ]; then
  wait_for_chromium
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
echo "setting up .venv ($MODE); later runs skip this while pyproject.toml is unchanged" >&2
# uv resolves and installs in parallel, much faster than pip for the test extras; the
# CPU torch is installed by pip first, which finds the machine's local wheel where there is one.
python -m pip install -q --no-compile uv
if ! command -v nvidia-smi >/dev/null 2>&1; then
  python -m pip install -q --no-compile "torch==2.13.0" "triton==3.6.0"
fi
uv_install() { uv pip install -q --python .venv/bin/python "$@"; }
if [ "$MODE" = "test" ]; then
  uv_install -e ".[test]"
  # The S1-era reference implementation, used only as a parity oracle in the tests.
  uv_install --no-deps "fish-speech==0.1.0"
else
  uv_install -e .
fi
# Nothing is byte-compiled here: the first import of each module writes its .pyc, where compiling
# all of site-packages would spend most of the time on files nothing imports (torch's, say).
# scripts/test.sh lets the suite write them even where the environment sets PYTHONDONTWRITEBYTECODE.
echo "$FINGERPRINT" > "$STAMP"
# A test setup includes everything the server needs.
[ "$MODE" = "test" ] && echo "$FINGERPRINT" > .venv/.shoal-setup-serve
wait_for_chromium
exit 0
