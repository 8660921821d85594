#!/usr/bin/env bash
# Device call (1 GPU): 1.3B with O2's memory spent at larger batches on the fastest settings
# of gpu_call33 (unrolled layers; O2 saving GEMM outputs and FP8 inputs, O0 saving GEMM
# outputs, its best), to compare best against best.
set -u
. benchmarks/gpu_env.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set model.scan_layers=false"
timeout 330 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 4 $S \
  --run "O0 saved unrolled B16=O0,model.remat_policy=save_gemm_outputs,train.batch_size=16" \
  --run "O2 io unrolled B16=O2,model.remat_policy=save_gemm_io,train.batch_size=16" \
  --run "O2 io unrolled B32=O2,model.remat_policy=save_gemm_io,train.batch_size=32" \
  > $OUT/unroll13b.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/unroll13b.txt | grep -v "^$" | tail -5
