"""RMSNorm fused into the FP8 cast of the next GEMM's input: what it would save (GPU).

  source benchmarks/gpu_env.sh && python benchmarks/gemm/norm_cast.py [--rows 16384] \
      [--cols 2048,4096]

A pre-norm decoder layer runs, twice per layer, ``x = x + h`` (the residual), ``y =
rmsnorm(x)`` (f32 math, bf16 out) and the FP8 cast of y (q, q_t, amax) for the qkv or fc_in
GEMM. Fused, the norm's output is never stored: XLA computes only each row's statistic
(rsqrt(mean(x^2) + eps), f32[M]; it can join the residual add's fusion) and the cast kernel
normalizes its tiles of x before casting. Times, per call, for x[rows, cols] bf16:

- XLA's RMSNorm alone, fp8jax's cast kernel alone, and the two in sequence (today's path);
- the row statistic alone and the script's norm-in-the-cast kernel (the fused path);
- both paths from the residual add on (inputs x_prev, h; outputs x, q, q_t, amax).

The fused kernel's q must match the cast of XLA's normed tensor (the share of differing FP8
bytes is printed; the norm rounds to bf16 before the cast on both paths). Milliseconds per call:
median of 5 rounds of 30 back-to-back calls.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import calls  # noqa: E402
from fp8jax import scaling  # noqa: E402
from fp8jax.kernels import cast_transpose as ct  # noqa: E402

E4M3 = jnp.float8_e4m3fn
EPS = 1e-6
ms_per_call = functools.partial(calls.ms_per_call, calls=30)


def rms_norm(x, gamma):
  """Flax's nn.RMSNorm in f32 (x * rsqrt(mean(x^2) + eps) * scale), bf16 out."""
  x = x.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
  return (y * gamma).astype(jnp.bfloat16)


def row_rstd(x):
  """f32[M]: rsqrt(mean(x^2) + eps) of each row of x[M, K]."""
  x = x.astype(jnp.float32)
  return jax.lax.rsqrt(jnp.mean(x * x, axis=-1) + EPS)


def _norm_cast_kernel(inv_ref, x_ref, r_ref, g_ref, q_ref, qt_ref, amax_ref, *, bound):
  x = x_ref[...].astype(jnp.float32) * r_ref[...][:, None]
  y = (x * g_ref[...][None, :]).astype(jnp.bfloat16).astype(jnp.float32)  # the stored norm
  c = jnp.clip(y * inv_ref[...], -bound, bound)
  q_ref[...] = c.astype(q_ref.dtype)
  qt_ref[...] = c.T.astype(qt_ref.dtype)
  amax_ref[...] = jnp.max(jnp.abs(y))


def norm_cast(fmt, interpret: bool, bm: int = 64, bk: int = 128, num_warps: int = 4):
  """jit of (scale, x[M, K] bf16, rstd f32[M], gamma f32[K]) -> (q, q_t, amax) of
  rms_norm(x, gamma), one kernel."""
  from jax.experimental.pallas import triton as plt

  @jax.jit
  def call(scale, x, r, g):
    m, k = x.shape
    q, qt, part = pl.pallas_call(
        functools.partial(_norm_cast_kernel, bound=scaling.fp8_max(fmt)),
        out_shape=(jax.ShapeDtypeStruct((m, k), fmt), jax.ShapeDtypeStruct((k, m), fmt),
                   jax.ShapeDtypeStruct((m // bm, k // bk), jnp.float32)),
        grid=(m // bm, k // bk),
        in_specs=[pl.BlockSpec((None,), lambda i, j: (0,)),
                  pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
                  pl.BlockSpec((bm,), lambda i, j: (i,)),
                  pl.BlockSpec((bk,), lambda i, j: (j,))],
        out_specs=(pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
                   pl.BlockSpec((bk, bm), lambda i, j: (j, i)),
                   pl.BlockSpec((None, None), lambda i, j: (i, j))),
        compiler_params=plt.CompilerParams(num_warps=num_warps), interpret=interpret,
    )((1.0 / scale).reshape(1), x, r, g)
    return q, qt, jnp.max(part)
  return call


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=16384)
  p.add_argument("--cols", default="2048,4096", help="comma-separated widths (d_model)")
  a = p.parse_args()
  interpret = jax.default_backend() != "gpu"
  lib = functools.partial(ct.cast_transpose_amax, fmt=E4M3, interpret=interpret)
  fused = norm_cast(E4M3, interpret)
  s = jnp.float32(0.05)
  print(f"rows {a.rows}; ms per call; {jax.devices()[0].device_kind}")
  print("| cols | XLA norm | cast kernel | norm, then cast | row statistic | norm in the cast | "
        "statistic + norm in the cast | from the residual: today | fused | saved | "
        "q bytes differing |")
  print("|---|---|---|---|---|---|---|---|---|---|---|")
  for cols in (int(c) for c in a.cols.split(",")):
    k1, k2, k3 = jax.random.split(jax.random.key(cols), 3)
    x_prev = (3 * jax.random.normal(k1, (a.rows, cols))).astype(jnp.bfloat16)
    h = jax.random.normal(k2, (a.rows, cols)).astype(jnp.bfloat16)
    g = 1 + 0.1 * jax.random.normal(k3, (cols,), jnp.float32)
    x = x_prev + h
    today = jax.jit(lambda s, x, g: lib(rms_norm(x, g), s))
    both = jax.jit(lambda s, x, g: fused(s, x, row_rstd(x), g))
    res_today = jax.jit(lambda s, xp, h, g: (lambda x: (x, *lib(rms_norm(x, g), s)))(xp + h))
    res_fused = jax.jit(lambda s, xp, h, g: (lambda x: (x, *fused(s, x, row_rstd(x), g)))(xp + h))
    q_ref, qt_ref, a_ref = today(s, x, g)
    q, qt, amax = both(s, x, g)
    bits = lambda v: np.asarray(jax.lax.bitcast_convert_type(v, jnp.uint8))  # noqa: E731
    differ = float(np.mean(bits(q) != bits(q_ref)))
    if not np.array_equal(bits(qt), bits(q).T) or not np.isclose(float(amax), float(a_ref),
                                                                  rtol=1e-2):
      raise SystemExit(f"cols {cols}: the fused kernel's q_t or amax is wrong")
    t = {
        "norm": ms_per_call(jax.jit(rms_norm), (x, g)),
        "cast": ms_per_call(jax.jit(lambda s, y: lib(y, s)), (s, rms_norm(x, g))),
        "today": ms_per_call(today, (s, x, g)),
        "stat": ms_per_call(jax.jit(row_rstd), (x,)),
        "fused": ms_per_call(fused, (s, x, row_rstd(x), g)),
        "both": ms_per_call(both, (s, x, g)),
        "res_today": ms_per_call(res_today, (s, x_prev, h, g)),
        "res_fused": ms_per_call(res_fused, (s, x_prev, h, g)),
    }
    print(f"| {cols} | {t['norm']:.3f} | {t['cast']:.3f} | {t['today']:.3f} | {t['stat']:.3f} | "
          f"{t['fused']:.3f} | {t['both']:.3f} | {t['res_today']:.3f} | {t['res_fused']:.3f} | "
          f"{t['res_today'] - t['res_fused']:.3f} | {differ:.2e} |")


if __name__ == "__main__":
  main()
