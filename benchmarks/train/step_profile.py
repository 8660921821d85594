"""Where a train step's GPU time goes: kernel time by category and the top kernels.

  python benchmarks/profile_step.py --config configs/gpt_1_3b.yaml --level O1 [--steps 3] \
      [--set model.n_layers=4 ...] [--trace-dir DIR]

Builds the Trainer of the config at the level, compiles and warms up one step, then records
`--steps` steps with ``jax.profiler.trace`` (Perfetto JSON) and sums the GPU kernels' durations
per step: GEMMs (cuBLAS/cuBLASLt), attention (cuDNN), collectives, and XLA fusions split by
name (convert = casts, reduce = amax and norms). Prints ms per step per category and the top
kernels, so a change can be judged by which category moved.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import tempfile

import jax

from fp8jax.config import load_config
from fp8jax.train.loop import Trainer

CATEGORIES = (  # first match wins
    ("attention", re.compile(r"fmha|flash|cudnn|attn|sdpa", re.I)),  # before gemm: cuDNN's
    ("gemm", re.compile(r"gemm|cublas|nvjet|xmma|cutlass|matmul|sm\d\d_", re.I)),  # "wgmma"
    ("collective", re.compile(r"nccl|all_reduce|all_gather|reduce_scatter", re.I)),
    ("fp8 cast kernel", re.compile(r"fp8_cast_transpose_amax")),  # before copy/transpose
    ("fusion:reduce", re.compile(r"reduce", re.I)),
    ("fusion:convert", re.compile(r"convert", re.I)),
    ("copy/transpose", re.compile(r"copy|transpose|memcpy|memset", re.I)),
    ("other", re.compile(r".")),
)


def category(name: str) -> str:
  return next(c for c, rx in CATEGORIES if rx.search(name))


def gpu_kernels(trace_path: str) -> list[tuple[str, float]]:
  """(kernel name, duration in us) of every event on a GPU device in a Perfetto trace."""
  with gzip.open(trace_path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
  if not gpu:
    print(f"no GPU process in the trace; processes: {sorted(set(names.values()))}")
  return [(e["name"], float(e["dur"]), e.get("args", {})) for e in events
          if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]


def summarize(kernels, steps: int, top: int = 25) -> None:
  by_cat, by_name, calls = collections.Counter(), collections.Counter(), collections.Counter()
  copies = []
  for name, us, args in kernels:
    by_cat[category(name)] += us
    by_name[name] += us
    calls[name] += 1
    if "memcpy" in name.lower():
      copies.append((us, args))
  total = sum(by_cat.values())
  print(f"\nGPU kernel time per step: {total / steps / 1e3:.2f} ms")
  for c, us in by_cat.most_common():
    print(f"  {c:16s} {us / steps / 1e3:9.2f} ms  {100 * us / total:5.1f}%")
  print(f"\ntop {top} kernels (ms per step, calls per step):")
  for n, us in by_name.most_common(top):
    print(f"  {us / steps / 1e3:8.3f} {calls[n] / steps:6.1f}  [{category(n)}] {n[:100]}")
  if copies:  # device copies by the HLO op that issued them (the trace's "hlo_op")
    by_op, n_op = collections.Counter(), collections.Counter()
    for us, args in copies:
      by_op[args.get("hlo_op", "?")] += us
      n_op[args.get("hlo_op", "?")] += 1
    print("\nmemcpy by HLO op (ms per step, calls per step):")
    for op, us in by_op.most_common(12):
      print(f"  {us / steps / 1e3:8.3f} {n_op[op] / steps:6.1f}  {op[:100]}")


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--level", default="O1")
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--trace-dir", default=None)
  p.add_argument("--top", type=int, default=25, help="how many of the largest kernels to list")
  p.add_argument("--dump-hlo", default=None, metavar="PATH", help="write the compiled step here")
  a = p.parse_args()
  cfg = load_config(a.config, list(a.set) + [f"train.opt_level={a.level}"])
  trainer = Trainer(cfg, progress=False)
  batch = trainer.next_batch(0)
  step = trainer.step_fn(cfg.microbatches_at(0))
  for _ in range(2):  # the first step may run the uncalibrated model (fp8.calibrate)
    trainer.state, m = step(trainer.state, batch)
  jax.block_until_ready(m)
  if a.dump_hlo:  # the steady step (single-device runs: a jitted function)
    jitted = trainer._compiled_step(cfg.microbatches_at(0), bool(trainer._uncalibrated))
    with open(a.dump_hlo, "w") as f:
      f.write(jitted.lower(trainer.state, batch).compile().as_text())
  trace_dir = a.trace_dir or tempfile.mkdtemp(prefix="fp8jax_trace_")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    for _ in range(a.steps):
      trainer.state, m = step(trainer.state, batch)
    jax.block_until_ready(m)
  paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  if not paths:
    raise SystemExit(f"no perfetto_trace.json.gz under {trace_dir}")
  print(f"{a.config} level {a.level} {' '.join(a.set)}")
  summarize(gpu_kernels(max(paths, key=os.path.getmtime)), a.steps, a.top)


if __name__ == "__main__":
  main()
