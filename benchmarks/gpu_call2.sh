#!/usr/bin/env bash
# Device call: optimizer update, step profile, throughput at 1.3B and a 7B-class layer shape, GPU tests.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
git log --oneline -1
timeout 60 python3 benchmarks/optim_update.py 2>&1 | tee $OUT/optim.txt
A=model.attention_impl=cudnn
timeout 60 python3 benchmarks/profile_step.py --config configs/gpt_1_3b.yaml --level O1 --set $A 2>&1 | grep -v emulated > $OUT/prof_O1.txt
head -12 $OUT/prof_O1.txt
timeout 170 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --set $A --steps 8 \
  --run O0=O0 --run O1=O1 --run O2=O2 --run "O1 fast-bwd=O1,fp8.bwd_fast_accumulation=true" 2>&1 | tee $OUT/tput_1_3b.txt
timeout 170 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 5 \
  --set $A --set model.n_layers=8 --set train.microbatches=1 \
  --run O0=O0 --run O1=O1 --run O2=O2 2>&1 | tee $OUT/tput_7b_shape.txt
timeout 80 python3 -m pytest -v -p no:cacheprovider tests/test_gpu.py 2>&1 > $OUT/test_gpu.txt; tail -8 $OUT/test_gpu.txt
