#!/usr/bin/env bash
# Device call (1 GPU): the full 7B-class config (32 layers, 6.5B params, B8 x T2048) on one
# H200 with XLA allowed 95% of the GPU's memory (the default 75% left the 8-microbatch O2 step,
# 30.2 GiB of state + 44.7 GiB of temporaries, out of memory): O0 and O2 with one microbatch,
# O2 with 8 one-sequence microbatches (FP8 weights cast once per step or per microbatch), and
# O2 with 2 microbatches of 4 and saved GEMM outputs.
set -u
. benchmarks/gpu_env.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set train.microbatches=8"  # the config default it ran with
SAVE="model.remat_policy=save_gemm_outputs"
timeout 540 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 3 $S \
  --run "O0 mb1=O0,train.microbatches=1" --run "O2 mb1=O2,train.microbatches=1" \
  --run "O2 mb8 cast once=O2" --run "O2 mb8 cast per microbatch=O2,fp8.cast_weights_once=false" \
  --run "O2 mb2 saved=O2,train.microbatches=2,$SAVE" > $OUT/full7.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/full7.txt | grep -v "^$" | tail -16
