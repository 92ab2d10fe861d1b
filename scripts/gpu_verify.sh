#!/usr/bin/env bash
# The short verification call on the lent H200: the performance gate first (the refactor must not
# slow the step), then the correctness gate, then the GPU tests of the kernels whose tuned tables
# and comments changed, each under its own time limit; logs to $OUT.
# Usage (device tool): bash scripts/gpu_verify.sh
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/shoal-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm --format=csv,noheader
step() {  # step NAME LIMIT_S COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "=== $name: exit $? in $((SECONDS - t0)) s"
  tail -n "${TAIL:-8}" "$OUT/$name.log"
}
step gate_performance ${PERF_LIMIT:-150} python3 -m shoal.cli gate performance --weight-format fp8
step gate_correctness ${CORRECT_LIMIT:-120} python3 -m shoal.cli gate correctness
TAIL=4 step gpu_tests ${TESTS_LIMIT:-170} python3 -m pytest -q -m gpu -p no:cacheprovider -x \
  ${TEST_FILES:-tests/test_attention_kernels.py tests/test_fp8_gemm_gluon.py tests/test_engine_gpu.py tests/test_fp8_gemm.py}
