"""Deterministic stochastic rounding from a counter-based hash (no RNG state).

``stochastic_round(y, dtype, seed)`` rounds f32 `y` to `dtype` up or down with probabilities
proportional to the distances, so the expected stored value is `y`: an update of a tenth of
an ulp survives on average instead of being rounded away every step. The random bits are a
hash of the element's global index and `seed` (e.g. the step count and the tensor's position
in the tree), so results are reproducible and do not depend on how the array is sharded under
``jax.jit`` (inside ``shard_map`` the index is the local one).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def hash32(x: jax.Array) -> jax.Array:
  """lowbias32 integer hash of uint32 `x` (well mixed, cheap: 2 multiplies, 3 shifts)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * jnp.uint32(0x846CA68B)
  return x ^ (x >> 16)


def element_bits(shape, seed) -> jax.Array:
  """uint32 random bits per element of `shape`: hash of (flat index, `seed`)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % (1 << 32))
    stride *= shape[dim]
  return index_bits(index, seed)


def index_bits(index: jax.Array, seed) -> jax.Array:
  """uint32 random bits for elements at flat uint32 `index`, from (index, `seed`).

  The seed is mixed once (:func:`hash32`); per element it is one xor and one multiply by an
  odd constant (a Fibonacci hash), whose *high* bits are uniform: for any fixed index the
  xor with a uniformly random key is uniform, and so is its product with an odd number.
  Callers use the top bits (:func:`round_with_bits` takes the high `drop` bits). One
  multiply instead of hash32's two multiplies and three shifts keeps the fused optimizer
  kernel near memory speed.
  """
  key = hash32(jnp.asarray(seed).astype(jnp.uint32) ^ jnp.uint32(0x9E3779B9))
  return (index ^ key) * jnp.uint32(0x9E3779B1)


def stochastic_round(y: jax.Array, dtype, seed) -> jax.Array:
  """f32 `y` rounded to `dtype` stochastically (unbiased where `dtype` is normal).

  Adds uniform random bits below `dtype`'s last mantissa bit and truncates them. Finite `y`
  within dtype's range never rounds past its largest finite value (the caller clips);
  values in dtype's subnormal range fall back to round-to-nearest.
  """
  if 23 - int(jnp.finfo(dtype).nmant) <= 0:
    return y.astype(dtype)
  return round_with_bits(y, dtype, element_bits(y.shape, seed))


def round_with_bits(y: jax.Array, dtype, random_bits: jax.Array) -> jax.Array:
  """:func:`stochastic_round` with the caller's uint32 `random_bits` (shaped like `y`)."""
  drop = 23 - int(jnp.finfo(dtype).nmant)
  if drop <= 0:
    return y.astype(dtype)
  bits = lax.bitcast_convert_type(y.astype(jnp.float32), jnp.uint32)
  noise = random_bits >> np.uint32(32 - drop)
  mask = jnp.uint32(((1 << 32) - 1) ^ ((1 << drop) - 1))
  rounded = lax.bitcast_convert_type((bits + noise) & mask, jnp.float32)
  return jnp.where(jnp.isfinite(y), rounded, y).astype(dtype)
