"""Activations fused into the FP8 cast kernel: GELU and SwiGLU, forward and backward, with
exact vs approximate tanh (GPU).

  source benchmarks/gpu_env.sh && python benchmarks/gemm/activation_cast.py \
      [--rows 16384 --cols 8192 --swiglu-cols 11008]

Times, on h[M, F] bf16 (an MLP's hidden pre-activation) and its gradient: XLA's GELU fusion
followed by the cast kernel (two passes, what an unfused model runs), against one Pallas
kernel that applies the GELU (forward) or its derivative (backward, with the incoming
gradient) while it casts, writing q, q_t and the amax as ``fp8jax.kernels.cast_transpose``
does (its own kernel is timed beside them). SwiGLU: the gate and up projections gu[M, F, 2]
(the layout of fp8jax's fused gate/up GEMM output) or as the column halves of gu2[M, 2F] to
silu(gate) * up, cast; and backward, [d_gate | d_up] from dy[M, F] and gu2 cast to E5M2
[M, 2F]; and fp8jax's own kernels (``activation="swiglu"``), which read the interleaved
pairs as 32-bit words and write the gradient's pairs interleaved. Each kernel variant
computes tanh exactly (``jnp.tanh``) or with the GPU's ``tanh.approx.f32``; the error of
each GELU against float64 is printed beside the bf16 rounding's. The GELU backward kernels
are the script's own (fp8jax's is reached through ``fp8jax.fp8_mlp_chained``, both MLP GEMMs
in one differentiated op; ``fp8jax bench mlp --modes fp8jax_mlp_op`` times it in the block);
the SwiGLU rows time fp8jax's gated kernels directly. Milliseconds per call: median of 5
rounds of 30 back-to-back calls.
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

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
C0, C1 = float(np.sqrt(2 / np.pi)), 0.044715
ms_per_call = functools.partial(calls.ms_per_call, calls=30)


def tanh_of(approx: bool, interpret: bool):
  if approx and not interpret:
    from jax.experimental.pallas import triton as plt
    return plt.approx_tanh
  return jnp.tanh


def gelu(x, tanh):
  return x * (0.5 * (1.0 + tanh(C0 * (x + C1 * x ** 3))))


def gelu_grad(dy, x, tanh):
  t = tanh(C0 * (x + C1 * x ** 3))
  return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C0 * (1.0 + 3.0 * C1 * x * x))


def silu(x, tanh):
  return x * (0.5 + 0.5 * tanh(0.5 * x))  # sigmoid(x) = (1 + tanh(x / 2)) / 2


def _load(ref):
  """A block of one input as f32 tiles: [bm, bk] -> one tile; [bm, bk, 2] -> two (gate, up)."""
  if len(ref.shape) == 3:
    return ref[:, :, 0].astype(jnp.float32), ref[:, :, 1].astype(jnp.float32)
  return (ref[...].astype(jnp.float32),)


def _kernel(prologue, n_in, inv_ref, *refs, bound):
  ins, (q_ref, qt_ref, amax_ref) = refs[:n_in], refs[n_in:]
  tiles = [t for r in ins for t in _load(r)]
  x = prologue(*tiles).astype(ins[0].dtype).astype(
      jnp.float32)  # the activation (gradient) rounded to bf16, as it would be stored
  c = jnp.clip(x * inv_ref[...], -bound, bound)
  q_ref[...] = c.astype(q_ref.dtype)
  qt_ref[...] = c.T.astype(qt_ref.dtype)
  amax_ref[...] = jnp.max(jnp.abs(x))


def fused_cast(prologue, n_in: int, fmt, interpret: bool, bm: int = 64, bk: int = 128,
               halves: bool = False):
  """jit of (scale, *inputs[M, K]) -> (q, q_t, amax) of prologue(*inputs), one kernel.
  `halves`: one input gu[M, 2K] read as two tiles, columns j and K + j (gate | up)."""
  from jax.experimental.pallas import triton as plt

  @jax.jit
  def call(scale, *xs):
    m, k = xs[0].shape[:2]
    spec = lambda x: (pl.BlockSpec((bm, bk, 2), lambda i, j: (i, j, 0)) if x.ndim == 3  # noqa: E731
                      else pl.BlockSpec((bm, bk), lambda i, j: (i, j)))
    specs = [spec(x) for x in xs]
    if halves:
      k //= 2
      xs = (xs[0], xs[0])
      specs = [pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
               pl.BlockSpec((bm, bk), lambda i, j: (i, j + k // bk))]
    q, qt, part = pl.pallas_call(
        functools.partial(_kernel, prologue, n_in, bound=scaling.fp8_max(fmt)),
        out_shape=(jax.ShapeDtypeStruct((m, k), fmt), jax.ShapeDtypeStruct((k, m), fmt),
                   jax.ShapeDtypeStruct((m // bm, k // bk), jnp.float32)),
        grid=(m // bm, k // bk),
        in_specs=[pl.BlockSpec((None,), lambda i, j: (0,))] + specs,
        out_specs=(pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
                   pl.BlockSpec((bk, bm), lambda i, j: (j, i)),
                   pl.BlockSpec((None, None), lambda i, j: (i, j))),
        compiler_params=plt.CompilerParams(num_warps=4), interpret=interpret,
    )((1.0 / scale).reshape(1), *xs)
    return q, qt, jnp.max(part)
  return call


def swiglu_grad_cast(fmt, interpret: bool, tanh, bm: int = 64, bk: int = 128):
  """jit of (scale, dy[M, F], gu2[M, 2F]) -> (q, q_t, amax) of SwiGLU's input gradient
  [d_gate | d_up] ([M, 2F], the halves layout of gu2), one kernel: the program for output
  column block j reads dy's and gate's block j mod F/bk and up's, and writes d_gate (j < F/bk)
  or d_up."""
  from jax.experimental.pallas import triton as plt

  def kernel(inv_ref, dy_ref, g_ref, u_ref, q_ref, qt_ref, amax_ref, *, nf, bound):
    d, g, u = (r[...].astype(jnp.float32) for r in (dy_ref, g_ref, u_ref))
    sg = 0.5 + 0.5 * tanh(0.5 * g)  # sigmoid
    x = jnp.where(pl.program_id(1) >= nf, d * (g * sg), d * u * (sg * (1.0 + g * (1.0 - sg))))
    x = x.astype(dy_ref.dtype).astype(jnp.float32)  # as a stored bf16 gradient would be
    c = jnp.clip(x * inv_ref[...], -bound, bound)
    q_ref[...] = c.astype(q_ref.dtype)
    qt_ref[...] = c.T.astype(qt_ref.dtype)
    amax_ref[...] = jnp.max(jnp.abs(x))

  @jax.jit
  def call(scale, dy, gu2):
    m, f = dy.shape
    nf = f // bk
    half = lambda i, j: (i, jax.lax.rem(j, nf))  # noqa: E731
    q, qt, part = pl.pallas_call(
        functools.partial(kernel, nf=nf, bound=scaling.fp8_max(fmt)),
        out_shape=(jax.ShapeDtypeStruct((m, 2 * f), fmt), jax.ShapeDtypeStruct((2 * f, m), fmt),
                   jax.ShapeDtypeStruct((m // bm, 2 * nf), jnp.float32)),
        grid=(m // bm, 2 * nf),
        in_specs=[pl.BlockSpec((None,), lambda i, j: (0,)), pl.BlockSpec((bm, bk), half),
                  pl.BlockSpec((bm, bk), half),
                  pl.BlockSpec((bm, bk), lambda i, j: (i, nf + jax.lax.rem(j, nf)))],
        out_specs=(pl.BlockSpec((bm, bk), lambda i, j: (i, j)),
                   pl.BlockSpec((bk, bm), lambda i, j: (j, i)),
                   pl.BlockSpec((None, None), lambda i, j: (i, j))),
        compiler_params=plt.CompilerParams(num_warps=4), interpret=interpret,
    )((1.0 / scale).reshape(1), dy, gu2, gu2)
    return q, qt, jnp.max(part)
  return call


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--rows", type=int, default=16384)
  p.add_argument("--cols", type=int, default=8192)
  p.add_argument("--swiglu-cols", type=int, default=11008, help="F of the SwiGLU rows (7B: 11008)")
  a = p.parse_args()
  interpret = jax.default_backend() != "gpu"
  kx, kg = jax.random.split(jax.random.key(0))
  h = (2 * jax.random.normal(kx, (a.rows, a.cols))).astype(jnp.bfloat16)
  dy = jax.random.normal(kg, (a.rows, a.cols)).astype(jnp.bfloat16)
  s = jnp.float32(0.01)
  cast4 = fused_cast(lambda x: x, 1, E4M3, interpret)
  cast5 = fused_cast(lambda x: x, 1, E5M2, interpret)
  xla_gelu = lambda x: jax.nn.gelu(x, approximate=True)  # noqa: E731
  xla_grad = lambda d, x: jax.vjp(xla_gelu, x)[1](d)[0]  # noqa: E731
  lib = jax.jit(lambda s, x, act=None: ct.cast_transpose_amax(  # noqa: E731
      x, s, E4M3, interpret=interpret, activation=act), static_argnums=2)
  rows = [("forward", "cast kernel alone", ms_per_call(cast4, (s, h))),
          ("forward", "fp8jax's cast kernel alone", ms_per_call(lib, (s, h))),
          ("forward", "fp8jax's cast kernel with activation='gelu'",
           ms_per_call(lib, (s, h, "gelu"))),
          ("forward", "XLA GELU, then the cast kernel",
           ms_per_call(jax.jit(lambda s, x: cast4(s, xla_gelu(x))), (s, h)))]
  for approx in (False, True):
    f = fused_cast(lambda x, t=tanh_of(approx, interpret): gelu(x, t), 1, E4M3, interpret)
    rows.append(("forward", f"GELU in the cast kernel, {'approx' if approx else 'exact'} tanh",
                 ms_per_call(f, (s, h))))
  rows.append(("backward", "XLA GELU derivative, then the cast kernel",
               ms_per_call(jax.jit(lambda s, d, x: cast5(s, xla_grad(d, x))), (s, dy, h))))
  for approx in (False, True):
    f = fused_cast(lambda d, x, t=tanh_of(approx, interpret): gelu_grad(d, x, t), 2, E5M2,
                   interpret)
    rows.append(("backward", f"derivative in the cast kernel, {'approx' if approx else 'exact'}"
                 " tanh", ms_per_call(f, (s, dy, h))))
  gu = (2 * jax.random.normal(kg, (a.rows, a.swiglu_cols, 2))).astype(jnp.bfloat16)
  xla_swiglu = lambda v: jax.nn.silu(v[..., 0]) * v[..., 1]  # noqa: E731 (fp8jax's MLP)
  rows.append(("SwiGLU forward", "cast kernel alone (on silu(gate) * up)",
               ms_per_call(cast4, (s, jax.jit(xla_swiglu)(gu)))))
  rows.append(("SwiGLU forward", "XLA SwiGLU, then the cast kernel",
               ms_per_call(jax.jit(lambda s, v: cast4(s, xla_swiglu(v))), (s, gu))))
  for approx in (False, True):
    f = fused_cast(lambda g, u, t=tanh_of(approx, interpret): silu(g, t) * u, 1, E4M3, interpret)
    rows.append(("SwiGLU forward", f"SwiGLU in the cast kernel, "
                 f"{'approx' if approx else 'exact'} tanh", ms_per_call(f, (s, gu))))
  pairs = gu.reshape(a.rows, 2 * a.swiglu_cols)  # interleaved (gate, up): the same bytes
  rows.append(("SwiGLU forward", "fp8jax's cast kernel with activation='swiglu' (interleaved "
               "pairs read as 32-bit words)", ms_per_call(lib, (s, pairs, "swiglu"))))
  # The same with gate and up as the two column halves of gu2[M, 2F] (a gate/up GEMM whose
  # weight is laid out [D, 2, F]): each tile is a contiguous [bm, bk] block.
  gu2 = jnp.concatenate([gu[..., 0], gu[..., 1]], axis=1)
  rows.append(("SwiGLU forward", "XLA SwiGLU on halves [M, 2F], then the cast kernel",
               ms_per_call(jax.jit(lambda s, v: cast4(s, jax.nn.silu(v[:, :a.swiglu_cols]) *
                                                     v[:, a.swiglu_cols:])), (s, gu2))))
  for approx in (False, True):
    f = fused_cast(lambda g, u, t=tanh_of(approx, interpret): silu(g, t) * u, 2, E4M3, interpret,
                   halves=True)
    rows.append(("SwiGLU forward", f"SwiGLU on halves in the cast kernel, "
                 f"{'approx' if approx else 'exact'} tanh", ms_per_call(f, (s, gu2))))
  # Backward: SwiGLU's input gradient [d_gate | d_up] from dy[M, F] and gu2, cast to E5M2
  # [M, 2F] for the gate/up GEMM's dgrad and wgrad.
  f_ = a.swiglu_cols
  dys = jax.random.normal(kx, (a.rows, f_)).astype(jnp.bfloat16)
  xla_swiglu2 = lambda v: jax.nn.silu(v[:, :f_]) * v[:, f_:]  # noqa: E731
  xla_swiglu_grad = lambda d, v: jax.vjp(xla_swiglu2, v)[1](d)[0]  # noqa: E731
  rows.append(("SwiGLU backward", "cast kernel alone (on the stored [M, 2F] gradient)",
               ms_per_call(cast5, (s, jax.jit(xla_swiglu_grad)(dys, gu2)))))
  rows.append(("SwiGLU backward", "XLA derivative on halves, then the cast kernel",
               ms_per_call(jax.jit(lambda s, d, v: cast5(s, xla_swiglu_grad(d, v))),
                           (s, dys, gu2))))
  xla_pairs_grad = lambda d, v: jax.vjp(xla_swiglu, v)[1](d)[0]  # noqa: E731 (fp8jax's MLP)
  rows.append(("SwiGLU backward", "XLA derivative on gu[M, F, 2], then the cast kernel",
               ms_per_call(jax.jit(lambda s, d, v: cast5(
                   s, xla_pairs_grad(d, v).reshape(a.rows, 2 * f_))), (s, dys, gu))))
  lib_grad = jax.jit(lambda s, d, v: ct.cast_transpose_amax(
      d, s, E5M2, interpret=interpret, activation="swiglu", activation_input=v))
  rows.append(("SwiGLU backward", "fp8jax's cast kernel with the swiglu derivative "
               "(interleaved pairs in and out)", ms_per_call(lib_grad, (s, dys, pairs))))
  for approx in (False, True):
    f = swiglu_grad_cast(E5M2, interpret, tanh_of(approx, interpret))
    rows.append(("SwiGLU backward", f"derivative on halves in the cast kernel, "
                 f"{'approx' if approx else 'exact'} tanh", ms_per_call(f, (s, dys, gu2))))
  print(f"h[{a.rows}, {a.cols}] bf16, gu[{a.rows}, {a.swiglu_cols}, 2] bf16 on "
        f"{jax.devices()[0].device_kind}\n")
  print("| pass | variant | ms |\n|---|---|---|")
  for pass_, name, t in rows:
    print(f"| {pass_} | {name} | {t:.3f} |")
  # Accuracy on 1024 rows: each GELU rounded to bf16 against float64.
  x = h[:1024]
  x64 = np.asarray(x, np.float64)
  ref = 0.5 * x64 * (1 + np.tanh(C0 * (x64 + C1 * x64 ** 3)))
  def err(v):
    return float(np.linalg.norm(np.asarray(v, np.float64) - ref) / np.linalg.norm(ref))
  scale = jnp.float32(1 / 64)  # E4M3 holds |GELU| <= 7 to its 3 mantissa bits
  q = fused_cast(lambda v: gelu(v, tanh_of(True, interpret)), 1, E4M3, interpret)
  exact_bf16 = jnp.asarray(ref, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
  got = np.asarray(q(scale, x)[0], np.float32) / 64
  exact_e4m3 = np.asarray(scaling.quantize(exact_bf16, scale, E4M3), np.float32) / 64
  print(f"\nGELU error vs float64: exact value rounded to bf16 {err(exact_bf16):.2e}; "
        f"approx-tanh kernel's E4M3 cast {err(got):.2e}; exact value rounded to E4M3 "
        f"{err(exact_e4m3):.2e}")


if __name__ == "__main__":
  main()
