"""Row-wise against tensor FP8 scaling: the error of one GEMM's output and both gradients.

  python benchmarks/gemm/rowwise_error.py [--seeds 5] [--m 1024 --k 512 --n 768]

Any device (FP8 GEMMs emulated where there are none: the same quantized values, summed in
f32). For each case x[M, K] (normal), w[K, N] (normal / 10) and the output gradient g[M, N]
(normal) are drawn afresh per seed; ``fp8jax.fp8_dot_general`` computes y = x @ w and its
vjp (dx, dw) with current scaling per tensor and per row (``Recipe(granularity="rowwise")``),
each with E5M2 and with E4M3 gradients; float64 is the reference. Cases: plain data; 4
tokens (rows of x and g) 100x or 2**16x larger; 4 channels (columns of x) 2**16x larger.
Prints ||err|| / ||ref|| of y, dx, dw over the whole tensor and, for the outlier cases, over
the other tokens' rows of y and dx or the other channels' rows of dw (what the outliers'
scale can crush), the mean over the seeds.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import fp8jax

DENSE = (((1,), (0,)), ((), ()))
CASES = ("plain", "tokens x100", "tokens x2^16", "channels x2^16")


def rel(a, ref) -> float:
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def data(case: str, key, m: int, k: int, n: int):
  """(x, w, g, rows of y/dx to look at, rows of dw to look at) of one case."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  x, w, g = (jax.random.normal(k1, (m, k)), jax.random.normal(k2, (k, n)) * 0.1,
             jax.random.normal(k3, (m, n)))
  rows, channels = np.arange(m), np.arange(k)
  if case.startswith("tokens"):
    factor = 100.0 if case.endswith("100") else 2.0 ** 16
    big = np.asarray(jax.random.choice(k4, m, (4,), replace=False))
    x, g = x.at[big].multiply(factor), g.at[big].multiply(factor)
    rows = np.setdiff1d(rows, big)
  elif case.startswith("channels"):
    big = np.asarray(jax.random.choice(k4, k, (4,), replace=False))
    x = x.at[:, big].multiply(2.0 ** 16)
    channels = np.setdiff1d(channels, big)
  return x, w, g, rows, channels


def errors(recipe, x, w, g, rows, channels) -> list[float]:
  """[y, dx, dw, y rows, dx rows, dw channels] relative errors against float64."""
  @jax.jit
  def run(x, w, g):
    f = lambda x, w: fp8jax.fp8_dot_general(x, w, DENSE, fp8jax.init_dot_meta(recipe), recipe)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(g))
  with jax.enable_x64():
    x64, w64, g64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, w, g))
    y64, vjp = jax.vjp(lambda a, b: a @ b, x64, w64)
    refs = [np.asarray(a) for a in (y64, *vjp(g64))]
  outs = [np.asarray(a) for a in run(x, w, g)]
  return [rel(o, r) for o, r in zip(outs, refs)] + [
      rel(outs[0][rows], refs[0][rows]), rel(outs[1][rows], refs[1][rows]),
      rel(outs[2][channels], refs[2][channels])]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--seeds", type=int, default=5)
  p.add_argument("--m", type=int, default=1024)
  p.add_argument("--k", type=int, default=512)
  p.add_argument("--n", type=int, default=768)
  args = p.parse_args(argv)
  recipes = {f"{name} {bwd}": fp8jax.Recipe(scaling="current", granularity=gran, bwd_format=bwd)
             for bwd in ("e5m2", "e4m3") for name, gran in (("tensor", "tensor"),
                                                            ("rowwise", "rowwise"))}
  print(f"x[{args.m}, {args.k}] @ w[{args.k}, {args.n}], mean of {args.seeds} seeds; "
        "columns: relative error of y, dx, dw; then of the other tokens' rows of y, dx and "
        "the other channels' rows of dw")
  print("| case | recipe | y | dx | dw | y (others) | dx (others) | dw (others) |")
  print("|---|---|---|---|---|---|---|---|")
  for case in CASES:
    for name, recipe in recipes.items():
      errs = np.mean([errors(recipe, *data(case, jax.random.key(s), args.m, args.k, args.n))
                      for s in range(args.seeds)], axis=0)
      shown = [f"{e:.4f}" for e in errs[:3]] + (
          ["-"] * 3 if case == "plain" else
          [f"{e:.4f}" if (i < 2) == case.startswith("tokens") else "-"
           for i, e in enumerate(errs[3:])])
      print(f"| {case} | {name} | " + " | ".join(shown) + " |")


if __name__ == "__main__":
  main()
