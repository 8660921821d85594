"""Device memory of every phase of a run, compiled but not run: for each program the run has
(train step, evaluation, FP8 calibration pass, FP8 cast-health probe, the BF16 loss of the
divergence check and the FP8-BF16 loss gap), what XLA's compiled program needs per device
besides the train state (``fp8jax.train.loop.Trainer.phase_memory``), against the train
step's and against the memory model's estimate of that phase
(``fp8jax.train.memory.phase_bytes``).

  python benchmarks/train/phase_memory.py --config configs/gpt_7b.yaml [--set key=value ...] \
      [--json out.json]

The Trainer is built as ``fp8jax train`` builds it (its auto settings resolved for this
device, the state initialised on the device, the corpus read); nothing is trained, so the
7B config needs about its state's memory and seconds of compiling per program. With
``runtime.compile_cache`` on, a second call loads the programs from the cache. A phase above
the train step plus ``--margin`` (default 0.05 of the step's own memory) is marked.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fp8jax.train import memory, oom  # noqa: E402 (after the path)

GiB = 2**30
# The memory model's phase (fp8jax.train.memory.PHASES) that estimates each run phase
_STEP, _EVAL, _PROBE = memory.PHASES
_ESTIMATED = {oom.STEP: _STEP, oom.EVAL: _EVAL, oom.CALIBRATION: _PROBE, oom.PROBE: _PROBE}


def table(own: dict[str, int], state: int, estimates: dict[str, float], limit: float | None,
          margin: float) -> list[str]:
  """Markdown rows (bytes in GiB, or MiB below 1 GiB): phase, its own bytes, x the train
  step's own, state + own, the estimate of that phase, the device's limit (GiB); phases
  above the step + `margin` marked."""
  step = own[oom.STEP]
  unit, size = ("GiB", GiB) if state + step >= GiB else ("MiB", 2**20)
  rows = [f"| phase | own {unit} | x train step | with the state {unit} | estimate {unit} | "
          f"device GiB |", "|---|---|---|---|---|---|"]
  for phase, need in own.items():
    est = estimates.get(_ESTIMATED.get(phase, ""))
    mark = " **(above the step)**" if need > step * (1 + margin) else ""
    rows.append(f"| {phase}{mark} | {need / size:.2f} | {need / step:.2f} | "
                f"{(state + need) / size:.2f} | {'' if est is None else f'{est / size:.2f}'} | "
                f"{'' if limit is None else f'{limit / GiB:.1f}'} |")
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
  p.add_argument("--margin", type=float, default=0.05)
  p.add_argument("--json", default=None)
  args = p.parse_args(argv)
  import jax
  from fp8jax.config import load_config
  from fp8jax.train.loop import Trainer

  trainer = Trainer(load_config(args.config, args.set), progress=False)
  cfg = trainer.config
  own = trainer.phase_memory()
  estimates = memory.phase_bytes(cfg, cfg.model.remat_policy, cfg.model.attention_impl,
                                 trainer.plan.mesh.size)
  state = memory.device_bytes(trainer.state)
  limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  print(f"{args.config} {' '.join(args.set)}: level {cfg.train.opt_level}, "
        f"{cfg.train.microbatches} x {cfg.train.microbatch_size} sequences of "
        f"{cfg.data.seq_len}, remat {cfg.model.remat_policy}, {trainer.plan.mesh.size} "
        f"device(s) ({jax.devices()[0].device_kind}); state {state / GiB:.2f} GiB per device")
  print("\n".join(table(own, state, estimates, limit, args.margin)))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"own_bytes": own, "state_bytes": state, "estimate_bytes": estimates,
                 "limit_bytes": limit}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
