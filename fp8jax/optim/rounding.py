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
from jax import lax

from fp8jax.kernels.rounding import index_bits, round_with_bits


def element_bits(shape, seed) -> jax.Array:
  """uint32 random bits per element of `shape`: hash of (flat index, `seed`)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for dim in reversed(range(len(shape))):
    index = index + lax.broadcasted_iota(jnp.uint32, shape, dim) * jnp.uint32(stride % (1 << 32))
    stride *= shape[dim]
  return index_bits(index, seed)


def stochastic_round(y: jax.Array, dtype, seed) -> jax.Array:
  """f32 `y` rounded to `dtype` stochastically (unbiased where `dtype` is normal).

  Adds uniform random bits below `dtype`'s last mantissa bit and truncates them. Finite `y`
  within dtype's range never rounds past its largest finite value (the caller clips);
  values in dtype's subnormal range fall back to round-to-nearest.
  """
  if 23 - int(jnp.finfo(dtype).nmant) <= 0:
    return y.astype(dtype)
  return round_with_bits(y, dtype, element_bits(y.shape, seed))
