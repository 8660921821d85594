"""ZeRO-3 at O3 (FP8 GEMMs, FP8 weight all-gather, FP8/FP16 optimizer state) vs ZeRO-3 at O0
(BF16 GEMMs, f32 weights and Adam) on all local devices, side by side in one command.

  python benchmarks/zero_gpu.py [--config configs/gpt_1_3b.yaml] [--steps 10] [--set k=v ...]

GPU command (2 x H200): python benchmarks/zero_gpu.py --set data.max_bytes=16777216

FP8 gradient communication (parallel.grad_comm) side by side: `--levels O0,O3,O3:fp8` runs
O3 with grad_comm native ("O3") and fp8 ("O3:fp8", the shard_map step of
fp8jax.train.balanced); a level is LEVEL[:GRAD_COMM]. 2 x H200, well under 3 minutes:

  python benchmarks/zero_gpu.py --levels O0,O3,O3:fp8 --steps 5 --set data.max_bytes=16777216

Each level runs in its own subprocess (so peak memory is that level's own): one warm-up
step (compilation), then `--steps` timed steps (median, host clock around a blocking step).
Per level: tokens/s over all devices, ratio to O0, peak memory on device 0 (GiB), state MiB
per device (parameters + optimizer state), and the MiB the compiled step's collectives move
per step and device, by op and dtype
(result sizes from the optimized HLO; ops inside a loop with a known trip count counted that
many times).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "f8e4m3fn": 8, "f8e5m2": 8}


def _bytes(dtype: str, dims: str) -> int:
  bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype))
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n * bits // 8


def collective_bytes(hlo: str) -> dict[str, int]:
  """{"<kind> <dtype>": bytes per step and device} of the collectives in optimized HLO text."""
  comps, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line.strip())
    if m and not line.startswith(" "):
      name = m.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  mult = {n: 1 for n in comps}

  def visit(comp, factor, depth=0):
    for line in comps.get(comp, ()):
      w = re.search(r"while\(.*body=%?([\w.\-]+)", line)
      if w and depth < 8:
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        body = w.group(1)
        mult[body] = factor * (int(trip.group(1)) if trip else 1)
        visit(body, mult[body], depth + 1)
  entry = next((n for n in comps if n.startswith("main")), None)
  for line in hlo.splitlines():
    if line.startswith("ENTRY"):
      entry = re.match(r"ENTRY %?([\w.\-]+)", line).group(1)
  if entry:
    visit(entry, 1)
  out: dict[str, int] = {}
  for comp, lines in comps.items():
    for line in lines:
      m = re.search(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
      if not m:
        continue
      shapes = _SHAPE.findall(m.group(1))
      if not shapes:
        continue
      key = f"{m.group(2)} {shapes[-1][0]}"
      if m.group(2) == "all-to-all" and not m.group(3):  # a tuple of n received pieces
        size = sum(_bytes(dtype, dims) for dtype, dims in shapes)
      else:  # the result (for async starts: the last tuple element)
        size = _bytes(*shapes[-1])
      out[key] = out.get(key, 0) + size * mult.get(comp, 1)
  return out


def run_level(config: str, level: str, overrides: list[str], steps: int, stage: int = 3) -> dict:
  import jax
  import numpy as np

  from fp8jax import parallel
  from fp8jax.config import load_config
  from fp8jax.train import metrics as metrics_lib
  from fp8jax.train.loop import Trainer
  name = level
  level, _, grad_comm = level.partition(":")
  cfg = load_config(config, [f"train.opt_level={level}", f"parallel.zero_stage={stage}",
                             f"parallel.grad_comm={grad_comm or 'native'}"] + list(overrides))
  trainer = Trainer(cfg, progress=False)
  batch = trainer.next_batch(0)
  plan = trainer.zero
  if trainer.grad_comm == "fp8":
    jitted, place = trainer.fp8_step_parts(cfg.microbatches_at(0))
    placed = place(batch)
  else:
    jitted = plan.train_step(trainer.model.apply, trainer.tx, cfg.microbatches_at(0))
    placed = (plan.shard_batch(batch),)
  compiled = jitted.lower(trainer.state, *placed).compile()
  comm = collective_bytes(compiled.as_text())
  state = trainer.state
  state_bytes = max(parallel.device_bytes((state.params, state.opt_state)).values())
  state, m = compiled(state, *placed)
  jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = compiled(state, *placed)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  tokens = batch.shape[0] * (batch.shape[1] - 1)
  return {"level": name, "ms": 1e3 * float(np.median(times)),
          "tokens_per_s": tokens / float(np.median(times)), "loss": float(m["loss"]),
          "state_mib_per_device": state_bytes / 2**20, "collectives": comm,
          "devices": len(jax.devices()), "mesh": parallel.describe(plan.mesh),
          **metrics_lib.memory_in_use()}


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_1_3b.yaml"))
  p.add_argument("--levels", default="O0,O3")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one level, print JSON
  a = p.parse_args()
  if a.one:
    print("RESULT " + json.dumps(run_level(a.config, a.one, a.set, a.steps)), flush=True)
    return
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
  # NVLink multicast off (as benchmarks/run_gpu.sh), no preallocation (honest peak memory),
  # cuBLAS(Lt) for every GEMM (README's GPU notes); each unless already set.
  for k, v in (("NCCL_NVLS_ENABLE", "0"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
               ("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false")):
    env.setdefault(k, v)
  rows = []
  for level in a.levels.split(","):
    cmd = [sys.executable, __file__, "--one", level, "--config", a.config, "--steps",
           str(a.steps)] + [x for s in a.set for x in ("--set", s)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not lines:
      sys.exit(f"level {level} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows.append(json.loads(lines[-1][len("RESULT "):]))
  print(f"{rows[0]['mesh']}; ZeRO stage 3")
  base = rows[0]["tokens_per_s"]
  print(f"\n{'level':8s} {'ms/step':>9s} {'tokens/s':>11s} {'ratio':>6s} {'peak GiB':>9s} "
        f"{'state MiB/dev':>13s} {'comm MiB/step':>13s} {'loss':>7s}")
  for r in rows:
    peak = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "n/a"
    comm = sum(r["collectives"].values()) / 2**20
    print(f"{r['level']:8s} {r['ms']:9.1f} {r['tokens_per_s']:11,.0f} "
          f"{r['tokens_per_s'] / base:6.2f} {peak:>9s} {r['state_mib_per_device']:13.1f} "
          f"{comm:13.1f} {r['loss']:7.3f}")
  print("\ncollective bytes per step and device (MiB), by op and dtype:")
  for r in rows:
    parts = ", ".join(f"{k}: {v / 2**20:.1f}" for k, v in sorted(r["collectives"].items()))
    print(f"  {r['level']}: {parts}")


if __name__ == "__main__":
  main()
