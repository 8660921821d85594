#!/usr/bin/env bash
# Device call (1 GPU): where the 1.3B step's time goes on each level's fastest setting
# (unrolled layers; O2 saving GEMM outputs and FP8 inputs, O0 saving GEMM outputs), B8.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set model.scan_layers=false --top 12"
timeout 60 python3 benchmarks/profile_step.py --config configs/gpt_1_3b.yaml --level O0 $S \
  --set model.remat_policy=save_gemm_outputs > $OUT/profile_O0.txt 2>&1
grep -v -i warn $OUT/profile_O0.txt | grep -A10 "GPU kernel time"
timeout 150 python3 benchmarks/profile_step.py --config configs/gpt_1_3b.yaml --level O2 $S \
  --set model.remat_policy=save_gemm_io > $OUT/profile_O2.txt 2>&1
grep -v -i warn $OUT/profile_O2.txt | grep -A26 "GPU kernel time"
