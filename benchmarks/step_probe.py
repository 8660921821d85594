"""Per-step loss, gradient norm and the compiled step's memory of a Trainer config: what to
run when a benchmark reports a NaN loss or an out-of-memory.

  python benchmarks/step_probe.py --config configs/gpt_7b.yaml --steps 4 \
      [--set key=value ...] [--wide-matrices] [--memory-only]

Prints, for the calibrated step, XLA's memory analysis (arguments, outputs, temporaries,
GiB), then each step's loss, gradient norm and skipped flag, the state leaves holding a
non-finite value, and the FP8 state's health per tensor role. ``--wide-matrices``
decodes O2's GEMM weights to f32 (``make_train_step(matrix_dtype=None)``) instead of the
compute dtype, to compare.
"""
from __future__ import annotations

import argparse
import functools
import time


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--config", default="configs/tiny.yaml")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--steps", type=int, default=4)
  p.add_argument("--wide-matrices", action="store_true")
  p.add_argument("--memory-only", action="store_true")
  a = p.parse_args()
  import jax
  import jax.numpy as jnp
  from fp8jax.config import load_config
  from fp8jax.train import metrics as metrics_lib
  from fp8jax.train import loop
  if a.wide_matrices:
    loop.make_train_step = functools.partial(loop.make_train_step, matrix_dtype=None)
  cfg = load_config(a.config, a.set)
  trainer = loop.Trainer(cfg, progress=False)
  mb = cfg.microbatches_at(0)
  batch = trainer.next_batch(0)
  gib = lambda b: f"{b / 2**30:.1f}"
  t0 = time.perf_counter()
  step = trainer._compiled_step(mb, False)
  if hasattr(step, "lower"):
    m = step.lower(trainer.state, batch).compile().memory_analysis()
    print(f"memory (GiB): arguments {gib(m.argument_size_in_bytes)} outputs "
          f"{gib(m.output_size_in_bytes)} aliased {gib(m.alias_size_in_bytes)} temporaries "
          f"{gib(m.temp_size_in_bytes)} (compile {time.perf_counter() - t0:.0f} s)", flush=True)
  if a.memory_only:
    return
  run = trainer.step_fn(mb)
  check = jax.jit(lambda tree: [jnp.all(jnp.isfinite(x.astype(jnp.float32)))
                                for x in jax.tree.leaves(tree)])
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(trainer.state)]
  for s in range(a.steps):
    trainer.state, m = run(trainer.state, trainer.next_batch(s))
    m = jax.device_get(m)
    print(f"step {s}: loss {float(m['loss']):.4f} grad_norm {float(m['grad_norm']):.4g} "
          f"skipped {int(m.get('skipped', -1))} "
          f"uncalibrated {trainer._uncalibrated}", flush=True)
    ok = jax.device_get(check(trainer.state))
    bad = [p for p, good in zip(paths, ok) if not good]
    print(f"  non-finite state leaves: {len(bad)} {bad[:6]}", flush=True)
    if trainer.state.fp8:
      health = metrics_lib.fp8_health(jax.device_get(trainer.state.fp8), trainer.level.recipe)
      print("  " + " ".join(f"{k[4:]}={v:.3g}" for k, v in sorted(health.items())), flush=True)


if __name__ == "__main__":
  main()
