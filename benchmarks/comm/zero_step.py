"""The ZeRO train step on all local devices, several configs side by side: O3 (FP8 GEMMs, FP8
weight all-gather, FP8/FP16 optimizer state) vs O0 (BF16 GEMMs, f32 weights and Adam), and
FP8 vs native gradient communication (parallel.grad_comm). Several GPUs.

  python benchmarks/comm/zero_step.py [--config configs/gpt_1_3b.yaml] [--levels O0,O3]
      [--stage 3] [--steps 10] [--set k=v ...]

A level is LEVEL[:GRAD_COMM]: "O3" runs with parallel.grad_comm=native, "O3:fp8" with
parallel.grad_comm=fp8 (weight gradients reduce-scattered as FP8 all-to-all + local f32 sum).
FP8 vs native gradient communication at 1.3B, 2 x H200 (well under 3 minutes):

  python benchmarks/comm/zero_step.py --levels O0,O3,O3:fp8 --steps 5 \
      --set data.max_bytes=16777216

Each level is its own Trainer config (train.opt_level, parallel.zero_stage, parallel.grad_comm)
in its own subprocess (so peak memory is that level's own), run through ``trainer.step_fn``:
two warm-up steps (compilation; the first may run the uncalibrated model), then `--steps`
timed steps (median, host clock around a blocking step). Per level: tokens/s over all
devices, ratio to the first level, MFU against the BF16 peak, peak memory on device 0 (GiB),
state MiB per device (parameters + optimizer state), and the MiB the compiled steady step's
collectives move per step and device, by op and dtype (result sizes from the optimized HLO of
``trainer.compiled_step``; ops inside a loop with a known trip count counted that many times).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.common.hlo import collective_bytes  # noqa: E402


def device_bytes(tree) -> dict:
  """{device: bytes of `tree`'s shards it holds} over this process's devices."""
  import jax
  out: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in getattr(leaf, "addressable_shards", ()):
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def run_level(config: str, level: str, overrides: list[str], steps: int, stage: int = 3,
              comm: bool = True) -> dict:
  """One Trainer config, timed through ``trainer.step_fn``; `level` is LEVEL[:GRAD_COMM]."""
  import jax
  import numpy as np

  from fp8jax.config import load_config
  from fp8jax.train import metrics as metrics_lib
  from fp8jax.train.loop import Trainer
  name = level
  level, _, grad_comm = level.partition(":")
  cfg = load_config(config, [f"train.opt_level={level}", f"parallel.zero_stage={stage}",
                             f"parallel.grad_comm={grad_comm or 'native'}"] + list(overrides))
  trainer = Trainer(cfg, progress=False)
  batch = trainer.next_batch(0)
  microbatches = cfg.microbatches_at(0)
  state = trainer.state
  state_bytes = max(device_bytes((state.params, state.opt_state)).values())
  collectives = {}
  if comm:  # the steady step's collectives (the same in the uncalibrated first step)
    step = trainer.compiled_step(microbatches, calibrated=True)
    collectives = collective_bytes(
        step.jitted.lower(state, *step.place(batch)).compile().as_text())
  run = trainer.step_fn(microbatches)
  for _ in range(2):  # compiles; with fp8.calibrate the first step's model, then the steady one
    state, m = run(state, batch)
    jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = run(state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  tokens = batch.shape[0] * (batch.shape[1] - 1)
  tps = tokens / float(np.median(times))
  return {"level": name, "ms": 1e3 * float(np.median(times)), "tokens_per_s": tps,
          "loss": float(m["loss"]), "state_mib_per_device": state_bytes / 2**20,
          "collectives": collectives, "devices": len(jax.devices()),
          "mfu": metrics_lib.mfu(trainer.flops_per_token, tps, False),
          **metrics_lib.memory_in_use()}


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_1_3b.yaml"))
  p.add_argument("--levels", default="O0,O3", help="LEVEL[:GRAD_COMM], comma separated")
  p.add_argument("--stage", type=int, default=3, help="parallel.zero_stage")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--no-comm", action="store_true",
                 help="skip the collective bytes (no extra compile of the steady step)")
  p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one level, print JSON
  a = p.parse_args()
  if a.one:
    print("RESULT " + json.dumps(run_level(a.config, a.one, a.set, a.steps, a.stage,
                                                    not a.no_comm)),
          flush=True)
    return
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
  # NVLink multicast off, no preallocation (honest peak memory), cuBLAS(Lt) for every GEMM
  # (as benchmarks/gpu_env.sh); each unless already set.
  for k, v in (("NCCL_NVLS_ENABLE", "0"), ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
               ("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false")):
    env.setdefault(k, v)
  rows = []
  for level in a.levels.split(","):
    cmd = [sys.executable, __file__, "--one", level, "--config", a.config, "--steps",
           str(a.steps), "--stage", str(a.stage)] + [x for s in a.set for x in ("--set", s)]
    cmd += ["--no-comm"] if a.no_comm else []
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
    if out.returncode or not lines:
      sys.exit(f"level {level} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    rows.append(json.loads(lines[-1][len("RESULT "):]))
  print(f"{rows[0]['devices']} devices; ZeRO stage {a.stage}")
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
