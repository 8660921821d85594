#!/usr/bin/env bash
# Device call (1 GPU): the 1.3B step with O2's saved memory spent on a larger micro-batch,
# against O0 at the same and at its own batch (remat on: O0 without remat measured slower).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout ${T:-280} python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 4 \
  --set model.attention_impl=cudnn --run "O0 B8=O0" --run "O0 B16=O0,train.batch_size=16" \
  --run "O2 B16=O2,train.batch_size=16" --run "O2 B32=O2,train.batch_size=32" 2>&1 \
  | grep -v -i "warn" | tee $OUT/spent13.txt | tail -10
