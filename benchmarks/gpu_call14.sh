#!/usr/bin/env bash
# Device call (1 GPU): the fused optimizer step's kernels by name and its compiled HLO; the
# 1.3B step at O0 / O1 / O2 with the training defaults (calibrated casts, fused cast kernel,
# fused optimizer at O2) and O2 with the composed optimizer.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 120 python3 benchmarks/optim_update.py --iters 10 --profile --kernel-names \
  --dump-hlo $OUT/optim --modes "O2 fused, finite given" > $OUT/optim_kernels.txt 2>&1
grep "^|" $OUT/optim_kernels.txt
timeout 330 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 8 \
  --set model.attention_impl=cudnn --run O0=O0 --run O1=O1 --run O2=O2 \
  --run "O2 composed optimizer=O2,train.fused_optimizer=false" 2>&1 \
  | grep -v -i "warn" | tee $OUT/train.txt | tail -8
