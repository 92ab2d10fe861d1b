#!/usr/bin/env bash
# The API under open-loop load on the lent H200 in one call (about 8 minutes): carried web-stack
# wheels are installed, a random-weight S2-Pro-size checkpoint (bf16 model drawn on the GPU +
# full-size codec) is written to /tmp/ckpt, `shoal serve` starts on it (FP8 weights by default),
# `shoal bench serve --arrivals poisson` offers Poisson arrivals (a seeded mix of lengths, stored
# voices, pcm/wav/mp3/opus, HTTP and WebSocket) and searches for the highest sustainable rate
# (p95 first audio <= 200 ms, <= 1% underruns, <= 1% failures); then the server is stopped and
# `python -m shoal.bench.capacity` measures the engine + codec alone in process (closed loop,
# same engine options), and one table prints both and their ratio. Logs and JSON go to $OUT.
# The compile cache in the data directory is kept between runs, so a second run in one call (an
# A/B of SERVE_ARGS) starts warm and the capacity run loads on the server's compiled kernels.
#
# GPU (device tool; carry .whl):   bash scripts/gpu_serve_bench.sh
# CPU rehearsal (local venv):      SIZE=demo DEVICE=cpu PY=.venv/bin/python bash scripts/gpu_serve_bench.sh
# Knobs (environment; CPU defaults in brackets): SIZE s2-pro|demo, DEVICE cuda|cpu, PY, OUT, CKPT,
# PORT, BUDGET_S (whole run, 480 [240]), INSTALL_WHEELS (1 on cuda), SERVE_ARGS (more `shoal serve`
# options, also given to the capacity run; "--weight-format fp8" on cuda), RATES (requests/s to
# start from, "4 8" ["0.5"]), DURATION (s of arrivals per rate, 20 [5]), FRAMES (64-384 [8-32]),
# FORMATS (pcm,wav,mp3,opus), WS_SHARE (0.25), VOICE_SHARE (0.5), VOICES (2), MAX_P95_MS (200
# [1500]), MAX_UNDERRUN_SHARE (0.01 [1]), CAPACITY_CONCURRENCY (64 [4]), CAPACITY_S (window, 10
# [4]), CAPACITY_RESERVE_S (kept for the capacity run: engine load + window, 120 [40]; CAPACITY=0: none),
# OVERLOAD (after the search, one run at this multiple of the sustainable rate, 1.5 [none]),
# OVERLOAD_RATE (that run at this rate instead, requests/s, even if no rate was sustainable),
# SEARCH=0 (no search: only RATES, then the overload),
# HTTP_LEVELS / WS_LEVELS (a closed-loop sweep first, e.g. 1,8,32; none by default; CLOSED_ARGS more
# of its options, e.g. "--ws-sessions 3"; LATENCIES one sweep per mode, e.g. "low balanced normal";
# CLOSED_VOICE=1 one more with a stored voice), MIXES (instead of the mixed open loop, one search
# per "format:ws-share" on the same server, e.g. "pcm:0 mp3:0 pcm:1"), PYSPY_S
# (seconds of py-spy sampling of the server and its engine and API processes 15 s into the
# open-loop sweep, 0 = none; needs a py-spy wheel among the carried ones).
set -uo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-s2-pro}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
OUT=${OUT:-/tmp/shoal-serve-bench}
CKPT=${CKPT:-/tmp/ckpt}
PORT=${PORT:-8080}
if [ "$DEVICE" = cuda ]; then
  BUDGET_S=${BUDGET_S:-480} RATES=${RATES:-4 8} DURATION=${DURATION:-20} FRAMES=${FRAMES:-64-384}
  CAPACITY_CONCURRENCY=${CAPACITY_CONCURRENCY:-64} CAPACITY_S=${CAPACITY_S:-10}
  CAPACITY_RESERVE_S=${CAPACITY_RESERVE_S:-120} SERVE_ARGS=${SERVE_ARGS---weight-format fp8}
  MAX_P95_MS=${MAX_P95_MS:-200} MAX_UNDERRUN_SHARE=${MAX_UNDERRUN_SHARE:-0.01}
else  # the demo model on a laptop CPU makes about one second of audio per second: a rehearsal of
  # the steps, with criteria loose enough that the search has something to find
  BUDGET_S=${BUDGET_S:-240} RATES=${RATES:-0.5} DURATION=${DURATION:-5} FRAMES=${FRAMES:-8-32}
  CAPACITY_CONCURRENCY=${CAPACITY_CONCURRENCY:-4} CAPACITY_S=${CAPACITY_S:-4}
  CAPACITY_RESERVE_S=${CAPACITY_RESERVE_S:-40} SERVE_ARGS=${SERVE_ARGS-}
  MAX_P95_MS=${MAX_P95_MS:-1500} MAX_UNDERRUN_SHARE=${MAX_UNDERRUN_SHARE:-1}
fi
INSTALL_WHEELS=${INSTALL_WHEELS:-$([ "$DEVICE" = cuda ] && echo 1 || echo 0)}
FORMATS=${FORMATS:-pcm,wav,mp3,opus}
WS_SHARE=${WS_SHARE:-0.25}
OVERLOAD=${OVERLOAD-$([ "$DEVICE" = cuda ] && echo 1.5)}
VOICE_SHARE=${VOICE_SHARE:-0.5}
VOICES=${VOICES:-2}
HTTP_LEVELS=${HTTP_LEVELS-}
WS_LEVELS=${WS_LEVELS-}
URL=http://127.0.0.1:$PORT
DATA_DIR=/tmp/shoal-serve-bench-data
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
mkdir -p "$OUT"
rm -f "$OUT/open_loop.json" "$OUT/capacity.json"
T0=$SECONDS
say() { echo "[$((SECONDS - T0)) s] $*"; }
left() { echo $((BUDGET_S - (SECONDS - T0))); }

# No commit printed: the device tool copies the working tree, not the repository's HEAD (its copy's
# git HEAD can be older), so the run's entry in the perf log names the commit.
say "size=$SIZE device=$DEVICE budget=${BUDGET_S}s out=$OUT serve args: ${SERVE_ARGS:-none}"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
# GPU busy share (nvidia-smi's utilization: time with a kernel running) every 0.5 s, stamped, so
# each phase's mean tells a GPU-bound phase from a host-bound one.
util_pid=
if [ "$DEVICE" = cuda ]; then
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 500 2>/dev/null \
    | while read -r busy; do echo "$(date +%s.%N) $busy"; done >"$OUT/gpu_util.txt" &
  util_pid=$!
fi
gpu_busy() {  # mean GPU busy % between two epoch times
  [ -s "$OUT/gpu_util.txt" ] || { echo "-"; return; }
  awk -v a="$1" -v b="$2" '$1 >= a && $1 <= b { s += $2; n++ } END { if (n) printf "%.0f%% (%d samples)", s / n, n; else print "-" }' \
    "$OUT/gpu_util.txt"
}

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

# (3) the server, on a fresh data directory but its compile cache (kept, as on a user's volume:
# a second run in the same call starts warm, and the capacity run below loads on it)
mkdir -p "$DATA_DIR"
find "$DATA_DIR" -mindepth 1 -maxdepth 1 ! -name compile-cache -exec rm -rf {} +
say "starting shoal serve"
# shellcheck disable=SC2086  # SERVE_ARGS is a list of options
"$PY" -m shoal.cli serve --checkpoint "$CKPT" --no-auth --host 127.0.0.1 --port "$PORT" --device "$DEVICE" \
  --data-dir "$DATA_DIR" --max-streams-per-key 1024 $SERVE_ARGS >"$OUT/server.log" 2>&1 &
server_pid=$!
stop_server() {
  [ -n "${server_pid:-}" ] || return 0
  kill -INT "$server_pid" 2>/dev/null
  for _ in $(seq 1 20); do kill -0 "$server_pid" 2>/dev/null || break; sleep 0.5; done
  kill -KILL "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=
}
trap 'stop_server; [ -n "$util_pid" ] && kill "$util_pid" 2>/dev/null' EXIT

# Ready once /v1/health answers 200; gives up when the server exits or too little time is left.
wait_limit=$(($(left) - CAPACITY_RESERVE_S - 60))
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

# (4) the load: an optional closed-loop sweep, then the open-loop search for the sustainable rate.
closed_limit=$(($(left) - CAPACITY_RESERVE_S - 60))
if [ -n "$HTTP_LEVELS$WS_LEVELS" ] && [ "$closed_limit" -gt 10 ]; then
  mode=both
  [ -z "$HTTP_LEVELS" ] && mode=ws
  [ -z "$WS_LEVELS" ] && mode=http
  metrics() { "$PY" -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('$URL/metrics').read().decode())"; }
  sweep() {  # sweep NAME [bench serve options...]: closed-loop sweeps -> closed_loop_NAME_MODE.json
    local name=$1 one
    shift
    # One run per transport, so that the server's and the engine's means below are each one's.
    for one in $([ "$mode" = both ] && echo "http ws" || echo "$mode"); do
      metrics >"$OUT/metrics_before_${name}_$one.txt"
      timeout "$closed_limit" "$PY" -m shoal.cli bench serve --url "$URL" --mode "$one" \
        --concurrency "${HTTP_LEVELS:-1}" --ws-concurrency "${WS_LEVELS:-1}" --requests-per-level 4 --rounds 2 \
        --warmup 2 --max-new-tokens 256 --timeout 120 --json "$OUT/closed_loop_${name}_$one.json" \
        "$@" ${CLOSED_ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
      # What the server saw over the run (`shoal.bench.server_metrics`, as each open-loop rate
      # prints it): the engine's and the server's first audio beside the client's figures above.
      metrics | "$PY" -c '
import sys
from shoal.bench.server_metrics import parse_snapshot, server_view
before, after = parse_snapshot(open(sys.argv[1]).read()), parse_snapshot(sys.stdin.read())
print("    " + server_view(before, after).line())
' "$OUT/metrics_before_${name}_$one.txt" | tee -a "$OUT/bench.log"
    done
  }
  # LATENCIES: one sweep per `latency` mode (e.g. "low balanced normal"); none: the bench's default.
  for latency in ${LATENCIES:-default}; do
    latency_args=()
    [ "$latency" != default ] && latency_args=(--latency "$latency")
    say "closed loop: http ${HTTP_LEVELS:--} ws ${WS_LEVELS:--} latency $latency"
    sweep "$latency" "${latency_args[@]}"
  done
  # CLOSED_VOICE=1: one more sweep speaking with a stored voice (what `ws+` rows save is its prefill)
  if [ "${CLOSED_VOICE:-0}" = 1 ]; then
    voice_id=$("$PY" - "$URL" <<'EOF'
import asyncio, sys

import httpx

from shoal.bench.open_loop import create_voices


async def main() -> None:
    async with httpx.AsyncClient(base_url=sys.argv[1], timeout=60) as client:
        print((await create_voices(client, 1, 10.0))[0])


asyncio.run(main())
EOF
)
    say "closed loop with stored voice ${voice_id:-(not created)}"
    [ -n "$voice_id" ] && sweep voice --reference-id "$voice_id"
  fi
fi
if [ "${PYSPY_S:-0}" -gt 0 ] && [ -x /tmp/site/bin/py-spy ]; then
  # 15 s into the load; --nonblocking reads the server without pausing it.
  for mode in gil idle; do
    (sleep 15; /tmp/site/bin/py-spy record --pid "$server_pid" --duration "$PYSPY_S" --rate 200 \
      --format raw --threads --subprocesses --nonblocking "--$mode" -o "$OUT/pyspy_$mode.txt" \
      >"$OUT/pyspy_$mode.log" 2>&1) &
  done
fi
budget=$(($(left) - CAPACITY_RESERVE_S - 15))
open_loop_start=$(date +%s.%N)
SEARCH_ARG=--find-sustainable
[ "${SEARCH:-1}" = 0 ] && SEARCH_ARG=  # SEARCH=0: only the RATES given (and the overload)
# One `shoal bench serve` open loop on this server, the workload's options as set above:
# open_loop TIME_BUDGET FORMATS WS_SHARE [more options]
open_loop() {
  local limit=$1 formats=$2 share=$3
  shift 3
  # shellcheck disable=SC2086  # RATES is a list
  timeout $((limit + 45)) "$PY" -m shoal.cli bench serve --url "$URL" --arrivals poisson --rate $RATES \
    --duration "$DURATION" --frames "$FRAMES" --formats "$formats" --ws-share "$share" \
    --voice-share "$VOICE_SHARE" --voices "$VOICES" --max-p95-ms "$MAX_P95_MS" \
    --max-underrun-share "$MAX_UNDERRUN_SHARE" --time-budget "$limit" --drain-timeout 15 --timeout 60 "$@"
}
if [ -n "${MIXES:-}" ]; then
  # MIXES="pcm:0 mp3:0 pcm:1": one sustainable-rate search per format:WebSocket-share on this server
  # (issue 40's ratios: mp3 against pcm, the WebSocket against HTTP), the budget split evenly.
  # shellcheck disable=SC2206  # MIXES is a list
  mixes=($MIXES)
  each=$((budget / ${#mixes[@]}))
  for mix in "${mixes[@]}"; do
    format=${mix%%:*} share=${mix##*:}
    say "open loop, mix $format over ${share} WebSocket share: rates $RATES, search within ${each} s"
    open_loop "$each" "$format" "$share" --find-sustainable --json "$OUT/open_loop_${format}_ws${share}.json" \
      2>&1 | tee -a "$OUT/bench.log" | grep -E "^ +[0-9]|server:|sustainable"
  done
  "$PY" - "$OUT" "${mixes[@]}" <<'EOF' | tee -a "$OUT/bench.log"
import json, sys
from pathlib import Path

out, mixes = Path(sys.argv[1]), sys.argv[2:]
first = None
print("sustainable frames/s per mix (format, WebSocket share), and against the first mix:")
for mix in mixes:
    name, share = mix.split(":")
    path = out / f"open_loop_{name}_ws{share}.json"
    best = json.loads(path.read_text()).get("sustainable") if path.exists() else None
    fps = best["frames_per_second"] if best else None
    first = fps if first is None else first
    ratio = f"{fps / first:.2f}" if fps and first else "-"
    print(f"  {name:5} ws {share:>4}  {'-' if fps is None else f'{fps:,.0f}':>8}  {ratio}")
EOF
  RATES= OVERLOAD= OVERLOAD_RATE=  # the mixes replace the mixed open loop below
fi
[ -n "$RATES" ] && say "open loop: rates $RATES, ${DURATION} s each, frames $FRAMES, $FORMATS, ws share" \
  "$WS_SHARE, voice share $VOICE_SHARE; sustainable-rate search within ${budget} s"
# shellcheck disable=SC2086  # SEARCH_ARG is one option or none
[ -n "$RATES" ] && open_loop "$budget" "$FORMATS" "$WS_SHARE" ${SEARCH_ARG} \
  ${OVERLOAD:+--overload "$OVERLOAD"} ${OVERLOAD_RATE:+--overload-rate "$OVERLOAD_RATE"} \
  --json "$OUT/open_loop.json" --traces "$OUT/open_loop_traces.jsonl" 2>&1 | tee -a "$OUT/bench.log"
say "open loop exit ${PIPESTATUS[0]}; GPU busy during the open loop: $(gpu_busy "$open_loop_start" "$(date +%s.%N)")"

# (5) what the server saw, then stop it (the capacity run needs the GPU to itself)
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
grep -E "^shoal_(time_to_first_audio_seconds_(sum|count)|audio_seconds_total|requests_total|streams_underrun_total|underrun_seconds_total|audio_delivery_lag_seconds_(sum|count|bucket.*le=\"0.1\"))" \
  "$OUT/after.txt" | head -n 24 | sed 's/^/    /'
stop_server

# (6) the in-process capacity: the same engine options, the same mix of lengths and voices
capacity_limit=$(($(left) - 10))
if [ "${CAPACITY:-1}" = 0 ]; then
  say "in-process capacity not measured (CAPACITY=0)"
elif [ "$capacity_limit" -gt 20 ]; then
  say "in-process capacity: $CAPACITY_CONCURRENCY in flight, ${CAPACITY_S} s window (limit ${capacity_limit} s)"
  capacity_start=$(date +%s.%N) window_start= window_end=
  # shellcheck disable=SC2086
  timeout "$capacity_limit" "$PY" -m shoal.bench.capacity --checkpoint "$CKPT" --device "$DEVICE" \
    --data-dir "$DATA_DIR" $SERVE_ARGS \
    --concurrency "$CAPACITY_CONCURRENCY" --frames "$FRAMES" --voice-share "$VOICE_SHARE" --voices "$VOICES" \
    --seconds "$CAPACITY_S" --warmup-seconds 3 --json "$OUT/capacity.json" 2>&1 | tee "$OUT/capacity.log" \
    | grep -vE "^\s*$" | tail -n 5
  capacity_exit=${PIPESTATUS[0]}
  read -r _ _ _ _ window_start window_end < <(grep "^capacity window" "$OUT/capacity.log" | tail -n 1)
  say "capacity exit $capacity_exit; GPU busy in its window: $(gpu_busy "${window_start:-$capacity_start}" "${window_end:-$(date +%s.%N)}")"
else
  say "no time left for the in-process capacity (${capacity_limit} s)"
fi

# (7) one table
echo
if [ -s "$OUT/open_loop.json" ]; then
  "$PY" -m shoal.bench.capacity --summary "$OUT/open_loop.json" "$OUT/capacity.json"
else
  say "no open-loop results"
fi
say "done; logs in $OUT: $(ls "$OUT" | tr '\n' ' ')"
