#!/usr/bin/env bash
# Device call (2 GPUs): tensor parallelism vs data parallelism at 1.3B (ZeRO 1, O0 and O1,
# the same global batch of 8 x 2048 tokens), or with PART=7b the full 32-layer 7B config at
# O0 vs O3 under ZeRO 3 on both GPUs.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set data.max_bytes=16777216"
if [ "${PART:-tp}" = tp ]; then
  for tp in 1 2; do
    timeout 280 python3 benchmarks/scaling_gpu.py --config configs/gpt_1_3b.yaml --gpus 2 \
      --runs O0:1,O1:1 --microbatch 4 --steps 5 --timeout 130 $S \
      --set parallel.tensor_parallel_size=$tp --out $OUT/tp$tp.json 2>&1 | grep "^|"
  done
else
  timeout 560 python3 benchmarks/scaling_gpu.py --config configs/gpt_7b.yaml --gpus 2 \
    --runs O0:3,O3:3 --microbatch 1 --steps 3 --timeout 270 $S --out $OUT/7b.json 2>&1 \
    | grep "^|"
fi
