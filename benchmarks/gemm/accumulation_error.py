"""How much error does the FP8 GEMM's fast accumulation add, by contraction length? (GPU)

  python benchmarks/gemm/accumulation_error.py [--rows 2048] [--k 2048,8192,16384,32768,65536]

Hopper's FP8 tensor cores accumulate in reduced precision unless cuBLASLt is asked to promote
partial sums to f32 (``Precision.HIGHEST`` in fp8jax's GEMMs: exact accumulation). For each
contraction length K, both operands are drawn afresh (normal, f32), scaled to fill E4M3
(first operand) and E5M2 (second: a gradient), cast, and multiplied TN ([rows, K] . [rows,
K] over K) three ways: exact FP8 accumulation, fast FP8 accumulation, and in f32 at HIGHEST
precision on the dequantized FP8 values (the reference: the same products summed exactly).
Prints each FP8 GEMM's relative error against that reference (||C - C_ref|| / ||C_ref||:
the accumulation error alone, the operands' rounding excluded), next to the rounding of the
result to BF16 (what every GEMM output in training undergoes) and the FP8 operands' own
rounding error carried into the product (the f32 GEMM of the unrounded data as reference).
Zero-mean products cancel, so ||C|| grows like sqrt(K) while the partial sums' magnitudes
grow too: a demanding case for a short accumulator.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
TN = (((1,), (1,)), ((), ()))


def rel(a, ref) -> float:
  """||a - ref|| / ||ref||, in f64 on the host."""
  a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


@jax.jit
def _products(x, g):
  """(exact FP8, fast FP8, f32 of the FP8 values, f32 of the data, BF16-rounded reference)."""
  sx = float(jnp.finfo(E4M3).max) / jnp.max(jnp.abs(x))
  sg = float(jnp.finfo(E5M2).max) / jnp.max(jnp.abs(g))
  qx, qg = (x * sx).astype(E4M3), (g * sg).astype(E5M2)
  unscale = 1.0 / (sx * sg)
  mm = lambda a, b, p: lax.dot_general(a, b, TN, precision=p,  # noqa: E731
                                       preferred_element_type=jnp.float32) * unscale
  ref = mm(qx.astype(jnp.float32), qg.astype(jnp.float32), lax.Precision.HIGHEST)
  data = lax.dot_general(x, g, TN, precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)
  return (mm(qx, qg, lax.Precision.HIGHEST), mm(qx, qg, lax.Precision.DEFAULT), ref, data,
          ref.astype(jnp.bfloat16))


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=2048, help="rows of each operand (M = N)")
  p.add_argument("--k", default="2048,8192,16384,32768,65536", help="contraction lengths")
  p.add_argument("--seed", type=int, default=0)
  a = p.parse_args()
  print(f"{jax.devices()[0].device_kind}; C[{a.rows}, {a.rows}] = x[{a.rows}, K] (E4M3) . "
        f"g[{a.rows}, K] (E5M2) over K")
  print("| K | exact FP8 accumulation | fast FP8 accumulation | C rounded to BF16 | "
        "FP8 operand rounding |")
  print("|---|---|---|---|---|")
  key = jax.random.key(a.seed)
  for k in (int(v) for v in a.k.split(",")):
    key, kx, kg = jax.random.split(key, 3)
    x = jax.random.normal(kx, (a.rows, k), jnp.float32)
    g = jax.random.normal(kg, (a.rows, k), jnp.float32)
    exact, fast, ref, data, bf16 = _products(x, g)
    print(f"| {k} | {rel(exact, ref):.2e} | {rel(fast, ref):.2e} | {rel(bf16, ref):.2e} | "
          f"{rel(ref, data):.2e} |", flush=True)


if __name__ == "__main__":
  main()
