#!/usr/bin/env bash
# Device call (1 GPU): the full 7B-class config (32 layers, B8 x T2048) on one H200, after
# O2's GEMM weights are decoded straight to BF16 (make_train_step(matrix_dtype=...)) and one
# microbatch needs no gradient accumulator: O0 and O2 with one microbatch, O2 with 8
# one-sequence microbatches (FP8 weights cast once per step or per microbatch), O2 with 2
# microbatches and saved GEMM outputs. Then the 8-layer shape at O2 (speed unchanged?).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn --set train.microbatches=8 --set train.learning_rate=3e-4 --set train.warmup_steps=100"  # the config defaults it ran with
SAVE="model.remat_policy=save_gemm_outputs"
timeout 430 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 3 $S \
  --run "O0 mb1=O0,train.microbatches=1" --run "O2 mb1=O2,train.microbatches=1" \
  --run "O2 mb8 cast per microbatch=O2,fp8.cast_weights_once=false" --run "O2 mb8 cast once=O2" \
  --run "O2 mb2 saved=O2,train.microbatches=2,$SAVE" > $OUT/full7.txt 2>&1
grep -v -i "warn\|^W1\|^ " $OUT/full7.txt | grep -v "^$" | tail -14
timeout 150 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S \
  --set model.n_layers=8 --set train.microbatches=1 --run "O2 saved=O2,$SAVE" \
  --run "O2 B24 saved=O2,$SAVE,train.batch_size=24" > $OUT/save7x8b.txt 2>&1
tail -5 $OUT/save7x8b.txt
