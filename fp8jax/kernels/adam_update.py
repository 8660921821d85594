"""One pass per tensor for the O2 optimizer step: Adam with E4M3/FP16 moments + FP16 master.

XLA splits this update into ~9 kernels per tensor that re-read the moments; this Pallas kernel
(Triton backend) reads gradient, moments and master weight once and writes the three new
payloads once (11 bytes per parameter with FP8 gradients), plus a per-block max |new weight|.

`adam_master_update(g, mu, nu, w, scalars, seed)` works on one tensor's payloads flattened to
[N] (N a multiple of `BLOCK`). `scalars` is f32[NUM_SCALARS] (see `S_*` below), `seed` u32[1]
seeds the stochastic rounding of the master weight (:mod:`fp8jax.optim.rounding`'s stream).
Returns (mu', nu', w', amax_blocks f32[N / BLOCK]). The per-element math is
:func:`update_reference`'s, which mirrors ``fp8jax.optim.adamw`` followed by
``apply_master_updates``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.optim.rounding import index_bits, round_with_bits

BLOCK = 2048
NUM_WARPS = 8
# Indices into the f32 scalar vector (per tensor).
(S_G, S_MU_OLD, S_NU_OLD, S_INV_MU, S_NU_NEW, S_INV_NU, S_BC1, S_RFAC, S_EPS, S_WD, S_STEP,
 S_OK, S_W_OLD, S_W_NEW, S_INV_W, S_OK_W) = range(16)
NUM_SCALARS = 16


def update_reference(g, mu, nu, w, s, seed, index, b1: float, b2: float):
  """New (mu, nu, w payloads, |x| with NaN as inf) for elements at flat `index` (uint32).

  `s`: indexable scalars (see S_*); `seed`: uint32 seed of the master weight's stochastic
  rounding (:func:`fp8jax.optim.rounding.index_bits`).
  """
  f32 = jnp.float32
  g = g.astype(f32) * s[S_G]
  r_old = nu.astype(f32) * s[S_NU_OLD]
  m_old = (mu.astype(f32) * s[S_MU_OLD]) * r_old
  m = b1 * m_old + (1.0 - b1) * g
  x, y = r_old * s[S_INV_NU], g * s[S_INV_NU]
  r_units = jnp.sqrt(b2 * (x * x) + (1.0 - b2) * (y * y))
  upd = (m / s[S_BC1]) / (r_units * s[S_RFAC] + s[S_EPS])
  ok = s[S_OK] > 0
  upd = jnp.where(ok, upd, 0.0)
  r = r_units * s[S_NU_NEW]
  u = jnp.where(r > 0, m / jnp.where(r > 0, r, 1.0), 0.0)
  fmax_mu, fmax_nu = float(jnp.finfo(mu.dtype).max), float(jnp.finfo(nu.dtype).max)
  new_mu = jnp.clip(u * s[S_INV_MU], -fmax_mu, fmax_mu).astype(mu.dtype)
  new_nu = jnp.minimum(r_units, fmax_nu).astype(nu.dtype)
  new_mu = jnp.where(ok, new_mu, mu)
  new_nu = jnp.where(ok, new_nu, nu)
  p = w.astype(f32) * s[S_W_OLD]
  upd = (upd + s[S_WD] * p) * s[S_STEP]
  upd = jnp.where(ok, upd, 0.0)
  xw = p + upd
  fmax_w = float(jnp.finfo(w.dtype).max)
  yw = jnp.clip(xw * s[S_INV_W], -fmax_w, fmax_w)
  new_w = round_with_bits(yw, w.dtype, index_bits(index, seed))
  new_w = jnp.where(s[S_OK_W] > 0, new_w, w)
  mag = jnp.where(jnp.isnan(xw), jnp.inf, jnp.abs(xw))
  return new_mu, new_nu, new_w, mag


def _kernel(g_ref, mu_ref, nu_ref, w_ref, s_ref, seed_ref, mu_out, nu_out, w_out, amax_out, *,
            b1, b2, block):
  s = [s_ref[i] for i in range(NUM_SCALARS)]
  from jax.experimental import pallas as pl
  index = (pl.program_id(0).astype(jnp.uint32) * jnp.uint32(block)
           + lax.broadcasted_iota(jnp.uint32, (block,), 0))
  new_mu, new_nu, new_w, mag = update_reference(g_ref[...], mu_ref[...], nu_ref[...],
                                                w_ref[...], s, seed_ref[0], index, b1, b2)
  mu_out[...] = new_mu
  nu_out[...] = new_nu
  w_out[...] = new_w
  amax_out[...] = jnp.broadcast_to(jnp.max(mag), (1,))


@functools.partial(jax.jit, static_argnames=("b1", "b2", "interpret", "block", "num_warps"))
def adam_master_update(g, mu, nu, w, scalars, seed, *, b1: float, b2: float,
                       interpret: bool = False, block: int = BLOCK, num_warps: int = NUM_WARPS):
  """The fused update of one tensor (see the module docstring); all payloads f[N]."""
  from jax.experimental import pallas as pl
  n = g.shape[0]
  if n % block or not (g.shape == mu.shape == nu.shape == w.shape) or g.ndim != 1:
    raise ValueError(f"adam_master_update: payloads must be 1-D of one length, a multiple of "
                     f"{block}; got {[a.shape for a in (g, mu, nu, w)]}")
  grid = n // block
  vec = pl.BlockSpec((block,), lambda i: (i,))
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1))
  return pl.pallas_call(
      functools.partial(_kernel, b1=b1, b2=b2, block=block), grid=(grid,),
      in_specs=[vec, vec, vec, vec, pl.BlockSpec((NUM_SCALARS,), lambda i: (0,)),
                pl.BlockSpec((1,), lambda i: (0,))],
      out_specs=[vec, vec, vec, pl.BlockSpec((1,), lambda i: (i,))],
      out_shape=[jax.ShapeDtypeStruct((n,), mu.dtype), jax.ShapeDtypeStruct((n,), nu.dtype),
                 jax.ShapeDtypeStruct((n,), w.dtype), jax.ShapeDtypeStruct((grid,), jnp.float32)],
      interpret=interpret, **params)(g, mu, nu, w, scalars, seed)
