#!/usr/bin/env bash
# Device call (1 GPU): kernel-time profile of the calibrated 1.3B O1 step with XLA's casts
# (fp8.fused_cast_transpose=false), to compare with the fused-kernel profile (gpu_call10).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 200 python3 benchmarks/profile_step.py --config configs/gpt_1_3b.yaml --level O1 \
  --set model.attention_impl=cudnn --set fp8.fused_cast_transpose=false \
  --dump-hlo $OUT/o1_xla_cal.hlo > $OUT/profile.txt 2>&1
grep -v -i warn $OUT/profile.txt | tail -45
