#!/usr/bin/env bash
# Device call (1 GPU): the GPU tests on the final code (need ~320 s: run with 200 s first,
# cut after one test, then rerun alone with 420 s), and where the 7B-class layer shape's
# step time goes on each level's fastest setting (8 x 4096 SwiGLU, B8, unrolled; O0 saving
# GEMM outputs, O2 saving GEMM inputs and outputs), next to gpu_call39's 1.3B profile.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -3
S="--config configs/gpt_7b.yaml --set model.n_layers=8 --set model.attention_impl=cudnn"
S="$S --set model.scan_layers=false --top 10"
timeout 120 python3 benchmarks/profile_step.py $S --level O0 \
  --set model.remat_policy=save_gemm_outputs > $OUT/profile7_O0.txt 2>&1
timeout 150 python3 benchmarks/profile_step.py $S --level O2 \
  --set model.remat_policy=save_gemm_io > $OUT/profile7_O2.txt 2>&1
for f in $OUT/profile7_O0.txt $OUT/profile7_O2.txt; do
  echo "== $f"; grep -v -i warn $f | grep -A20 "GPU kernel time" | cut -c1-110
done
