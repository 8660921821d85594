"""The balanced step at ZeRO-3 (layer-major: each layer gathered once per step) against the
uniform ZeRO-3 step (each layer gathered per microbatch), side by side in one process on all
local devices: milliseconds per step (median), tokens/s and compiled bytes per device, the
balanced step with equal counts and with the given unequal counts (same total).

  python benchmarks/hetero/layer_major_step.py --config configs/gpt_1_3b.yaml \
      --set model.n_layers=8 --microbatch 2 --counts 1,3 [--steps 5] [--level O3]

Both steps run the Trainer's loop objects (``fp8jax.train.build.step_loop``) on the same
warmed state (a few steps first, so FP8 scales are live). On CPU:
``JAX_NUM_CPU_DEVICES=8 python benchmarks/hetero/layer_major_step.py --config
configs/tiny.yaml --microbatch 1 --counts 1,3,0,2,0,0,1,1``.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common.calls import ms_per_call  # noqa: E402
from fp8jax.config import load_config  # noqa: E402
from fp8jax.train import build  # noqa: E402
from fp8jax.train.state import state_init_fn  # noqa: E402
from fp8jax.train.step import build_step  # noqa: E402


def _bytes(step, state, batch) -> float:
  m = step.jitted.lower(state, *step.place(batch)).compile().memory_analysis()
  return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", required=True)
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--microbatch", type=int, required=True, help="sequences per microbatch")
  p.add_argument("--counts", required=True, help="microbatches per device, e.g. 1,3")
  p.add_argument("--level", default="O3")
  p.add_argument("--steps", type=int, default=5)
  a = p.parse_args()
  counts = tuple(int(c) for c in a.counts.split(","))
  n, k = jax.device_count(), sum(counts)
  assert len(counts) == n, f"--counts needs {n} values (one per device)"
  assert k % n == 0, f"the counts' sum {k} must split equally over {n} devices for the uniform step"
  kind = jax.devices()[0].device_kind
  base = a.set + [f"train.opt_level={a.level}", "parallel.zero_stage=3",
                  f"train.batch_size={k * a.microbatch}"]
  # The uniform step: k / n microbatches of n x m sequences (m per device each), the same
  # work per device as the balanced step's equal counts.
  configs = {"uniform": base + [f"train.microbatches={k // n}"],
             "balanced": base + [f"train.microbatches={k}",
                                 f"parallel.device_map={{'{kind}': 1.0}}"]}
  rng = np.random.default_rng(0)
  rows = []
  for name, c in (("uniform", None), ("balanced equal", (k // n,) * n),
                  (f"balanced {a.counts}", counts)):
    cfg = build.resolve_auto(load_config(a.config, configs[name.split()[0]]))
    run = build.run_model(cfg)
    model, _, tx = build.model_and_optimizer(cfg, run)
    t, d = cfg.train, cfg.data
    init = state_init_fn(model, tx, cfg.level(), t.microbatch_size, d.seq_len, t.seed)
    plan = build.zero_plan(cfg, jax.eval_shape(init), run.tensor_rules)
    batch = rng.integers(0, cfg.model.vocab_size, (k * a.microbatch, d.seq_len + 1), np.int32)
    loop = build.step_loop(cfg, plan, model, t.microbatches,
                           None if c is None else (lambda _, c=c: c))
    step = build_step(model.apply, tx, plan, t.microbatches, loop)
    state = jax.jit(init, out_shardings=plan.state)()
    for _ in range(3):  # live FP8 scales before timing (an unwarmed FP8 state flatters)
      state, _ = step(state, batch)
    placed = step.place(batch)
    copy = lambda s: jax.tree.map(lambda x: x.copy(), s)
    ms = ms_per_call(lambda s, *b: step.jitted(copy(s), *b), (state, *placed), calls=a.steps,
                     repeats=3)
    rows.append((name, ms, k * a.microbatch * d.seq_len / ms * 1e3, _bytes(step, state, batch)))
  print(f"{n} x {kind}, {a.level}, ZeRO-3, {k} microbatches of {a.microbatch} x "
        f"{d.seq_len} tokens")
  print("| step | ms | tokens/s | GiB per device (compiled) |")
  print("|---|---|---|---|")
  for name, ms, tps, b in rows:
    print(f"| {name} | {ms:.1f} | {tps:,.0f} | {b / 2**30:.2f} |")


if __name__ == "__main__":
  main()
