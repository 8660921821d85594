#!/usr/bin/env bash
# The 125M O0-vs-O2 loss curves: two runs of configs/gpt_125m.yaml side by side, one per GPU
# (or one after the other with one GPU), then their plot.
# Usage (repo root, on the GPU machine): bash benchmarks/train/loss_curves.sh [STEPS] [OUTDIR]
set -u
STEPS=${1:-2000}; OUTDIR=${2:-runs/curves_125m}
. benchmarks/gpu_env.sh
NGPU=$(nvidia-smi -L | wc -l)
run() {  # level gpu
  CUDA_VISIBLE_DEVICES=$2 python3 -m fp8jax.cli train --config configs/gpt_125m.yaml \
    --set train.opt_level=$1 --set train.steps=$STEPS --set model.attention_impl=cudnn \
    --set runtime.run_dir=$OUTDIR/$1 --no-progress --overwrite > $OUTDIR/$1.log 2>&1
}
mkdir -p $OUTDIR
if [ "$NGPU" -ge 2 ]; then run O0 0 & run O2 1 & wait; else run O0 0; run O2 0; fi
tail -2 $OUTDIR/O0.log $OUTDIR/O2.log
python3 -m fp8jax.cli plot $OUTDIR/O0 $OUTDIR/O2 -o $OUTDIR/curves_125m_O0_vs_O2.png
