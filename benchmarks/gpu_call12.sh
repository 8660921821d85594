#!/usr/bin/env bash
# Device call (1 GPU), optimizer part: kernel variants (skip by pl.when, a one-multiply hash
# for stochastic rounding, tilings), the update benchmark, the GPU tests of changed code.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 150 python3 benchmarks/adam_kernel_probe.py 2>&1 | grep "^|\|H200" | tee $OUT/probe.txt
timeout 150 python3 benchmarks/optim_update.py --iters 15 --profile --modes optax \
  "O2 fused" "O2 fused, finite given" clip+optax "clip+O2 fused" 2>&1 | grep "^|\|device" \
  | tee $OUT/optim.txt
timeout 250 python3 -m pytest -q -x tests/test_gpu.py tests/test_fused_optim.py \
  tests/test_weight_cast.py tests/test_calibration.py 2>&1 | tail -3
