#!/usr/bin/env bash
# Device call (1 GPU): optimizer-update experiments (+ compiled HLO), the 125M O0-vs-O2 curves,
# and the GPU tests.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 75 python3 benchmarks/optim_update.py --dump-hlo $OUT/optim 2>&1 | tee $OUT/optim.txt
rm -f $OUT/optim.optax.hlo.txt $OUT/optim.fp8jax.hlo.txt $OUT/optim.O2_nearest.hlo.txt
export STEPS=${STEPS:-2000}
for L in O0 O2; do
  timeout 200 python3 -m fp8jax.cli train --config configs/gpt_125m.yaml --no-progress \
    --set train.opt_level=$L --set train.steps=$STEPS --set model.attention_impl=cudnn \
    --set runtime.run_dir=runs/c125/$L > $OUT/train_$L.log 2>&1
  cp runs/c125/$L/metrics.jsonl $OUT/metrics_$L.jsonl; tail -2 $OUT/train_$L.log
done
timeout 150 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py > $OUT/test_gpu.txt 2>&1; tail -4 $OUT/test_gpu.txt
