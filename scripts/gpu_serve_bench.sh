#!/usr/bin/env bash
# `shoal bench serve` on the lent H200 in one call (about 4 minutes): carried web-stack wheels are
# installed, a random-weight S2-Pro-size checkpoint (bf16 model drawn on the GPU + full-size codec)
# is written to /tmp/ckpt, `shoal serve --no-auth` starts on it, and the HTTP + WebSocket load
# generator sweeps concurrency (TTFA p50/p95, audio seconds per second, errors), then the server
# is stopped. Logs and the JSON results go to $OUT.
#
# GPU (device tool; carry .whl):   bash scripts/gpu_serve_bench.sh
# CPU rehearsal (local venv):      SIZE=demo DEVICE=cpu PY=.venv/bin/python bash scripts/gpu_serve_bench.sh
# Knobs (environment): SIZE s2-pro|demo, DEVICE cuda|cpu, PY, OUT, CKPT, PORT, BUDGET_S (whole run,
# default 200), INSTALL_WHEELS (default 1 on cuda), HTTP_LEVELS, WS_LEVELS, EXTRA_HTTP_LEVELS,
# EXTRA_WS_LEVELS (run only while time is left), MAX_NEW_TOKENS, REQUESTS, ROUNDS, TEXT,
# SERVE_ARGS (more `shoal serve` options, e.g. --weight-format fp8), PYSPY_S (seconds of py-spy
# sampling of the server during the extra levels, 0 = none: which thread holds the GIL, and where
# every thread is; needs a py-spy wheel among the carried ones).
set -uo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-s2-pro}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
OUT=${OUT:-/tmp/shoal-serve-bench}
CKPT=${CKPT:-/tmp/ckpt}
PORT=${PORT:-8080}
BUDGET_S=${BUDGET_S:-200}
INSTALL_WHEELS=${INSTALL_WHEELS:-$([ "$DEVICE" = cuda ] && echo 1 || echo 0)}
HTTP_LEVELS=${HTTP_LEVELS-1,8,32}
WS_LEVELS=${WS_LEVELS-1,8}
EXTRA_HTTP_LEVELS=${EXTRA_HTTP_LEVELS-64}
EXTRA_WS_LEVELS=${EXTRA_WS_LEVELS-32}
MAX_NEW_TOKENS=${MAX_NEW_TOKENS:-256}
REQUESTS=${REQUESTS:-4}
ROUNDS=${ROUNDS:-2}
TEXT=${TEXT:-Shoal streams speech while it is generated, one frame at a time.}
URL=http://127.0.0.1:$PORT
DATA_DIR=/tmp/shoal-serve-bench-data
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT"
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
left() { echo $((BUDGET_S - (SECONDS - T0))); }

say "size=$SIZE device=$DEVICE budget=${BUDGET_S}s out=$OUT commit=$(git rev-parse --short HEAD 2>/dev/null || echo -)"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# (1) the web stack's wheels, in the background while the checkpoint is written (the writer needs
# only torch, safetensors and tokenizers, so it runs without /tmp/site on its path).
pip_pid=
if [ "$INSTALL_WHEELS" = 1 ]; then
  rm -rf /tmp/site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl >"$OUT/setup.log" 2>&1 &
  pip_pid=$!
fi

# (2) the checkpoint
say "writing the random $SIZE checkpoint to $CKPT on $DEVICE"
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} timeout 150 "$PY" -m shoal.bench.random_checkpoint "$CKPT" --size "$SIZE" --device "$DEVICE" \
  --overwrite 2>&1 | tee "$OUT/checkpoint.log"
[ "${PIPESTATUS[0]}" = 0 ] || { say "checkpoint writing failed"; exit 1; }
du -sh "$CKPT" | sed 's/^/    /'

if [ -n "$pip_pid" ]; then
  wait "$pip_pid" || { say "wheel install failed:"; tail -n 20 "$OUT/setup.log"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
"$PY" -c "import fastapi, uvicorn, pydantic, av, sqlalchemy, ormsgpack, websockets, multipart, httpx, torch
print('web stack ok: fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__, 'websockets',
      websockets.__version__, 'torch', torch.__version__)" 2>&1 | tee -a "$OUT/setup.log"
[ "${PIPESTATUS[0]}" = 0 ] || { say "the web stack does not import"; exit 1; }

# (3) the server
rm -rf "$DATA_DIR"
say "starting shoal serve"
"$PY" -m shoal.cli serve --checkpoint "$CKPT" --no-auth --host 127.0.0.1 --port "$PORT" --device "$DEVICE" \
  --data-dir "$DATA_DIR" --max-streams-per-key 1024 ${SERVE_ARGS:-} >"$OUT/server.log" 2>&1 &
server_pid=$!
stop_server() {
  [ -n "${server_pid:-}" ] || return 0
  kill -INT "$server_pid" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=
}
trap stop_server EXIT

# Ready once /v1/health answers 200; gives up when the server exits or too little time is left.
wait_limit=$(($(left) - 60))
"$PY" - "$server_pid" "$URL/v1/health" "$wait_limit" <<'EOF'
import os, sys, time, urllib.request

pid, url, limit = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
end = time.monotonic() + limit
while time.monotonic() < end:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            alive = stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        alive = False
    if not alive:
        sys.exit(1)
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            if reply.status == 200:
                print("    health:", reply.read().decode()[:400])
                sys.exit(0)
    except OSError:
        pass
    time.sleep(0.5)
sys.exit(2)
EOF
ready=$?
if [ "$ready" != 0 ]; then
  [ "$ready" = 1 ] && say "shoal serve exited before it was ready; log tail:" \
    || say "shoal serve not ready within ${wait_limit}s; log tail:"
  tail -n 60 "$OUT/server.log"
  exit 1
fi
say "server ready"

# (4) the load: the main sweep, then the extra levels while time is left.
bench() {  # bench JSON_NAME HTTP_LEVELS WS_LEVELS WARMUP_REQUESTS
  local budget=$(($(left) - 30)) mode=both
  [ "$budget" -gt 5 ] || { say "no time left for $2 / $3"; return 0; }
  [ -z "$2" ] && mode=ws
  [ -z "$3" ] && mode=http
  say "bench serve: http ${2:--} ws ${3:--} (time budget ${budget}s)"
  timeout $((budget + 25)) "$PY" -m shoal.cli bench serve --url "$URL" --mode "$mode" \
    --concurrency "${2:-1}" --ws-concurrency "${3:-1}" --requests-per-level "$REQUESTS" --rounds "$ROUNDS" \
    --warmup "$4" --max-new-tokens "$MAX_NEW_TOKENS" --text "$TEXT" --time-budget "$budget" \
    --timeout 120 --json "$OUT/$1" 2>&1 | tee -a "$OUT/bench.log"
  say "bench exit ${PIPESTATUS[0]}"
}
bench serve_bench.json "$HTTP_LEVELS" "$WS_LEVELS" 2
if [ -n "$EXTRA_HTTP_LEVELS$EXTRA_WS_LEVELS" ]; then
  if [ "${PYSPY_S:-0}" -gt 0 ] && [ -x /tmp/site/bin/py-spy ]; then
    # After 15 s of load; --nonblocking reads the server without pausing it.
    for mode in gil idle; do
      (sleep 15; /tmp/site/bin/py-spy record --pid "$server_pid" --duration "$PYSPY_S" --rate 200 \
        --format raw --threads --nonblocking "--$mode" -o "$OUT/pyspy_$mode.txt" \
        >"$OUT/pyspy_$mode.log" 2>&1) &
    done
  fi
  bench serve_bench_extra.json "$EXTRA_HTTP_LEVELS" "$EXTRA_WS_LEVELS" 0
fi

# (5) what the server saw, then stop it
"$PY" - "$URL" >"$OUT/after.txt" 2>&1 <<'EOF'
import sys, urllib.request

for path in ("/v1/health", "/metrics"):
    try:
        with urllib.request.urlopen(sys.argv[1] + path, timeout=5) as reply:
            text = reply.read().decode()
    except OSError as error:
        text = f"unavailable: {error}"
    lines = [line for line in text.splitlines() if not line.startswith("#") and "python_" not in line]
    print(f"== {path}\n" + "\n".join(lines))
EOF
grep -E "^shoal_(time_to_first_audio_seconds_(sum|count)|audio_seconds_total|requests_total)" "$OUT/after.txt" \
  | head -n 12 | sed 's/^/    /'
stop_server
say "done; logs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
