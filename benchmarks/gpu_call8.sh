#!/usr/bin/env bash
# Device call (4 GPUs): the scaling script on 1, 2 and 4 H200s at the 7B layer shape (as
# gpu_call6.sh), then the full 32-layer 7B config at O0 vs O3 under ZeRO 3 on all 4.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set data.max_bytes=16777216"
timeout 330 python3 benchmarks/scaling_gpu.py --config configs/gpt_7b.yaml --gpus 1,2,4 \
  --runs O0:1,O0:3,O3:1,O3:3 --microbatch 2 --steps 5 --timeout 100 --set model.n_layers=8 $S \
  --out $OUT/scaling4.json 2>&1 | grep "^|"
timeout 200 python3 benchmarks/scaling_gpu.py --config configs/gpt_7b.yaml --gpus 4 \
  --runs O0:3,O3:3 --microbatch 1 --steps 3 --timeout 95 $S --out $OUT/7b4.json 2>&1 | grep "^|"
