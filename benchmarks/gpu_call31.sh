#!/usr/bin/env bash
# Device call (1 GPU): model.remat_policy=save_gemm_io (GEMM outputs and the FP8 casts of
# GEMM inputs kept: the backward casts no activation again) against save_gemm_outputs, at
# O0 and O2, 1.3B and the 7B-class layer shape; the saved-output GPU test with its FP8-level
# tolerances; then where the 1.3B O2 save_gemm_io step's time goes (copies in detail).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py -k saved_gemm_outputs \
  > $OUT/gputests.txt 2>&1
grep -i "passed\|failed\|assert" $OUT/gputests.txt | tail -4
S="--set model.attention_impl=cudnn"
SAVE="model.remat_policy=save_gemm_outputs"
IO="model.remat_policy=save_gemm_io"
timeout 200 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 4 $S \
  --run "O0 saved=O0,$SAVE" --run "O0 io=O0,$IO" --run "O2 saved=O2,$SAVE" --run "O2 io=O2,$IO" \
  --run "O2 io B16=O2,$IO,train.batch_size=16" > $OUT/io13.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/io13.txt | grep -v "^$" | tail -8
timeout 170 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S \
  --set model.n_layers=8 --run "O0 saved=O0,$SAVE" --run "O0 io=O0,$IO" \
  --run "O2 saved=O2,$SAVE" --run "O2 io=O2,$IO" > $OUT/io7x8.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/io7x8.txt | grep -v "^$" | tail -7
timeout 90 python3 benchmarks/profile_step.py --config configs/gpt_1_3b.yaml --level O2 $S \
  --set $IO --top 30 > $OUT/profile_io.txt 2>&1
grep -v -i warn $OUT/profile_io.txt | grep -A50 "GPU kernel time" | head -50
