#!/usr/bin/env bash
# Device call (1 GPU): the optimizer update benchmark after the kernel writes the new scales
# itself, its kernels by name, and the GPU tests of the fused optimizer.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 160 python3 benchmarks/optim_update.py --iters 20 --profile --kernel-names --modes optax \
  "O2 fused" "O2 fused, finite given" clip+optax "clip+O2 fused" > $OUT/optim.txt 2>&1
grep "^|\|device" $OUT/optim.txt
timeout 200 python3 -m pytest -q tests/test_fused_optim.py 2>&1 | tee $OUT/tests.txt | tail -3
