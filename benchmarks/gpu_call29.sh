#!/usr/bin/env bash
# Device call (1 GPU), next to run: the GPU tests (the fused GELU kernel, saved-output cuDNN
# attention, BF16 gradients and chunking in the fused O2 kernel: none has completed on a GPU
# yet; gpu_call21's 120 s limit cut them off), then 1.3B with O2's memory spent on saved GEMM
# outputs and larger batches against O0's best setting (saved outputs, B8 / B16), with O2's
# GEMM weights decoded to BF16.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 280 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py > $OUT/gputests.txt 2>&1
tail -5 $OUT/gputests.txt
S="--set model.attention_impl=cudnn"
SAVE="model.remat_policy=save_gemm_outputs"
timeout 300 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 4 $S \
  --run "O0 saved=O0,$SAVE" --run "O0 saved B16=O0,$SAVE,train.batch_size=16" \
  --run "O2 saved B16=O2,$SAVE,train.batch_size=16" \
  --run "O2 saved B32=O2,$SAVE,train.batch_size=32" > $OUT/save13b.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/save13b.txt | grep -v "^$" | tail -8
