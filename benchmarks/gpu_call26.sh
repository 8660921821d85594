#!/usr/bin/env bash
# Device call (1 GPU): where the full 7B config's NaN at O2 (not at O0) comes from: per-step
# loss, non-finite state leaves and FP8 health (benchmarks/step_probe.py) at O2 (fused and
# composed update) and O1 (FP8 GEMMs, f32 state), one microbatch of 8 sequences.
set -u
. benchmarks/gpu_env.sh
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
P="python3 benchmarks/step_probe.py --config configs/gpt_7b.yaml --set model.attention_impl=cudnn --set train.microbatches=1"
probe() { local name=$1; shift; echo "== $name"; timeout 120 $P "$@" > $OUT/$name.txt 2>&1; \
  grep -E "^(memory|step|  )|Error|error:" $OUT/$name.txt | cut -c1-900 | tail -16; }
probe o2 --set train.opt_level=O2 --steps 4
probe o1 --set train.opt_level=O1 --steps 4
probe o2_composed --set train.opt_level=O2 --set train.fused_optimizer=false --steps 3
