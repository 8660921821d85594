#!/usr/bin/env bash
# Device call (1 GPU): the optimizer update benchmark with the one-multiply rounding hash and
# the vectorized scalar preparation, then the GPU tests of the changed code.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 150 python3 benchmarks/optim_update.py --iters 20 --profile --modes optax \
  "O2 fused" "O2 fused, finite given" clip+optax "clip+O2 fused" 2>&1 | grep "^|\|device" \
  | tee $OUT/optim.txt
timeout 330 python3 -m pytest -q tests/test_gpu.py tests/test_fused_optim.py \
  tests/test_weight_cast.py tests/test_calibration.py tests/test_cast_transpose.py 2>&1 \
  | tee $OUT/tests.txt | tail -4
