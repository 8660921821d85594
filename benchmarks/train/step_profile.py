"""Where a train step's GPU time goes: kernel time by category and the top kernels (GPU).

  python benchmarks/train/step_profile.py --config configs/gpt_1_3b.yaml --level O1 \
      [--steps 3] [--set model.n_layers=4 ...] [--top 25] [--trace-dir DIR] [--dump-hlo PATH]

Builds the Trainer of the config at the level, compiles and warms up two steps (the first
after the calibration pass, see fp8.calibrate), then records `--steps` steps with
``jax.profiler.trace`` (Perfetto JSON) and sums the GPU kernels' durations per step: GEMMs
(cuBLAS/cuBLASLt), attention (cuDNN), collectives, the fused FP8 cast kernels and XLA fusions
split by name (convert = casts, reduce = amax and norms). Prints ms per step per category, the
GPU's idle time per step (the traced steps' span less the time any kernel ran: waits on the
host), the top kernels and device copies by HLO op, so a change can be judged by which
category moved.
``--dump-hlo`` writes the compiled steady (calibrated) step.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

from benchmarks.common import trace  # noqa: E402
from fp8jax.config import load_config  # noqa: E402
from fp8jax.train.loop import Trainer  # noqa: E402


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
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
  microbatches = cfg.microbatches_at(0)
  step = trainer.step_fn(microbatches)
  for _ in range(2):  # the first step may take the calibration pass (fp8.calibrate)
    trainer.state, m = step(trainer.state, batch)
  jax.block_until_ready(m)
  if a.dump_hlo:  # the steady step: the calibrated model
    compiled = trainer.compiled_step(microbatches, calibrated=True)
    with open(a.dump_hlo, "w") as f:
      f.write(compiled.jitted.lower(trainer.state, *compiled.place(batch)).compile().as_text())

  def one_step():
    trainer.state, metrics = step(trainer.state, batch)
    return metrics
  _, kernels = trace.traced_kernels(one_step, a.steps, a.trace_dir)
  print(f"{a.config} level {a.level} {' '.join(a.set)}")
  trace.summarize(kernels, a.steps, a.top)


if __name__ == "__main__":
  main()
