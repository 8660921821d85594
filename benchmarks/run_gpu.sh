#!/usr/bin/env bash
# One device call: the MLP-block benchmark, the GPU tests and `fp8jax check`.
# Usage (repo root, on the GPU machine): bash benchmarks/run_gpu.sh [extra mlp_block args]
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_FLAGS=${XLA_FLAGS:---xla_gpu_enable_triton_gemm=false}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv
python3 benchmarks/mlp_block.py "$@" 2>&1 | grep -v "^fp8jax: FP8 GEMMs emulated"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py 2>&1 | tail -5
python3 -m fp8jax.cli check
