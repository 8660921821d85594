#!/usr/bin/env bash
# Device call (1 GPU): the 7B-class layer shape (8 layers): O0's best batch (B8 or B16)
# against O2 with its saved memory spent (B16, B24).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S7="--set model.attention_impl=cudnn --set model.n_layers=8 --set train.microbatches=1"
timeout ${T:-150} python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S7 \
  --run "O0 B8=O0" --run "O0 B16=O0,train.batch_size=16" --run "O2 B16=O2,train.batch_size=16" \
  --run "O2 B24=O2,train.batch_size=24" 2>&1 | grep -v -i "warn" | tee $OUT/spent7b.txt | tail -7
