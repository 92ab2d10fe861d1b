#!/usr/bin/env bash
# One call on the lent H200: the GPU tests, then the benchmarks, each printing a short table.
# Usage (on the GPU machine, from the repo root): bash scripts/gpu_run.sh [tests|gemm|attention|codec|profile|ab|gate|probe|prefill|engine|all]...
# Logs go to $OUT (when set) so the device tool brings them back; TAG=x suffixes their names (A/B runs).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/shoal-gpu}
mkdir -p "$OUT"
stages=("$@"); [ ${#stages[@]} -eq 0 ] && stages=(all)
want() { for s in "${stages[@]}"; do [ "$s" = all ] || [ "$s" = "$1" ] && return 0; done; return 1; }
step() {  # step NAME TIMEOUT_S COMMAND...
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name${TAG:+_$TAG}.log" | tail -n ${TAIL:-40}
  echo "=== $name: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"
}
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
git rev-parse --short HEAD 2>/dev/null || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if want tests; then
  # TEST_FILES / TESTS_ARGS narrow the run: TEST_FILES=tests/test_engine_gpu.py TESTS_ARGS="-k prefill_graph"
  files=${TEST_FILES:-$(grep -l "mark.gpu" tests/test_*.py | grep -v -E "test_server|test_audio|test_synth" | tr '\n' ' ')}
  step gpu_tests ${TESTS_LIMIT:-300} python3 -m pytest -q -m gpu -p no:cacheprovider $files ${TESTS_ARGS:-}
fi
want gemm && step bench_gemm ${GEMM_LIMIT:-240} python3 -m shoal.cli bench gemm ${GEMM_ARGS:-}
want attention && step bench_attention ${ATTN_LIMIT:-240} python3 -m shoal.cli bench attention ${ATTN_ARGS:-}
want codec && step bench_codec 240 python3 -m shoal.cli bench codec ${CODEC_ARGS:-}
want profile && step bench_profile ${PROFILE_LIMIT:-300} python3 -m shoal.cli bench profile ${PROFILE_ARGS:-}
# ab only with variants to compare: AB_ARGS="--batch 16 64 --variant attention@16:block_n=128"
if want ab && [ -n "${AB_ARGS:-}" ]; then step bench_ab ${AB_LIMIT:-400} python3 -m shoal.cli bench ab $AB_ARGS; fi
# gate: `shoal gate correctness` (GATE_ARGS, e.g. "--bf16-partials"); probe: the in-process load probe
# on a random S2-Pro-size checkpoint it writes first (PROBE_ARGS, e.g. "--concurrency 8 64").
want gate && step gate_correctness ${GATE_LIMIT:-300} python3 -m shoal.cli gate correctness ${GATE_ARGS:-}
want probe && step probe_server_load ${PROBE_LIMIT:-400} python3 scripts/probe_server_load.py \
  --checkpoint "${PROBE_CHECKPOINT:-/tmp/ckpt}" ${PROBE_ARGS:---weight-format fp8}
# prefill: a concurrency-64 wave's prefill by kernel family, walls and idle gaps (PREFILL_ARGS), and
# with PREFILL_VARIANTS=1 the prefill's small kernels in several builds first.
if want prefill; then
  [ "${PREFILL_VARIANTS:-0}" = 1 ] && step prefill_variants 240 python3 scripts/probe_prefill_variants.py
  step probe_prefill ${PREFILL_LIMIT:-240} python3 scripts/probe_prefill_kernels.py ${PREFILL_ARGS:---gaps 12}
fi
want engine && step bench_engine ${ENGINE_LIMIT:-400} python3 -m shoal.cli bench engine ${ENGINE_ARGS:-}
exit 0
