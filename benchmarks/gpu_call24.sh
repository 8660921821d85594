#!/usr/bin/env bash
# Device call (1 GPU): why the full 7B config's O2 step reported a NaN loss, and what holds
# the memory of its 8-microbatch step (benchmarks/step_probe.py: per-step loss, gradient
# norm, skipped flag; XLA's memory analysis of the compiled step).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
P="python3 benchmarks/step_probe.py --config configs/gpt_7b.yaml --set model.attention_impl=cudnn --set train.opt_level=O2 --set train.microbatches=8 --set train.learning_rate=3e-4 --set train.warmup_steps=100"  # + the config defaults it ran with
probe() { local name=$1; shift; echo "== $name"; timeout 110 $P "$@" > $OUT/$name.txt 2>&1; \
  grep -E "^(memory|step)|Error|error:" $OUT/$name.txt | tail -8; }
probe o2_mb1 --set train.microbatches=1 --steps 4
probe o2_mb1_wide --set train.microbatches=1 --steps 4 --wide-matrices
probe o2_mb1_composed --set train.microbatches=1 --set train.fused_optimizer=false --steps 3
probe o2_16l_mb1 --set model.n_layers=16 --set train.microbatches=1 --steps 4
probe o0_16l_mb1 --set model.n_layers=16 --set train.microbatches=1 --set train.opt_level=O0 --steps 4
probe o2_mb8_memory --memory-only
