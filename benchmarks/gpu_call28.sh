#!/usr/bin/env bash
# Device call (1 GPU): the fused O2 update with the 7B config's 2.9e9-element SwiGLU kernel in
# two kernel calls (was: garbage past 32-bit offsets, then the slow XLA fallback of
# gpu_call27.sh): step probe (losses against the composed update's 5.6417 / 5.7605 / 4.9142,
# no non-finite state), then O0 vs O2 throughput at the full config, one microbatch.
set -u
. benchmarks/gpu_env.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn"
timeout 90 python3 benchmarks/step_probe.py --config configs/gpt_7b.yaml $S --set train.opt_level=O2 \
  --set train.microbatches=1 --steps 3 2>&1 | grep -E "^(step|  non)"
timeout 200 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 3 $S \
  --set train.microbatches=1 --run "O0=O0" --run "O2=O2" \
  --run "O2 B16=O2,train.batch_size=16" > $OUT/full7b.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/full7b.txt | grep -v "^$" | tail -8
