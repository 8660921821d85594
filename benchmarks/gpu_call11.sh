#!/usr/bin/env bash
# Device call (1 GPU), train part: the 1.3B step and the 7B-class layer shape at O0 and O1
# with the training defaults (FP8 casts calibrated after the first step, fused cast+transpose
# kernel), the FP8 activation casts saved across remat (model.remat_save_fp8_inputs), and
# the previous defaults; then the GPU tests of the changed code.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 330 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 8 \
  --set model.attention_impl=cudnn --run O0=O0 \
  --run "O1 previous defaults=O1,fp8.calibrate=never,fp8.fused_cast_transpose=false" \
  --run O1=O1 --run "O1 saved activation casts=O1,model.remat_save_fp8_inputs=true" \
  --run "O2 saved activation casts=O2,model.remat_save_fp8_inputs=true" 2>&1 \
  | grep -v -i "warn" | tee $OUT/train13.txt | tail -9
timeout 200 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 5 \
  --set model.attention_impl=cudnn --set model.n_layers=8 --set train.microbatches=1 \
  --run O0=O0 --run O1=O1 --run "O1 saved activation casts=O1,model.remat_save_fp8_inputs=true" \
  2>&1 | grep -v -i "warn" | tee $OUT/train7.txt | tail -6
