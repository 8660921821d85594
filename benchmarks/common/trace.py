"""GPU kernel time from ``jax.profiler`` traces: kernels by name and category, and the time the
GPU sat idle between them."""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import tempfile
from typing import NamedTuple

import jax

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
  """The category of a GPU kernel name (first match of CATEGORIES)."""
  return next(c for c, rx in CATEGORIES if rx.search(name))


class Kernel(NamedTuple):
  """One GPU event of a trace: its name, duration (us), event args and start (us, trace clock)."""
  name: str
  us: float
  args: dict
  start: float


def gpu_kernels(trace_path: str) -> list[Kernel]:
  """Every event on a GPU device in a Perfetto trace (``perfetto_trace.json.gz``)."""
  with gzip.open(trace_path, "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
  if not gpu:
    print(f"no GPU process in the trace; processes: {sorted(set(names.values()))}")
  return [Kernel(e["name"], float(e["dur"]), e.get("args", {}), float(e["ts"])) for e in events
          if e.get("ph") == "X" and e.get("pid") in gpu and "dur" in e]


def traced_kernels(fn, calls: int, trace_dir: str | None = None):
  """(last output, GPU kernels) of `calls` calls of ``fn()`` run under ``jax.profiler.trace``
  (into `trace_dir`, or a temporary folder that is deleted afterwards). ``fn`` takes no
  arguments; carry state through a closure."""
  def record(d):
    out = None
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(calls):
        out = fn()
      jax.block_until_ready(out)
    paths = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
      raise SystemExit(f"no perfetto_trace.json.gz under {d}")
    return out, gpu_kernels(max(paths, key=os.path.getmtime))
  if trace_dir is not None:
    return record(trace_dir)
  with tempfile.TemporaryDirectory() as d:
    return record(d)


def kernel_ms(kernels, calls: int) -> float:
  """Summed GPU kernel time per call, ms."""
  return sum(k.us for k in kernels) / calls / 1e3


def busy_and_span_us(kernels) -> tuple[float, float]:
  """(busy, span) in us: the time at least one kernel ran (kernels overlapping on several
  streams count once) and the time from the first kernel's start to the last one's end.
  span - busy is the time the GPU sat idle between the traced kernels."""
  if not kernels:
    return 0.0, 0.0
  first, *rest = sorted(kernels, key=lambda k: k.start)
  busy, run_start, run_end = 0.0, first.start, first.start + first.us  # the current busy run
  for k in rest:
    if k.start > run_end:  # a gap: close the run
      busy += run_end - run_start
      run_start, run_end = k.start, k.start + k.us
    else:
      run_end = max(run_end, k.start + k.us)
  return busy + run_end - run_start, run_end - first.start


def summarize(kernels, steps: int, top: int = 25) -> None:
  """Prints kernel time per step (and the GPU's busy time, span and idle time per step) by
  category, the `top` kernels and device copies by HLO op."""
  by_cat, by_name, calls = collections.Counter(), collections.Counter(), collections.Counter()
  copies = []
  for name, us, args, _ in kernels:
    by_cat[category(name)] += us
    by_name[name] += us
    calls[name] += 1
    if "memcpy" in name.lower():
      copies.append((us, args))
  total = sum(by_cat.values())
  busy, span = busy_and_span_us(kernels)
  print(f"\nGPU kernel time per step: {total / steps / 1e3:.2f} ms (busy {busy / steps / 1e3:.2f} "
        f"of a {span / steps / 1e3:.2f} ms span: idle {(span - busy) / steps / 1e3:.2f} ms)")
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
