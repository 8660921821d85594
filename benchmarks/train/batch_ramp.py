"""What the batch ramp's one compiled step costs: at each batch size, the dynamic step (the
microbatch count passed as data, ``build_step(..., UniformLoop(dynamic=True))``, as a ``train.batch_ramp``
run uses it) against the step compiled for that count alone, side by side in one process.

  python benchmarks/train/batch_ramp.py --config configs/gpt_125m.yaml --counts 1,2,4,8 \
      [--level O2] [--steps 6] [--set model.attention_impl=cudnn ...]

Both steps run the Trainer's model, optimizer and ZeRO plan on the same state and batches
(warmed: two steps each before timing); the median of `--steps` blocking steps is reported
with the ratio dynamic / fixed (1.00: the dynamic loop costs nothing).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def median_ms(step, state, batch, steps: int):
  """(state after the calls, median ms of `steps` blocking calls after two warm-up calls
  (compile, then warm FP8 state), the last call's loss)."""
  from fp8jax.bench.timing import time_calls
  carry = {"state": state}

  def one_step():
    carry["state"], carry["metrics"] = step(carry["state"], batch)
    return carry["metrics"]
  timing = time_calls(one_step, steps, warmup=2)
  return carry["state"], timing.median, float(carry["metrics"]["loss"])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/gpt_125m.yaml")
  parser.add_argument("--counts", default="1,2,4,8", help="microbatch counts to time")
  parser.add_argument("--level", default="O2")
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  args = parser.parse_args(argv)
  from fp8jax.config import load_config
  from fp8jax.train.loop import Trainer
  from fp8jax.train.step import build_step

  counts = sorted(int(c) for c in args.counts.split(","))
  base = load_config(args.config, args.set)
  mb, seq = base.train.microbatch_size, base.data.seq_len
  top = counts[-1]
  cfg = load_config(args.config, args.set + [
      f"train.opt_level={args.level}", f"train.batch_size={top * mb}",
      f"train.microbatches={top}", "train.warmup_steps=0",
      f"train.batch_ramp={{start_tokens: {mb * seq}, end_tokens: {top * mb * seq}, "
      f"ramp_steps: 10}}"])
  trainer = Trainer(cfg, progress=False)
  full = np.concatenate([trainer.next_batch(cfg.train.steps) for _ in range(1)])
  dynamic = trainer.steps.get(trainer.model, top)
  state = trainer.state
  print(f"{args.config} at {args.level}: microbatch {mb} x {seq} tokens; dynamic step built "
        f"for up to {top} microbatches")
  print("| microbatches | tokens | fixed ms | dynamic ms | dynamic / fixed | loss (both) |")
  print("|---|---|---|---|---|---|")
  for k in counts:
    batch = full[:k * mb]
    fixed = build_step(trainer.model.apply, trainer.tx, trainer.plan, k,
                       fused_update=trainer.steps.fused_update)
    state, f_ms, f_loss = median_ms(fixed, state, batch, args.steps)
    state, d_ms, d_loss = median_ms(dynamic, state, batch, args.steps)
    print(f"| {k} | {k * mb * seq} | {f_ms:.1f} | {d_ms:.1f} | {d_ms / f_ms:.3f} | "
          f"{f_loss:.4f} / {d_loss:.4f} |", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
