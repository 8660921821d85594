#!/usr/bin/env bash
# One device call: the MLP-block benchmark, the GPU tests and `fp8jax check`.
# Usage (repo root, on the GPU machine): bash benchmarks/run_gpu.sh [extra `fp8jax bench mlp` args]
set -u
. benchmarks/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 -m fp8jax.cli bench mlp --plain "$@" 2>&1 | grep -v "^fp8jax: FP8 GEMMs emulated"
GPU_TESTS=tests/gpu/test_gpu.py; [ -e "$GPU_TESTS" ] || GPU_TESTS=tests/gpu
python3 -m pytest -q -p no:cacheprovider "$GPU_TESTS" 2>&1 | tail -5
python3 -m fp8jax.cli check
