#!/usr/bin/env bash
# Device call (1 GPU): the 7B-class layer shape best against best at larger batches (O0
# gained 8% from B8 to B16 at 1.3B with unrolled layers in gpu_call34).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set model.scan_layers=false --set model.n_layers=8"
timeout 250 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S \
  --run "O0 saved unrolled B16=O0,model.remat_policy=save_gemm_outputs,train.batch_size=16" \
  --run "O2 io unrolled B24=O2,model.remat_policy=save_gemm_io,train.batch_size=24" \
  > $OUT/unroll7x8b.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/unroll7x8b.txt | grep -v "^$" | tail -4
