#!/usr/bin/env bash
# Set everything up and start the API server. With no checkpoint given, writes and serves the
# random-weight demo checkpoint (it speaks noise: real weights are not downloadable here).
# Usage: scripts/serve.sh [CHECKPOINT_DIR_OR_REPO_ID] [extra `shoal serve` options]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
CHECKPOINT=${1:-}
if [ -z "$CHECKPOINT" ]; then
  CHECKPOINT=demo
  [ -f demo/config.json ] || shoal demo-checkpoint demo
  set -- --no-auth
else
  shift
fi
exec shoal serve --checkpoint "$CHECKPOINT" "$@"
