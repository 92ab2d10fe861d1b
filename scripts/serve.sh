#!/usr/bin/env bash
# Set everything up and start the API server. With no checkpoint given, writes and serves the
# random-weight demo checkpoint (it speaks noise: real weights are not downloadable here).
# Usage: scripts/serve.sh [CHECKPOINT_DIR_OR_REPO_ID] [extra `shoal serve` options]
#   e.g. scripts/serve.sh --port 9000          (the demo checkpoint on port 9000)
#        scripts/serve.sh ./s2-pro --port 9000 (a real checkpoint)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  CHECKPOINT=$1
  shift
  exec shoal serve --checkpoint "$CHECKPOINT" "$@"
fi
# The demo: its data (database, voices) stays in the checkout, in demo/data, unless
# --data-dir or SHOAL_DATA_DIR says otherwise.
[ -f demo/config.json ] || shoal demo-checkpoint demo
export SHOAL_DATA_DIR=${SHOAL_DATA_DIR:-demo/data}
exec shoal serve --checkpoint demo --no-auth "$@"
