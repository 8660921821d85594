#!/usr/bin/env bash
# Device call (1 GPU): where the 7B-class layer shape's O1 and O0 steps spend GPU time, and the
# 1.3B step with O2's saved memory spent (larger micro-batch, no remat) against O0's settings.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S7="--set model.attention_impl=cudnn --set model.n_layers=8 --set train.microbatches=1"
for L in O1 O0; do
  timeout 150 python3 benchmarks/profile_step.py --config configs/gpt_7b.yaml --level $L $S7 \
    2>&1 | grep -v -i warn | tee $OUT/profile7_$L.txt | sed -n '/GPU kernel time/,$p' | head -40
done
timeout 380 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 5 \
  --set model.attention_impl=cudnn --run "O0 B8=O0" --run "O0 B16=O0,train.batch_size=16" \
  --run "O0 B8 no remat=O0,model.remat=false" --run "O2 B8=O2" \
  --run "O2 B16=O2,train.batch_size=16" --run "O2 B8 no remat=O2,model.remat=false" \
  --run "O2 B16 no remat=O2,model.remat=false,train.batch_size=16" 2>&1 \
  | grep -v -i "warn" | tee $OUT/spent13.txt | tail -10
