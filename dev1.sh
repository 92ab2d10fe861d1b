set -x
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
timeout 360 python3 -m shoal.cli bench ab --batch 1 16 64 --rounds 3 --variant step:sample_chunks=8 --variant step:sample_chunks=4 --variant attention@16:min_split_tokens=64 --variant attention@1:min_split_tokens=32 > $OUT/ab.log 2>&1; tail -25 $OUT/ab.log
for b in 16 1; do
  timeout 90 ncu --clock-control none --kernel-name regex:_paged_attention_kernel --launch-skip 3 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section SourceCounters --section LaunchStats --section Occupancy -o $OUT/attn$b python3 scripts/ncu_attention.py --batch $b > $OUT/ncu$b.log 2>&1; tail -3 $OUT/ncu$b.log
  ncu --import $OUT/attn$b.ncu-rep --page details > $OUT/attn${b}_details.txt 2>&1
  grep -E "Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Eligible Warps|Issued Warp|No Eligible|Grid Size|Waves Per SM|L2 Hit|L1/TEX Hit" $OUT/attn${b}_details.txt | head -20
  ncu --import $OUT/attn$b.ncu-rep --page source --csv --print-source sass > $OUT/attn${b}_sass.csv 2>&1
  python3 scripts/ncu_top_stalls.py $OUT/attn${b}_sass.csv --top 14 2>&1 | head -40
done
