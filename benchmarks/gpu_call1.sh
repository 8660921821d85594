#!/usr/bin/env bash
# Device call: profile + throughput of the 1.3B config, optimizer update, GPU tests.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
C=configs/gpt_1_3b.yaml; A=model.attention_impl=cudnn
timeout 80 python3 benchmarks/profile_step.py --config $C --level O0 --set $A 2>&1 | grep -v emulated | tee $OUT/prof_O0.txt
timeout 80 python3 benchmarks/profile_step.py --config $C --level O1 --set $A 2>&1 | grep -v emulated | tee $OUT/prof_O1.txt
timeout 290 python3 benchmarks/train_throughput.py --config $C --set $A --steps 8 \
  --run O0=O0 --run O1=O1 --run O2=O2 --run "O0 no-remat=O0,model.remat=false" \
  --run "O2 no-remat=O2,model.remat=false" 2>&1 | tee $OUT/tput_1_3b.txt
timeout 70 python3 benchmarks/optim_update.py 2>&1 | tee $OUT/optim.txt
timeout 70 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -5 | tee $OUT/test_gpu.txt
