"""Compile time and size of the train step alone, per level or variant: the seconds to trace
and lower the calibrated step, the seconds XLA takes to compile it, and its optimized HLO's
fusion count (and how many of them write at most 64 elements).

  python benchmarks/train/step_compile.py --config configs/gpt_125m.yaml \
      [--run O0=O0 --run O2=O2 --run "O2 hist1=O2,fp8.amax_history_len=1"] [--rounds 5] \
      [--set key=value ...]

Each ``--run LABEL=LEVEL[,key=value...]`` is measured in its own process
(``benchmarks.common.isolated``: no compile cache, no autotuning or kernel results shared
between variants), the runs interleaved over ``--rounds`` rounds so that a machine's drift
reaches every variant alike; the table gives the median and range per run and its median
against the first run's. The step is the Trainer's (``fp8jax.train.loop.Trainer``), calibrated
(``compiled_step(1, calibrated=True)``), on its first batch, with the persistent compilation
cache off. Default settings (``--set`` adds to them): unrolled layers, saved GEMM outputs, one
sequence, one microbatch, 4 MB of the stdlib corpus (seconds on a CPU; the compile time of
these programs does not depend on the batch's contents).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.common.isolated import run_isolated  # noqa: E402

SETTINGS = ("model.scan_layers=false", "model.remat_policy=save_gemm_outputs",
            "train.batch_size=1", "train.microbatches=1", "data.source=stdlib",
            "data.max_bytes=4000000", "train.eval_every=0", "fp8.calibrate=always",
            "runtime.compile_cache=false")
SMALL = 64  # a fusion writing at most this many elements counts as small
_FUSION = re.compile(r"^\s*(?:ROOT )?\S+ = (.+?) fusion\(", re.M)


def _largest_output(shape: str) -> int:
  """The element count of the largest array in an HLO shape string (a tuple or one array)."""
  dims = re.findall(r"\[([\d,]*)\]", shape)
  return max([1] + [math.prod(int(n) for n in d.split(",") if n) for d in dims])


def measure(config: str, level: str, sets: list[str]) -> dict:
  """One variant in this process: {lower_s, compile_s, fusions, small_fusions}."""
  from fp8jax.config import load_config
  from fp8jax.train.loop import Trainer

  with tempfile.TemporaryDirectory() as run_dir:
    cfg = load_config(config, list(SETTINGS) + sets + [
        f"train.opt_level={level}", f"runtime.run_dir={run_dir}"])
    trainer = Trainer(cfg, progress=False)
    step = trainer.compiled_step(1, calibrated=True)
    t0 = time.perf_counter()
    lowered = step.lower(trainer.state, trainer.next_batch(0))
    t1 = time.perf_counter()
    text = lowered.compile().as_text()
    t2 = time.perf_counter()
  outputs = [_largest_output(s) for s in _FUSION.findall(text)]
  return {"lower_s": t1 - t0, "compile_s": t2 - t1, "fusions": len(outputs),
          "small_fusions": sum(n <= SMALL for n in outputs)}


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/gpt_125m.yaml")
  p.add_argument("--run", action="append", default=[], metavar="LABEL=LEVEL[,K=V...]")
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: LEVEL[,K=V...]
  a = p.parse_args()
  if a.one is not None:
    level, *sets = a.one.split(",")
    print("RESULT " + json.dumps(measure(a.config, level, a.set + sets)), flush=True)
    return
  runs = [r.partition("=")[::2] for r in (a.run or ["O0=O0", "O2=O2"])]
  rows: dict[str, list[dict]] = {label: [] for label, _ in runs}
  for r in range(a.rounds):
    for label, spec in runs:
      argv = ["--config", a.config, "--one", spec] + [x for s in a.set for x in ("--set", s)]
      res = run_isolated(os.path.abspath(__file__), argv, label)
      if res is not None:
        rows[label].append(res)
        print(f"round {r + 1} {label}: compile {res['compile_s']:.2f} s, lower "
              f"{res['lower_s']:.2f} s, {res['fusions']} fusions", flush=True)
  base = statistics.median(x["compile_s"] for x in rows[runs[0][0]]) if rows[runs[0][0]] else None
  print(f"\n{a.config}, {a.rounds} rounds, settings: {' '.join(SETTINGS + tuple(a.set))}\n")
  print("| step | compile s (median) | range | x first | lower s (median) | fusions | "
        f"<= {SMALL} elements |")
  print("|---|---|---|---|---|---|---|")
  for label, spec in runs:
    got = rows[label]
    if not got:
      print(f"| {label} ({spec}) | failed | | | | | |")
      continue
    c = [x["compile_s"] for x in got]
    ratio = f"{statistics.median(c) / base:.2f}" if base else "-"
    print(f"| {label} ({spec}) | {statistics.median(c):.2f} | {min(c):.2f}-{max(c):.2f} | "
          f"{ratio} | {statistics.median(x['lower_s'] for x in got):.2f} | "
          f"{got[-1]['fusions']:,} | {got[-1]['small_fusions']:,} |")


if __name__ == "__main__":
  main()
