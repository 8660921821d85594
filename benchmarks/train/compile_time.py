"""Compile time of a run per level: what ``fp8jax train`` compiles before and during its first
steps, program by program, each level in its own process.

  python benchmarks/train/compile_time.py --config configs/gpt_125m.yaml \
      [--levels O0,O1,O2,O3] [--steps 2] [--cached] [--set key=value ...]

Each level runs the Trainer (``fp8jax.train.loop.Trainer``) on the config for ``--steps`` steps
with an evaluation and an FP8 health probe at the last step (``train.eval_every`` and
``train.fp8_health_every`` set to ``--steps``, ``train.eval_batches=1``, no checkpoints; a
``--set`` of these keys wins, e.g. ``train.fp8_health_every=0``: no health probe), in a
fresh subprocess with the persistent compilation cache off (``runtime.compile_cache=false``:
every program compiles; with ``--cached``, see below). ``fp8jax.train.compiles.CompileLog``
records every compile request (``jax.monitoring``); the table gives, per level, the seconds and
count of the train step's compiles, the FP8 calibration pass's, the FP8 cast-health probe's,
the evaluation step's, the rest (state initialisation, small eager programs), their
total, the seconds from the Trainer's construction to the end of its first step (what ``fp8jax
train`` prints as "first step done") and the wall time from the Trainer's construction to the
end of the run; below the table, where each first step's wait went (``fp8jax.train.startup``:
compiling, tracing, set-up, data, state, calibration, the step). ``--cached``: the cold run
fills a fresh cache folder (as a user's first run does: the cache is on by default) and a second
run loads its programs from it (the "cached" columns: first-step seconds, wall time and compile
seconds of that run). ``--json PATH`` writes the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.common.isolated import run_isolated  # noqa: E402
from fp8jax.train.startup import describe  # noqa: E402

PROGRAMS = ("train_step", "fp8_calibration", "fp8_probe", "eval_step")


def run_one(config: str, level: str, overrides: list[str], steps: int,
            cache: str | None) -> dict:
  """One run of `level` in this process: seconds and counts per program, wall seconds."""
  from fp8jax.config import load_config
  from fp8jax.train.compiles import CompileLog
  from fp8jax.train.loop import Trainer

  with tempfile.TemporaryDirectory() as run_dir:
    cfg = load_config(config, [  # --set may change these
        f"train.steps={steps}", f"train.eval_every={steps}", f"train.fp8_health_every={steps}",
        "train.eval_batches=1", f"train.log_every={steps}",
        "checkpoint.checkpoint_every_n_steps=0"] + list(overrides) + [
        f"train.opt_level={level}", f"runtime.run_dir={run_dir}",
        f"runtime.compile_cache={cache or 'false'}"])
    t0 = time.perf_counter()
    with CompileLog() as log:
      final = Trainer(cfg, progress=False).run()
    wall = time.perf_counter() - t0
  row = {"level": level, "wall_s": wall, "first_step_s": final["first_step_s"],
         "startup": final["startup"],
         "compile_s": log.seconds(),
         "cache_hits": sum(c.cached for c in log.compiles)}
  for name in PROGRAMS:
    row[f"{name}_s"], row[f"{name}_n"] = log.seconds(name), len(log.of(name))
  row["other_s"] = row["compile_s"] - sum(row[f"{n}_s"] for n in PROGRAMS)
  return row


def subprocess_run(args, level: str, cache: str | None) -> dict | None:
  argv = ["--config", args.config, "--one", level, "--steps", str(args.steps)] + (
      ["--cache-dir", cache] if cache else [])
  for s in args.set:
    argv += ["--set", s]
  return run_isolated(__file__, argv, level)


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--levels", default="O0,O1,O2,O3")
  p.add_argument("--steps", type=int, default=2)
  p.add_argument("--cached", action="store_true", help="also time a run from a warm cache")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--json", default=None)
  p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: LEVEL
  p.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.one is not None:
    row = run_one(a.config, a.one, a.set, a.steps, a.cache_dir)
    print("RESULT " + json.dumps(row), flush=True)
    return
  rows = []
  for level in a.levels.split(","):
    with tempfile.TemporaryDirectory() as cache:
      row = subprocess_run(a, level, cache if a.cached else None)  # fills the cache
      warm = subprocess_run(a, level, cache) if a.cached and row is not None else None
    if row is None:
      continue
    if warm is not None:
      row.update(cached_wall_s=warm["wall_s"], cached_compile_s=warm["compile_s"],
                 cached_hits=warm["cache_hits"], cached_first_step_s=warm["first_step_s"],
                 cached_startup=warm["startup"])
    rows.append(row)
    print(f"{level}: train step {row['train_step_s']:.1f} s x{row['train_step_n']}, "
          f"calibration {row['fp8_calibration_s']:.1f} s x{row['fp8_calibration_n']}, probe "
          f"{row['fp8_probe_s']:.1f} s x{row['fp8_probe_n']}, eval {row['eval_step_s']:.1f} s "
          f"x{row['eval_step_n']}, other {row['other_s']:.1f} s; compiles {row['compile_s']:.1f}"
          f" s of {row['wall_s']:.1f} s wall", flush=True)
  print(f"\nconfig {a.config} {' '.join(a.set)}, {a.steps} steps, "
        + ("cold: an empty cache" if a.cached else "cache off"))
  head = "| level | train step s (n) | calibration s (n) | FP8 probe s (n) | eval step s (n) |" \
         " other s | compile s |" \
         " first step s | wall s |" + (
             " cached first step s | cached wall s | cached compile s |" if a.cached else "")
  print(head)
  print("|" + "---|" * (head.count("|") - 1))
  for r in rows:
    line = (f"| {r['level']} | {r['train_step_s']:.1f} ({r['train_step_n']}) | "
            f"{r['fp8_calibration_s']:.1f} ({r['fp8_calibration_n']}) | "
            f"{r['fp8_probe_s']:.1f} ({r['fp8_probe_n']}) | {r['eval_step_s']:.1f} "
            f"({r['eval_step_n']}) | {r['other_s']:.1f} | {r['compile_s']:.1f} | "
            f"{r['first_step_s']:.1f} | {r['wall_s']:.1f} |")
    if a.cached:
      line += (f" {r.get('cached_first_step_s', float('nan')):.1f} | "
               f"{r.get('cached_wall_s', float('nan')):.1f} | "
               f"{r.get('cached_compile_s', float('nan')):.1f} |")
    print(line)
  for r in rows:
    print(f"{r['level']} first step, cold: {describe(r['startup'])}")
    if "cached_startup" in r:
      print(f"{r['level']} first step, cached: {describe(r['cached_startup'])}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"config": a.config, "set": a.set, "steps": a.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  main()
