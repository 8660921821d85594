"""Where an MLP block's forward+backward GPU time goes: kernel time by category per mode (GPU).

  python benchmarks/gemm/mlp_profile.py [--modes bf16,fp8jax,fp8jax_xla,gemms_fp8_tn]
      [--tokens T --model D --hidden F] [--steps 3] [--top 12]

The block and modes are ``fp8jax bench mlp``'s (same shapes, same warm-up of the FP8 state, so
no mode runs on cold scales). Each mode is compiled, warmed up, then ``--steps`` steps run
under ``jax.profiler.trace``; the GPU kernels' durations are summed per step and split by
category (``benchmarks/common/trace.py``: cuBLAS(Lt) GEMMs, the fused FP8 cast kernel, XLA
fusions by kind). Prints one line per mode (GEMM ms, everything else by category) and each
mode's largest kernels, so the block's GEMM time can be set against the GEMM-only ceiling
(the ``gemms_fp8_tn`` mode: the six FP8 GEMMs on operands already laid out K-major).
"""
from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.common import trace  # noqa: E402
from fp8jax.bench import mlp  # noqa: E402


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--modes", default="bf16,fp8jax,fp8jax_xla,gemms_fp8_tn")
  p.add_argument("--tokens", type=int, default=mlp.SHAPE[0])
  p.add_argument("--model", type=int, default=mlp.SHAPE[1])
  p.add_argument("--hidden", type=int, default=mlp.SHAPE[2])
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--top", type=int, default=12)
  a = p.parse_args()
  modes = mlp.parse_modes(a.modes)
  kx, kc, kp, kg = jax.random.split(jax.random.key(0), 4)
  x = jax.random.normal(kx, (a.tokens, a.model), jnp.float32).astype(jnp.bfloat16)
  ct = (jax.random.normal(kc, (a.tokens, a.model), jnp.float32) / (a.tokens * a.model)).astype(
      jnp.bfloat16)
  params = mlp.MLP(a.hidden, a.model).init(kp, x)["params"]
  print(f"MLP block T={a.tokens} D={a.model} F={a.hidden}: GPU kernel ms per step")
  rows = []
  for mode in modes:
    if mode in mlp.GEMM_MODES:
      compiled, args = mlp.gemms_program(mode, x, params, kg)
      call = lambda: compiled(*args)  # noqa: E731
    else:
      compiled, variables = mlp.warm_block(mode, x, ct, params, kp)
      call = lambda: compiled(variables, x, ct)  # noqa: E731
    jax.block_until_ready(call())
    _, kernels = trace.traced_kernels(call, a.steps)
    by_cat = collections.Counter()
    for name, us, _ in kernels:
      by_cat[trace.category(name)] += us / a.steps / 1e3
    rows.append((mode, by_cat))
    print(f"\n{mode}:")
    trace.summarize(kernels, a.steps, a.top)
  cats = sorted({c for _, b in rows for c in b}, key=lambda c: c != "gemm")
  print("\n| mode | total | " + " | ".join(cats) + " |")
  print("|---|---|" + "---|" * len(cats))
  for mode, b in rows:
    print(f"| {mode} | {sum(b.values()):.2f} | " + " | ".join(f"{b[c]:.2f}" for c in cats) + " |")


if __name__ == "__main__":
  main()
