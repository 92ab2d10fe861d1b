nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t0=$SECONDS
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_gemm_gluon.py -k swiglu > $OUT/tests_swiglu.log 2>&1; tail -4 $OUT/tests_swiglu.log; echo "swiglu tests $((SECONDS-t0)) s"
if grep -q " passed" $OUT/tests_swiglu.log && ! grep -q "failed\|error" $OUT/tests_swiglu.log; then
timeout 200 python3 -m shoal.cli bench ab --batch 1 2 --rounds 3 --variant 'gemm@2560x9728x1:swiglu_prologue=false+gemm@2560x9728x2:swiglu_prologue=false' > $OUT/ab.log 2>&1; tail -8 $OUT/ab.log; echo "ab $((SECONDS-t0)) s"
timeout 120 python3 -m shoal.cli gate correctness > $OUT/gate.log 2>&1; tail -3 $OUT/gate.log; echo "gate $((SECONDS-t0)) s"
timeout 150 python3 -m shoal.cli bench engine --weight-format fp8 --concurrency 1 16 64 --frames 64 --shared-prefix 0 --no-naive --json $OUT/engine.json > $OUT/engine.log 2>&1; tail -9 $OUT/engine.log | head -5; echo "engine $((SECONDS-t0)) s"
python3 -m shoal.cli gate performance --results $OUT/engine.json --weight-format fp8 2>&1 | tail -6
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py > $OUT/tests_engine.log 2>&1; tail -3 $OUT/tests_engine.log; echo "engine tests $((SECONDS-t0)) s"
else
grep -E "Error|error|assert" $OUT/tests_swiglu.log | head -30
fi
