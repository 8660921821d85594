#!/usr/bin/env bash
# Device call (1 GPU): the one-pass O2 optimizer (kernel probe, update benchmark with a
# profile), the GPU tests, and the 1.3B train step at O0/O1/O2 with the fused optimizer and
# with remat re-casting weights (model.remat_save_fp8_weights=false) side by side.
# `bash benchmarks/gpu_call9.sh optim` stops before the train steps; `... train` skips to them.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
if [ "${1:-all}" != train ]; then
timeout 100 python3 benchmarks/adam_kernel_probe.py 2>&1 | grep "^|\|H200"
timeout 150 python3 benchmarks/optim_update.py --iters 15 --profile --modes optax "fp8jax O2" \
  "O2 fused" "O2 fused, finite given" clip+optax "clip+O2 fused" 2>&1 | grep "^|\|device"
fi
[ "${1:-all}" != optim ] && timeout 170 python3 -m pytest -q -x tests/test_gpu.py tests/test_weight_cast.py 2>&1 | tail -3
[ "${1:-all}" = optim ] && exit 0
timeout 410 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 8 \
  --set model.attention_impl=cudnn --run O0=O0 --run O1=O1 \
  --run "O1 remat recasts=O1,model.remat_save_fp8_weights=false" --run O2=O2 \
  --run "O2 fused optimizer=O2,train.fused_optimizer=true" 2>&1 | grep -v -i "warn" | tail -12
