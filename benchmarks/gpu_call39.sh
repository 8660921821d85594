#!/usr/bin/env bash
# Ran at commit a22dc24: the switches it sets (GRAD_BARRIER, GRAD_NORM_BARRIER) were experiment
# switches, removed once measured; `git checkout a22dc24` to run it again.
# Device call (1 GPU): the unrolled 1.3B step (B8, cuDNN attention; O0 saving GEMM outputs,
# O2 saving GEMM inputs and outputs) with its layer gradients assembled three ways:
# none (slices' transposes summed: the 20.9 ms pad-add + norm fusion of gpu_call36/38),
# stack (fp8jax.models.gpt.unstack_layers: stacked behind an optimization barrier), and
# none + a barrier before the gradient norm (fp8jax.train.step.GRAD_NORM_BARRIER).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--config configs/gpt_1_3b.yaml --set model.attention_impl=cudnn --set model.scan_layers=false"
O0="--level O0 --set model.remat_policy=save_gemm_outputs"
O2="--level O2 --set model.remat_policy=save_gemm_io"
prof() {  # prof ASSEMBLY NORM_BARRIER NAME ARGS...
  local assembly=$1 norm=$2 name=$3; shift 3
  timeout 150 python3 -c "import sys, runpy, fp8jax.models.gpt as g, fp8jax.train.step as s
g.GRAD_BARRIER = '$assembly'; s.GRAD_NORM_BARRIER = $norm
sys.argv = ['profile_step.py'] + sys.argv[1:]
runpy.run_path('benchmarks/profile_step.py', run_name='__main__')" "$@" > $OUT/$name.txt 2>&1
  echo "== $name"; grep -v -i warn $OUT/$name.txt | grep -A26 "GPU kernel time" | cut -c1-110
}
prof none False o0_none $S $O0 --top 18
prof stack False o0_stack $S $O0 --top 18
prof none False o2_none $S $O2 --top 18
prof stack False o2_stack $S $O2 --top 18
prof none True o0_norm $S $O0 --top 18
prof none True o2_norm $S $O2 --top 18
