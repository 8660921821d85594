"""Balanced vs uniform microbatches on the local GPUs, measured and predicted (several GPUs).

  python benchmarks/hetero/balance_gpu.py --config configs/gpt_125m.yaml --microbatch 8 \
      --total 8 --repeats 1,0 [--set model.attention_impl=cudnn] [--out FILE.json]

All local GPUs as data-parallel groups; `repeats` extra forward+backward passes per
microbatch slow chosen GPUs down (GPU 0 at half speed with 1,0: ``benchmarks.common.slowdown``,
data rather than code, so every GPU runs the same program). Measures single-group splits (the
per-group seconds per microbatch and the fixed cost of reduction + update), then the uniform
and the balanced split of --total microbatches, and prints the prediction
makespan(counts, measured seconds) + fixed cost next to the measured step. Writes JSON to
--out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common.slowdown import slowed_apply  # noqa: E402
from fp8jax.config import load_config  # noqa: E402
from fp8jax.parallel import balance, layout, make_mesh  # noqa: E402
from fp8jax.train.build import model_and_optimizer  # noqa: E402
from fp8jax.train.state import init_state  # noqa: E402
from fp8jax.train.step import GroupLoop, make_train_step  # noqa: E402


def _timed(fn, *a, steps: int) -> float:
  jax.block_until_ready(fn(*a))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*a))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def balance_run(args) -> dict:
  config = load_config(args.config, args.set)
  level, t, d = config.level(), config.train, config.data
  model, _, tx = model_and_optimizer(config)
  mesh = make_mesh()
  groups = layout.group_count(mesh)
  state = jax.device_put(init_state(model, tx, level, args.microbatch, d.seq_len, t.seed),
                         layout.replicated(mesh))
  sharding = layout.batch_sharding(mesh)
  put = lambda x: layout.put_global(np.asarray(x), sharding)
  repeats = [int(r) for r in args.repeats.split(",")]
  assert len(repeats) == groups, f"--repeats needs {groups} values"
  loop = GroupLoop(mesh)
  step = jax.jit(make_train_step(slowed_apply(model.apply, repeats, loop.axes), tx, args.total,
                                 groups=loop))
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.model.vocab_size,
                        (args.total * args.microbatch, d.seq_len + 1), dtype=np.int32)

  def measure(counts) -> float:
    rows = tokens[:sum(counts) * args.microbatch]
    return _timed(step, state, put(layout.layout_counts(rows, counts, args.microbatch)),
                  put(np.asarray(counts, np.int32)), steps=args.steps)

  one = lambda g, n: tuple(n if i == g else 0 for i in range(groups))
  single = {g: (measure(one(g, 1)), measure(one(g, 2))) for g in range(groups)}
  per_mb = [single[g][1] - single[g][0] for g in range(groups)]  # seconds per microbatch
  fixed = float(np.mean([single[g][0] - per_mb[g] for g in range(groups)]))  # reduce+update
  uniform = balance.uniform_counts(groups, args.total)
  best = balance.balance_counts(per_mb, args.total)
  out = {"config": args.config, "microbatch": args.microbatch, "seq_len": d.seq_len,
         "level": level.name, "repeats": repeats, "groups": groups,
         "device": jax.devices()[0].device_kind, "seconds_per_microbatch": per_mb,
         "fixed_seconds": fixed, "splits": {}}
  print(f"{groups} groups of {jax.devices()[0].device_kind}, repeats {repeats}: seconds per "
        f"microbatch {[round(s * 1e3, 1) for s in per_mb]} ms, fixed (reduce + update) "
        f"{fixed * 1e3:.1f} ms")
  print(f"{'split':>14} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
  for name, counts in [("uniform", uniform), ("balanced", best)]:
    if counts is None:
      continue
    measured = measure(counts)
    predicted = balance.makespan(counts, per_mb) + fixed
    out["splits"][name] = {"counts": list(counts), "measured": measured,
                           "predicted": predicted}
    print(f"{name + ' ' + ','.join(map(str, counts)):>14} {measured * 1e3:12.1f} "
          f"{predicted * 1e3:13.1f} {100 * (predicted / measured - 1):+6.1f}%")
  if len(out["splits"]) == 2:
    u, b = out["splits"]["uniform"], out["splits"]["balanced"]
    print(f"balanced vs uniform: measured {u['measured'] / b['measured']:.2f}x, "
          f"predicted {u['predicted'] / b['predicted']:.2f}x")
  return out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/gpt_125m.yaml")
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--microbatch", type=int, default=8, help="sequences per microbatch")
  parser.add_argument("--total", type=int, default=8, help="microbatches per step")
  parser.add_argument("--repeats", default="1,0", help="extra passes per microbatch per group")
  parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
  parser.add_argument("--out", default=None, help="JSON output path")
  args = parser.parse_args()
  result = balance_run(args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
