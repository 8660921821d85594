"""Do levels and settings learn alike? Per-step losses of several runs on one repeated batch.

  python benchmarks/train/first_losses.py --config configs/gpt_1_3b.yaml --steps 10 \
      [--set model.n_layers=4 ...] --run O0=O0 --run O2=O2 \
      --run "O2 no fused update=O2,train.fused_optimizer=false"

Each run is ``fp8jax train``'s step (``Trainer.step_fn``: where ``fp8.calibrate`` says so, a
calibration pass before the first step, then the calibrated step throughout) on the config with the run's level and overrides,
`--steps` steps on the first batch, one run after the other in this process. Prints each
run's losses and the largest relative gap to the first run's, step by step: settings that
should train alike (O0..O3, kernels on or off) stay within a few percent over a few steps; a
gap that grows step after step is a bug, not FP8 noise.
"""
from __future__ import annotations

import argparse
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from fp8jax.bench.step import parse_run  # noqa: E402
from fp8jax.config import load_config  # noqa: E402
from fp8jax.train.loop import Trainer  # noqa: E402


def losses(config: str, level: str, overrides: list[str], steps: int) -> list[float]:
  """The losses of `steps` Trainer steps on the config's first batch."""
  cfg = load_config(config, overrides + [f"train.opt_level={level}"])
  trainer = Trainer(cfg, progress=False)
  batch = trainer.next_batch(0)
  step = trainer.step_fn(cfg.microbatches_at(0))
  out = []
  for _ in range(steps):
    trainer.state, metrics = step(trainer.state, batch)
    out.append(float(np.asarray(metrics["loss"])))
  return out


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--run", action="append", default=[], metavar="LABEL=LEVEL[,K=V...]")
  a = p.parse_args()
  runs = [parse_run(r) for r in (a.run or ["O0=O0", "O2=O2"])]
  settings = ["data.max_bytes=4194304", "train.eval_every=0"] + list(a.set)
  table = {}
  for label, level, own in runs:
    table[label] = losses(a.config, level, settings + own, a.steps)
    gc.collect()
    print(f"{label}: " + " ".join(f"{v:.4f}" for v in table[label]), flush=True)
  base = np.asarray(next(iter(table.values())))
  print(f"\n{a.config} {' '.join(settings)}; {jax.devices()[0].device_kind}")
  print("| run | " + " | ".join(f"step {i}" for i in range(a.steps)) + " | max gap |")
  print("|---|" + "---|" * (a.steps + 1))
  for label, v in table.items():
    gap = np.max(np.abs(np.asarray(v) - base) / base)
    print(f"| {label} | " + " | ".join(f"{x:.3f}" for x in v) + f" | {gap:.1%} |")


if __name__ == "__main__":
  main()
