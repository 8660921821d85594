#!/usr/bin/env bash
# Device call (2 GPUs): heterogeneous-mesh inputs and checks. GPU 0: O0 vs O1 native vs O1
# emulated at 1.3B (the emulation overhead of a pre-Ada GPU); GPU 1 at the same time: a 1.3B O2
# throughput profile; then both GPUs: balanced vs uniform microbatches, measured vs predicted,
# homogeneous (repeats 0,0) and with GPU 0 slowed to half speed (repeats 1,0).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L
CUDA_VISIBLE_DEVICES=0 timeout 260 python3 benchmarks/hetero_gpu.py emulation \
  --config configs/gpt_1_3b.yaml --set model.attention_impl=cudnn --microbatch 8 --steps 5 \
  --out $OUT/emulation.json > $OUT/emulation.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 timeout 260 python3 -m fp8jax.cli profile --config configs/gpt_1_3b.yaml \
  --set model.attention_impl=cudnn --set train.opt_level=O2 --sizes 1,2,4,8,16 --steps 3 \
  --out $OUT/h200-1_3b-O2.json > $OUT/profile.txt 2>&1 &
wait
tail -8 $OUT/emulation.txt; tail -8 $OUT/profile.txt
for r in 0,0 1,0; do
  timeout 150 python3 benchmarks/hetero_gpu.py balance --config configs/gpt_125m.yaml \
    --set model.attention_impl=cudnn --microbatch 8 --total 8 --repeats $r --steps 3 \
    --out $OUT/balance_${r/,/_}.json > $OUT/balance_${r/,/_}.txt 2>&1
  tail -7 $OUT/balance_${r/,/_}.txt
done
