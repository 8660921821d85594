#!/usr/bin/env bash
# Device call (1 GPU): the optimizer update benchmark, each step waited for and back to back.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 200 python3 benchmarks/optim_update.py --iters 20 --profile --modes optax "fp8jax O2" \
  "O2 fused" "O2 fused, finite given" clip+optax "clip+O2 fused" > $OUT/optim.txt 2>&1
grep "^|\|device" $OUT/optim.txt
