#!/usr/bin/env bash
set -uo pipefail
export SHOAL_COMMIT=4f52d51 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SHOAL_SHARED=$PWD/.gpu_shared
S=$OUT/summary.txt
t0=$SECONDS
python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/test_fp8_gemm_gluon.py > $OUT/tests.log 2>&1
echo "tests rc=$? $((SECONDS-t0))s" >> $S; tail -3 $OUT/tests.log >> $S
AB="python3 -m shoal.cli bench ab --rounds 3"
G='gluon=true,tiles_before_wait=1'
$AB --batch 64 --variant "gemm@*x*x64:$G" --variant "gemm@*x*x64:$G,scales_first=true" --variant "gemm@*x*x64:$G,tma_scales=true" --variant "gemm@*x*x64:$G,tma_scales=true,scales_first=true" > $OUT/ab64.log 2>&1
echo "ab64 rc=$? $((SECONDS-t0))s" >> $S; grep -v "^frame" $OUT/ab64.log | tail -6 >> $S
for b in 1 16; do
$AB --batch $b --variant "gemm@*x*x$b:scales_first=true" --variant "gemm@*x*x$b:tma_scales=true" --variant "gemm@*x*x$b:tma_scales=true,scales_first=true" > $OUT/ab$b.log 2>&1
echo "ab$b rc=$? $((SECONDS-t0))s" >> $S; grep -v "^frame" $OUT/ab$b.log | tail -5 >> $S
done
cat $S
