#!/usr/bin/env bash
# Device call (1 GPU): the 7B-class layer shape (8 layers) at O0 B8, O2 B8 and O2 B16 (its
# saved memory spent), then where the O1 step's GPU time goes.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S7="--set model.attention_impl=cudnn --set model.n_layers=8 --set train.microbatches=1"
timeout 130 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S7 \
  --run "O0 B8=O0" --run "O2 B8=O2" --run "O2 B16=O2,train.batch_size=16" 2>&1 \
  | grep -v -i "warn" | tee $OUT/spent7.txt | tail -6
timeout 80 python3 benchmarks/profile_step.py --config configs/gpt_7b.yaml --level O1 $S7 \
  2>&1 | grep -v -i warn | tee $OUT/profile7_O1.txt | sed -n '/GPU kernel time/,$p' | head -36
