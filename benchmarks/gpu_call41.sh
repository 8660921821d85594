#!/usr/bin/env bash
# Device call (1 GPU): 7B-class layer shape (8 x 4096) best against best again, after the unrolled layers' gradients
# are stacked behind a barrier (unstack_layers; gpu_call39: O0 kernel time 269.0 -> 249.0 ms).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set model.scan_layers=false"
SAVE="model.remat_policy=save_gemm_outputs"
IO="model.remat_policy=save_gemm_io"
timeout 300 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S --set model.n_layers=8 \
  --run "O0 saved unrolled B8=O0,$SAVE" --run "O0 saved unrolled B16=O0,$SAVE,train.batch_size=16" \
  --run "O2 io unrolled B8=O2,$IO" --run "O2 io unrolled B16=O2,$IO,train.batch_size=16" \
  > $OUT/best7b.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/best7b.txt | grep -v "^$" | tail -7
