#!/usr/bin/env bash
# Device call (1 GPU), train part: the 1.3B step at O0 and O1 with the FP8 casts calibrated
# after the first step (fp8.calibrate, auto = on here) against uncalibrated casts, with and
# without the fused cast+transpose kernel; then the kernel-time profile of calibrated O1.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 400 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 8 \
  --set model.attention_impl=cudnn --run O0=O0 --run "O1 uncalibrated=O1,fp8.calibrate=never" \
  --run O1=O1 --run "O1 fused cast=O1,fp8.fused_cast_transpose=true" 2>&1 \
  | grep -v -i "warn" | tee $OUT/train.txt | tail -12
timeout 150 python3 benchmarks/profile_step.py --config configs/gpt_1_3b.yaml --level O1 \
  --set model.attention_impl=cudnn --set fp8.fused_cast_transpose=true \
  --dump-hlo $OUT/o1_fused_cal.hlo > $OUT/profile.txt 2>&1
grep -v -i warn $OUT/profile.txt | tail -40
