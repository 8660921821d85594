#!/usr/bin/env bash
# Device call (1 GPU), next to run: what the unrolled 1.3B O0 step's 20.9 ms once-per-step
# `input_add_reduce_fusion` is (gpu_call36). Profiles O0 saved unrolled with the compiled step
# dumped, then prints, for every kernel that runs at most once per step and takes > 2 ms, its
# HLO instruction (shapes, operands, the JAX op in its metadata).
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
timeout 120 python3 benchmarks/profile_step.py --config configs/gpt_1_3b.yaml --level O0 \
  --set model.attention_impl=cudnn --set model.scan_layers=false \
  --set model.remat_policy=save_gemm_outputs --top 40 --dump-hlo $OUT/o0_unrolled.hlo \
  > $OUT/profile_O0.txt 2>&1
grep -v -i warn $OUT/profile_O0.txt | grep -A12 "GPU kernel time"
python3 - $OUT/profile_O0.txt $OUT/o0_unrolled.hlo <<'PY'
import re, sys
prof, hlo = open(sys.argv[1]).read(), open(sys.argv[2]).read().splitlines()
for ms, calls, name in re.findall(r"^\s+([\d.]+)\s+([\d.]+)\s+\[[^\]]+\] (\S+)", prof, re.M):
  if float(calls) <= 1 and float(ms) > 2:
    hlo_name = re.sub(r"_(\d+)$", r".\1", name)
    print(f"== {name}: {ms} ms, {calls} calls per step")
    for line in hlo:
      if re.match(rf"\s*(ROOT )?%({re.escape(name)}|{re.escape(hlo_name)}) = ", line):
        print(line.strip()[:1500])
PY
