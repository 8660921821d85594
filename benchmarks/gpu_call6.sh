#!/usr/bin/env bash
# Device call (2 GPUs; the 8-GPU kind was not lent): the scaling script on 1 and 2 H200s at the
# 7B layer shape (8 of the 7B config's 32 layers: d 4096, SwiGLU 11008, 1.6B params), ZeRO 1
# and 3, O0 vs O3 (O2 equals O3 at the same ZeRO stage), then the largest microbatch of O0
# and O3 at ZeRO 3 on both GPUs.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.n_layers=8 --set model.attention_impl=cudnn --set data.max_bytes=16777216"
timeout 400 python3 benchmarks/scaling_gpu.py --config configs/gpt_7b.yaml --gpus 1,2 \
  --runs O0:1,O0:3,O3:1,O3:3 --microbatch 2 --steps 5 --timeout 120 $S \
  --out $OUT/scaling.json 2>&1 | tee $OUT/scaling.txt | grep -v "^WARNING"
timeout 170 python3 benchmarks/scaling_gpu.py --config configs/gpt_7b.yaml --gpus 2 --runs O0:3 \
  --microbatch 8 --steps 3 --timeout 80 --max-microbatch $S --out $OUT/maxmb.json 2>&1 \
  | tee $OUT/maxmb.txt | grep -v "^WARNING"
