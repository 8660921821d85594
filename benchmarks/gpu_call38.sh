#!/usr/bin/env bash
# Ran at commit 824d625: the switch it sets (GRAD_BARRIER) was an experiment switch, removed
# once measured; `git checkout 824d625` to run it again.
# Device call (1 GPU): the unrolled 1.3B O0 step's 20.9 ms once-per-step fusion (gpu_call36):
# its HLO, and the step with and without an optimization barrier on
# each layer's parameter gradient (fp8jax.models.gpt.GRAD_BARRIER), O0 and O2 at B8.
set -u
. benchmarks/gpu_env.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
S="--config configs/gpt_1_3b.yaml --set model.attention_impl=cudnn --set model.scan_layers=false"
prof() {  # prof BARRIER NAME ARGS...: profile_step with the switch set
  local barrier=$1 name=$2; shift 2
  timeout 170 python3 -c "import sys, runpy, fp8jax.models.gpt as g; g.GRAD_BARRIER = $barrier
sys.argv = ['profile_step.py'] + sys.argv[1:]
runpy.run_path('benchmarks/profile_step.py', run_name='__main__')" "$@" > $OUT/$name.txt 2>&1
  echo "== $name"; grep -v -i warn $OUT/$name.txt | grep -A14 "GPU kernel time"
}
prof False o0_off $S --level O0 --set model.remat_policy=save_gemm_outputs --top 40 \
  --dump-hlo $OUT/o0_off.hlo
python3 - $OUT/o0_off.txt $OUT/o0_off.hlo <<'PY'
import re, sys
prof, hlo = open(sys.argv[1]).read(), open(sys.argv[2]).read().splitlines()
for ms, calls, name in re.findall(r"^\s+([\d.]+)\s+([\d.]+)\s+\[[^\]]+\] (\S+)", prof, re.M):
  if float(calls) <= 1 and float(ms) > 2:
    hlo_name = re.sub(r"_(\d+)$", r".\1", name)
    print(f"== {name}: {ms} ms, {calls} calls per step")
    for line in hlo:
      if re.match(rf"\s*(ROOT )?%({re.escape(name)}|{re.escape(hlo_name)}) = ", line):
        print(line.strip()[:2500])
        for called in re.findall(r"calls=%([\w.\-]+)", line)[:1]:  # the fused computation
          start = next(i for i, l in enumerate(hlo) if re.match(rf"%?{re.escape(called)} ", l))
          end = next(i for i in range(start, len(hlo)) if hlo[i].startswith("}"))
          body = hlo[start:end + 1]
          print(f"-- {called}: {len(body)} lines")
          for l in body[:60] + (["..."] + body[-25:] if len(body) > 85 else body[60:]):
            print("   " + l.strip()[:400])
PY
prof True o0_on $S --level O0 --set model.remat_policy=save_gemm_outputs --top 12
prof True o2_on $S --level O2 --set model.remat_policy=save_gemm_io --top 12
