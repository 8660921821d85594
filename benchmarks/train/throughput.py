"""Train-step throughput and memory of the reference decoder, each setting in its own process.

  python benchmarks/train/throughput.py --config configs/gpt_1_3b.yaml \
      --run O0=O0 --run O1=O1 --run "O2 io=O2,model.remat_policy=save_gemm_io" [--steps 10] \
      [--set model.attention_impl=cudnn ...]
  e.g. the fused FP8 cast kernel: --run O1=O1 --run "O1 fused=O1,fp8.fused_cast_transpose=true"

``fp8jax bench step`` times O0 against O2 at their best settings in one process; this script
times the same step (``fp8jax.bench.step.time_run``: the Trainer's step, uncalibrated first
where ``fp8.calibrate`` says so, then ``--steps`` timed steps, median) for any config and runs,
each ``--run LABEL=LEVEL[,key=value...]`` in its own subprocess, so the device's peak memory is
that run's alone. ``--set`` overrides apply to every run. Prints tokens/s, the ratio to the
first run, MFU (against the FP8 peak for FP8 levels, BF16 for O0), peak device memory and
compile + warm-up time and the model settings the Trainer chose for "auto"
(``fp8jax.train.build.choose_auto``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.common.isolated import run_isolated  # noqa: E402


def time_one(config_path: str, level: str, overrides: list[str], steps: int) -> dict:
  from fp8jax.bench.step import time_run
  from fp8jax.train import metrics as metrics_lib

  row = time_run(config_path, level, overrides, steps,
                 log=lambda m: print(m, file=sys.stderr, flush=True))
  return {**row, "compile_s": row["warmup_s"], **metrics_lib.memory_in_use()}


def parse_run(text: str) -> tuple[str, str, list[str]]:
  """'LABEL=LEVEL[,key=value...]' -> (label, level, overrides)."""
  label, sep, rest = text.partition("=")
  if not sep or not rest:
    raise SystemExit(f"--run {text!r}: use LABEL=LEVEL[,key=value...]")
  level, *overrides = rest.split(",")
  return label, level, overrides


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--run", action="append", default=[])
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: LEVEL
  a = p.parse_args()
  if a.one is not None:
    print("RESULT " + json.dumps(time_one(a.config, a.one, a.set, a.steps)), flush=True)
    return
  runs = [parse_run(r) for r in (a.run or ["O0=O0", "O1=O1"])]
  rows = []
  for label, level, overrides in runs:
    argv = ["--config", a.config, "--one", level, "--steps", str(a.steps)]
    for s in list(a.set) + overrides:
      argv += ["--set", s]
    result = run_isolated(__file__, argv, label)
    if result is None:
      continue
    rows.append({"label": label, **result})
    r = rows[-1]
    print(f"{label}: {r['ms']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, "
          f"compile {r['compile_s']:.0f} s" + (f"; {r['auto']}" if r["auto"] else ""),
          flush=True)
  if not rows:
    return
  base = rows[0]["tokens_per_s"]
  print(f"\nconfig {a.config} {' '.join(a.set)}")
  print(f"| run | batch | ms/step | tokens/s | x {rows[0]['label']} | MFU | peak GiB | loss |")
  print("|---|---|---|---|---|---|---|---|")
  for r in rows:
    mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "n/a"
    peak = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "n/a"
    print(f"| {r['label']} | {r['batch']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | "
          f"{r['tokens_per_s'] / base:.2f} | {mfu} | {peak} | {r['loss']:.3f} |")


if __name__ == "__main__":
  main()
