#!/usr/bin/env bash
set -uo pipefail
export SHOAL_COMMIT=6d80158 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SHOAL_SHARED=$PWD/.gpu_shared
S=$OUT/summary.txt
t0=$SECONDS
for mode in off on off on; do
python3 - "$mode" > $OUT/e_$mode.log 2>&1 <<'PY'
import dataclasses, sys
from shoal.kernels import fp8_gemm as g
if sys.argv[1] == "off":
    for key, cfg in list(g.TUNED_CONFIGS_FP8.items()):
        g.TUNED_CONFIGS_FP8[key] = dataclasses.replace(cfg, tma_scales=False, scales_first=False)
from shoal.cli import main
main(["bench", "engine", "--weight-format", "fp8", "--concurrency", "16", "--frames", "64", "--shared-prefix", "0", "--no-naive"])
PY
echo "$mode $((SECONDS-t0))s: $(grep -E '^ +fp8 auto +16' $OUT/e_$mode.log)" >> $S
done
cat $S
