# The environment of every GPU benchmark: `source benchmarks/gpu_env.sh` from the repo root
# before `python benchmarks/<group>/<name>.py` (run_gpu.sh sources it).
# NVLink multicast off (the device documentation requires it), this checkout on the path, no
# preallocation (peak-memory readings), cuBLAS(Lt) for every GEMM (no Triton autotuning).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export XLA_FLAGS=${XLA_FLAGS:---xla_gpu_enable_triton_gemm=false}
