#!/usr/bin/env bash
# Device call (2 GPUs): FP8 reduce-scatter vs BF16, ZeRO-3 O3 vs O0, recovery time at 1.3B.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L
timeout 170 python3 benchmarks/collectives_gpu.py --budget-s 110 > $OUT/collectives.txt 2>&1; tail -30 $OUT/collectives.txt
timeout 190 python3 benchmarks/zero_gpu.py --set data.max_bytes=16777216 --steps 5 > $OUT/zero.txt 2>&1; tail -14 $OUT/zero.txt
CUDA_VISIBLE_DEVICES=0 timeout 160 python3 benchmarks/recovery_gpu.py --set train.opt_level=O2 \
  --kill-at 8 --every 4 --set data.max_bytes=16777216 --timeout 70 > $OUT/recovery.txt 2>&1; tail -14 $OUT/recovery.txt
