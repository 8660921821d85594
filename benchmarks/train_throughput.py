"""Train-step throughput and memory of the reference decoder at several levels, side by side.

  python benchmarks/train_throughput.py --config configs/gpt_1_3b.yaml --levels O0,O1 \
      [--steps 10] [--set model.n_layers=8 ...]

Each level builds the trainer of the same config (same data, same batch), runs one warm-up
step (compilation), then times `--steps` steps (median, host clock around a blocking step).
Prints tokens/s, ratio to the first level, MFU and device memory (peak) per level.
"""
from __future__ import annotations

import argparse
import gc
import time

import jax
import numpy as np

from fp8jax.config import load_config
from fp8jax.train import metrics as metrics_lib
from fp8jax.train.loop import Trainer


def time_level(config_path: str, level: str, overrides: list[str], steps: int) -> dict:
  cfg = load_config(config_path, list(overrides) + [f"train.opt_level={level}"])
  trainer = Trainer(cfg, progress=False)
  batch = trainer.next_batch(0)
  step = trainer.step_fn(cfg.microbatches_at(0))
  trainer.state, m = step(trainer.state, batch)
  jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    trainer.state, m = step(trainer.state, batch)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  tokens = batch.shape[0] * (batch.shape[1] - 1)
  tps = tokens / float(np.median(times))
  out = {"level": level, "ms": 1e3 * float(np.median(times)), "tokens_per_s": tps,
         "mfu": metrics_lib.mfu(trainer.flops_per_token, tps, trainer.fp8_peak),
         "loss": float(m["loss"]), **metrics_lib.memory_in_use()}
  del trainer, step
  gc.collect()
  return out


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--levels", default="O0,O1")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--set", action="append", default=[])
  a = p.parse_args()
  print(f"devices: {[d.device_kind for d in jax.devices()]}  jax {jax.__version__}")
  rows = [time_level(a.config, lvl, a.set, a.steps) for lvl in a.levels.split(",")]
  base = rows[0]["tokens_per_s"]
  print(f"\n{'level':6s} {'ms/step':>9s} {'tokens/s':>11s} {'ratio':>6s} {'MFU':>6s} "
        f"{'peak GiB':>9s} {'loss':>7s}")
  for r in rows:
    mfu = f"{r['mfu']:.3f}" if r["mfu"] is not None else "  n/a"
    peak = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "n/a"
    print(f"{r['level']:6s} {r['ms']:9.1f} {r['tokens_per_s']:11,.0f} "
          f"{r['tokens_per_s'] / base:6.2f} {mfu:>6s} {peak:>9s} {r['loss']:7.3f}")


if __name__ == "__main__":
  main()
