#!/usr/bin/env bash
# Device call (1 GPU): FP8 weights cast once per optimizer step vs once per microbatch
# (fp8.cast_weights_once) where microbatches repeat the casts: the 7B-class layer shape at
# B16 in 4 microbatches, and the full 7B-class config (32 layers, B8 in 8 microbatches) at O2.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn"
timeout 200 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S \
  --set model.n_layers=8 --set train.batch_size=16 --set train.microbatches=4 \
  --run "O0 mb4=O0" --run "O2 mb4 cast per microbatch=O2,fp8.cast_weights_once=false" \
  --run "O2 mb4 cast once=O2" 2>&1 | grep -v -i "warn" | tee $OUT/once7x8.txt | tail -6
timeout 300 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 3 $S \
  --run "O2 mb8 cast per microbatch=O2,fp8.cast_weights_once=false" \
  --run "O2 mb8 cast once=O2" 2>&1 | grep -v -i "warn" | tee $OUT/once7.txt | tail -5
