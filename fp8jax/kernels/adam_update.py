"""One pass per tensor for the O2 optimizer step: Adam with E4M3/FP16 moments + FP16 master.

XLA splits this update into ~9 kernels per tensor that re-read the moments; this Pallas kernel
(Triton backend) reads gradient, moments and master weight once and writes the three new
payloads once (11 bytes per parameter with FP8 gradients), plus a per-block max |new weight|.

`adam_master_update(g, mu, nu, w, table, seed, amax, scales, row=i, offset=k)` works on
tensor i's payloads flattened to [N] (N a multiple of `BLOCK`). All tensors of a step share
one scalar table (row i: f32[NUM_SCALARS], see `S_*` below), one u32[1] seed of the master
weight's stochastic rounding (:mod:`fp8jax.kernels.rounding`'s stream; tensor i uses seed + i)
and one f32 buffer of per-block max |new weight| (tensor i writes entries k .. k + N / BLOCK);
each kernel also writes its tensor's three new scales in place, so a step of L tensors is L
kernels and a handful of small XLA ops. The per-element math is :func:`update_reference`'s,
which mirrors ``fp8jax.optim.adamw`` followed by ``apply_master_updates``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.kernels.rounding import index_bits, round_with_bits

BLOCK = 2048
NUM_WARPS = 8
# Triton addresses a call's elements with 32-bit offsets (program_id * block): a call takes at
# most 2**31 - 1 of them (a larger tensor read garbage: the 7B config's stacked SwiGLU input
# kernel, 2.9e9 elements, got an infinite scale); larger tensors go in chunks.
MAX_CALL_ELEMENTS = 2**31 - 1
# Indices into the f32 scalar vector (per tensor).
(S_G, S_MU_OLD, S_NU_OLD, S_INV_MU, S_NU_NEW, S_INV_NU, S_BC1, S_RFAC, S_EPS, S_WD, S_STEP,
 S_OK, S_W_OLD, S_W_NEW, S_INV_W, S_MU_NEW) = range(16)
NUM_SCALARS = 16


def update_math(g, mu, nu, w, s, seed, index, b1: float, b2: float):
  """New (mu, nu, w payloads, |x| with NaN as inf) for elements at flat `index` (uint32),
  assuming the step is taken (see :func:`update_reference` for the skip).

  `s`: indexable scalars (see S_*); `seed`: uint32 seed of the master weight's stochastic
  rounding (:func:`fp8jax.kernels.rounding.index_bits`).
  """
  f32 = jnp.float32
  g = g.astype(f32) * s[S_G]
  r_old = nu.astype(f32) * s[S_NU_OLD]
  m_old = (mu.astype(f32) * s[S_MU_OLD]) * r_old
  m = b1 * m_old + (1.0 - b1) * g
  x, y = r_old * s[S_INV_NU], g * s[S_INV_NU]
  # One division per element: the root and 1/root from one rsqrt (0 below f32's smallest
  # normal, where an approximate rsqrt may flush; FP16 stores such r as 0 anyway).
  z = b2 * (x * x) + (1.0 - b2) * (y * y)
  inv_r = jnp.where(z >= jnp.finfo(f32).tiny, lax.rsqrt(z), 0.0)
  r_units = z * inv_r
  upd = (m * (1.0 / s[S_BC1])) / (r_units * s[S_RFAC] + s[S_EPS])
  u = m * inv_r * s[S_INV_NU]
  fmax_mu, fmax_nu = float(jnp.finfo(mu.dtype).max), float(jnp.finfo(nu.dtype).max)
  new_mu = jnp.clip(u * s[S_INV_MU], -fmax_mu, fmax_mu).astype(mu.dtype)
  new_nu = jnp.minimum(r_units, fmax_nu).astype(nu.dtype)
  p = w.astype(f32) * s[S_W_OLD]
  xw = p + (upd + s[S_WD] * p) * s[S_STEP]
  fmax_w = float(jnp.finfo(w.dtype).max)
  yw = jnp.clip(xw * s[S_INV_W], -fmax_w, fmax_w)
  new_w = round_with_bits(yw, w.dtype, index_bits(index, seed))
  mag = jnp.where(jnp.isnan(xw), jnp.inf, jnp.abs(xw))
  return new_mu, new_nu, new_w, mag


def update_reference(g, mu, nu, w, s, seed, index, b1: float, b2: float):
  """:func:`update_math`, where the step is skipped (s[S_OK] == 0) the old payloads and a
  magnitude of 0."""
  new_mu, new_nu, new_w, mag = update_math(g, mu, nu, w, s, seed, index, b1, b2)
  ok = s[S_OK] > 0
  return (jnp.where(ok, new_mu, mu), jnp.where(ok, new_nu, nu), jnp.where(ok, new_w, w),
          jnp.where(ok, mag, 0.0))


def _kernel(g_ref, mu_ref, nu_ref, w_ref, s_ref, seed_ref, amax_in, mu_s_in, nu_s_in, w_s_in,
            mu_out, nu_out, w_out, amax_out, mu_s_out, nu_s_out, w_s_out, *, b1, b2, block,
            row, start):
  """One block; a skipped step (s[S_OK] == 0) writes nothing: the outputs alias the inputs.
  The first block also writes the tensor's three new scales."""
  del amax_in, mu_s_in, nu_s_in, w_s_in  # aliased to the outputs
  from jax.experimental import pallas as pl
  s = [s_ref[row * NUM_SCALARS + i] for i in range(NUM_SCALARS)]
  first = pl.program_id(0) == 0
  index = (jnp.uint32(start) + pl.program_id(0).astype(jnp.uint32) * jnp.uint32(block)
           + lax.broadcasted_iota(jnp.uint32, (block,), 0))
  seed = seed_ref[0] + jnp.uint32(row)

  @pl.when((s[S_OK] > 0) & first)
  def _():
    for ref, k in ((mu_s_out, S_MU_NEW), (nu_s_out, S_NU_NEW), (w_s_out, S_W_NEW)):
      ref[...] = jnp.broadcast_to(s[k], (1,))

  @pl.when(s[S_OK] > 0)
  def _():
    new_mu, new_nu, new_w, mag = update_math(g_ref[...], mu_ref[...], nu_ref[...],
                                             w_ref[...], s, seed, index, b1, b2)
    mu_out[...] = new_mu
    nu_out[...] = new_nu
    w_out[...] = new_w
    amax_out[...] = jnp.broadcast_to(jnp.max(mag), (1,))


def scalar_table(rows) -> jax.Array:
  """f32[P]: the per-tensor scalar vectors (f32[L, NUM_SCALARS], or L vectors of
  f32[NUM_SCALARS]) back to back, zero-padded to a power of two (a Triton block must be one);
  tensor `i` reads row `i` at ``i * NUM_SCALARS``."""
  flat = jnp.asarray(rows, jnp.float32).reshape(-1)
  size = 1 << max(int(flat.shape[0]) - 1, 1).bit_length()
  return jnp.pad(flat, (0, size - flat.shape[0]))


@functools.partial(jax.jit, static_argnames=("row", "offset", "b1", "b2", "interpret", "block",
                                             "num_warps", "start"))
def adam_master_update(g, mu, nu, w, table, seed, amax, scales, *, row: int, offset: int,
                       b1: float, b2: float, interpret: bool = False, block: int = BLOCK,
                       num_warps: int = NUM_WARPS, start: int = 0):
  """The fused update of tensor `row` (see the module docstring); payloads f[N].

  `start`: flat index of the payloads' first element in their tensor (a chunk of a tensor
  too large for one call: :data:`MAX_CALL_ELEMENTS`); it keeps the stochastic rounding's
  stream the whole tensor's.

  `table`: :func:`scalar_table` of all tensors; `seed`: u32[1] base seed (tensor `row` uses
  ``seed + row``); `amax`: f32[M], whose entries ``offset .. offset + N / block`` receive the
  blocks' max |new weight| (the others are kept); `scales`: the tensor's (mu, nu, w) scales,
  f32[1] each, which become the table's S_MU_NEW, S_NU_NEW, S_W_NEW (kept when the step is
  skipped). mu, nu, w, amax and the scales are updated in place when donated, so the step
  launches no extra kernel per tensor for them. Returns (mu', nu', w', amax', scales').
  """
  from jax.experimental import pallas as pl
  n = g.shape[0]
  if n > MAX_CALL_ELEMENTS or start + n > 2**32:
    raise ValueError(f"adam_master_update: {n} elements from {start}: one call takes at most "
                     f"{MAX_CALL_ELEMENTS} (32-bit offsets) and indices below 2**32")
  if n % block or not (g.shape == mu.shape == nu.shape == w.shape) or g.ndim != 1:
    raise ValueError(f"adam_master_update: payloads must be 1-D of one length, a multiple of "
                     f"{block}; got {[a.shape for a in (g, mu, nu, w)]}")
  grid = n // block
  if (row + 1) * NUM_SCALARS > table.shape[0] or offset + grid > amax.shape[0]:
    raise ValueError(f"adam_master_update: row {row} / amax entries {offset}..{offset + grid} "
                     f"outside table f32[{table.shape[0]}] / amax f32[{amax.shape[0]}]")
  vec = pl.BlockSpec((block,), lambda i: (i,))
  blocks = pl.BlockSpec((1,), lambda i: (offset + i,))
  params = {}
  if not interpret:
    from jax.experimental.pallas import triton as plt
    params = dict(compiler_params=plt.CompilerParams(num_warps=num_warps, num_stages=1))
  one = pl.BlockSpec((1,), lambda i: (0,))
  scalar = jax.ShapeDtypeStruct((1,), jnp.float32)
  scales = tuple(jnp.asarray(x, jnp.float32).reshape(1) for x in scales)
  *out, mu_s, nu_s, w_s = pl.pallas_call(
      functools.partial(_kernel, b1=b1, b2=b2, block=block, row=row, start=start),
      grid=(grid,),
      in_specs=[vec, vec, vec, vec, pl.BlockSpec(table.shape, lambda i: (0,)), one, blocks,
                one, one, one],
      out_specs=[vec, vec, vec, blocks, one, one, one],
      out_shape=[jax.ShapeDtypeStruct((n,), mu.dtype), jax.ShapeDtypeStruct((n,), nu.dtype),
                 jax.ShapeDtypeStruct((n,), w.dtype),
                 jax.ShapeDtypeStruct(amax.shape, jnp.float32), scalar, scalar, scalar],
      # mu, nu, w, amax and the three scales updated in place
      input_output_aliases={1: 0, 2: 1, 3: 2, 6: 3, 7: 4, 8: 5, 9: 6},
      interpret=interpret, **params)(g, mu, nu, w, table, seed, amax, *scales)
  return (*out, (mu_s, nu_s, w_s))
