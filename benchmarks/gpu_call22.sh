#!/usr/bin/env bash
# Device call (1 GPU): the full 7B-class config (32 layers, B8 in 8 one-sequence microbatches):
# O0's settings that fit (full remat; saved GEMM outputs) against O2 with FP8 weights cast
# once per optimizer step or once per microbatch (fp8.cast_weights_once), and O2 spending its
# saved memory on 4-sequence microbatches with saved GEMM outputs.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set train.microbatches=8 --set train.learning_rate=3e-4 --set train.warmup_steps=100"  # the config defaults it ran with
SAVE="model.remat_policy=save_gemm_outputs"
timeout 500 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 3 $S \
  --run "O0 mb8=O0" --run "O0 mb8 saved=O0,$SAVE" \
  --run "O2 mb8 cast per microbatch=O2,fp8.cast_weights_once=false" --run "O2 mb8 cast once=O2" \
  --run "O2 mb2 saved=O2,train.microbatches=2,$SAVE" 2>&1 \
  | grep -v -i "warn" | tee $OUT/once7.txt | tail -8
