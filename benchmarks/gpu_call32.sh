#!/usr/bin/env bash
# Device call (1 GPU): where the 1.3B O2 step's device copies come from (memcpy by HLO op;
# command buffers off so each copy names its op), and whether XLA's dynamic-slice fusion
# (GEMMs reading/writing layer slices of the scan's stacked buffers in place) removes them;
# the saved-output GPU test judged against the f32 model.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 60 python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py -k saved_gemm_outputs \
  > $OUT/gputests.txt 2>&1
grep -i "seed\|passed\|failed\|assert" $OUT/gputests.txt | tail -5
S="--set model.attention_impl=cudnn"
IO="model.remat_policy=save_gemm_io"
BASE=$XLA_FLAGS
XLA_FLAGS="$BASE --xla_gpu_enable_command_buffer=" timeout 90 python3 benchmarks/profile_step.py \
  --config configs/gpt_1_3b.yaml --level O2 $S --set $IO --top 12 > $OUT/profile_io.txt 2>&1
grep -v -i warn $OUT/profile_io.txt | grep -A40 "GPU kernel time" | head -40
for F in "" "--xla_gpu_enable_dynamic_slice_fusion=true"; do
  echo "== XLA_FLAGS extra: $F"
  XLA_FLAGS="$BASE $F" timeout 150 python3 benchmarks/train_throughput.py \
    --config configs/gpt_1_3b.yaml --steps 4 $S --run "O0 saved=O0,model.remat_policy=save_gemm_outputs" \
    --run "O2 io=O2,$IO" > $OUT/dsf.txt 2>&1
  grep -v -i "warn\|^W1\|^ " $OUT/dsf.txt | grep -v "^$" | tail -3
done
