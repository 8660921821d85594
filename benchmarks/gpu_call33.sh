#!/usr/bin/env bash
# Device call (1 GPU): model.scan_layers=false (layers unrolled over slices of the same
# stacked variables: the backward's saved residuals are separate buffers, no zero-filled
# stacked buffers written and read back with device copies) against the scanned layers, at
# 1.3B and the 7B-class layer shape, O0 and O2, saved GEMM outputs (and inputs) and full remat.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn"
SAVE="model.remat_policy=save_gemm_outputs"
IO="model.remat_policy=save_gemm_io"
U="model.scan_layers=false"
timeout 330 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 4 $S \
  --run "O0 saved=O0,$SAVE" --run "O0 saved unrolled=O0,$SAVE,$U" \
  --run "O2 io unrolled=O2,$IO,$U" --run "O2 saved unrolled=O2,$SAVE,$U" \
  --run "O0 unrolled=O0,$U" --run "O2 unrolled=O2,$U" > $OUT/unroll13.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/unroll13.txt | grep -v "^$" | tail -9
timeout 200 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S \
  --set model.n_layers=8 --run "O0 saved unrolled=O0,$SAVE,$U" --run "O2 io unrolled=O2,$IO,$U" \
  --run "O2 io B16 unrolled=O2,$IO,$U,train.batch_size=16" > $OUT/unroll7x8.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/unroll7x8.txt | grep -v "^$" | tail -6
