nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
t0=$SECONDS
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_gpu.py tests/test_attention_kernels.py > $OUT/tests.log 2>&1; tail -3 $OUT/tests.log; echo "tests $((SECONDS-t0)) s"
timeout 100 python3 -m shoal.cli bench ab --batch 8 --rounds 3 --variant attention@8:min_split_tokens=64 > $OUT/ab.log 2>&1; tail -3 $OUT/ab.log; echo "ab $((SECONDS-t0)) s"
timeout 120 python3 -m shoal.cli bench profile --batch 1 --top 25 > $OUT/profile.log 2>&1; tail -34 $OUT/profile.log; echo "profile $((SECONDS-t0)) s"
timeout 100 python3 -m shoal.cli gate correctness > $OUT/gate.log 2>&1; tail -1 $OUT/gate.log; echo "gate $((SECONDS-t0)) s"
timeout 150 python3 -m shoal.cli bench engine --weight-format fp8 --concurrency 1 16 64 --frames 64 --shared-prefix 0 --no-naive --json $OUT/engine.json > $OUT/engine.log 2>&1; tail -9 $OUT/engine.log | head -4; echo "engine $((SECONDS-t0)) s"
python3 -m shoal.cli gate performance --results $OUT/engine.json --weight-format fp8 2>&1 | tail -6
