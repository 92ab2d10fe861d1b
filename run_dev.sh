#!/usr/bin/env bash
set -uo pipefail
export SHOAL_COMMIT=c321b47 PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SHOAL_SHARED=$PWD/.gpu_shared
S=$OUT/summary.txt
t0=$SECONDS
python3 -m pytest -q -m "gpu or not gpu" -p no:cacheprovider tests/test_fp8_gemm_gluon.py > $OUT/tests.log 2>&1
rc=$?
echo "tests rc=$rc $((SECONDS-t0))s" >> $S; tail -3 $OUT/tests.log >> $S
if [ $rc -ne 0 ]; then cat $S; exit 0; fi
AB="python3 -m shoal.cli bench ab --rounds 3"
for pair in "1 2" "4 8" "16 32" "32 64"; do
set -- $pair
v1="gemm@*x*x$1:tma_scales=true+gemm@*x*x$2:tma_scales=true"
v2="gemm@*x*x$1:tma_scales=true,scales_first=true+gemm@*x*x$2:tma_scales=true,scales_first=true"
$AB --batch $1 --variant "$v1" --variant "$v2" > $OUT/ab$1.log 2>&1
echo "ab$1 rc=$? $((SECONDS-t0))s" >> $S; grep -v "^frame" $OUT/ab$1.log | tail -3 >> $S
done
cat $S
