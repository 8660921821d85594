#!/usr/bin/env bash
# Device call (1 GPU): a new way to spend O2's saved memory, measured
# against O0 with the same options (the best O0 setting that fits):
#  - model.remat_policy=save_gemm_outputs (no GEMM recomputed in the backward),
#    at the 7B-class layer shape and at 1.3B (FP8 weights cast once per step: gpu_call22.sh);
#  - model.fuse_gelu_into_fp8_cast (GELU inside fc_out's fused FP8 cast) at 1.3B;
# first the GPU tests (the GELU kernel through Triton).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--set model.attention_impl=cudnn"
SAVE="model.remat_policy=save_gemm_outputs"
GELU="model.fuse_gelu_into_fp8_cast=true"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -4
timeout 190 python3 benchmarks/train_throughput.py --config configs/gpt_7b.yaml --steps 4 $S \
  --set model.n_layers=8 --set train.microbatches=1 --run "O0=O0" --run "O0 saved=O0,$SAVE" \
  --run "O2=O2" --run "O2 saved=O2,$SAVE" --run "O2 B16 saved=O2,$SAVE,train.batch_size=16" \
  2>&1 | grep -v -i "warn" | tee $OUT/save7x8.txt | tail -8
timeout 260 python3 benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --steps 4 $S \
  --run "O0=O0" --run "O0 saved=O0,$SAVE" --run "O1=O1" --run "O1 fused GELU=O1,$GELU" \
  --run "O2 saved=O2,$SAVE" --run "O2 saved, fused GELU=O2,$SAVE,$GELU" 2>&1 \
  | grep -v -i "warn" | tee $OUT/save13.txt | tail -9
