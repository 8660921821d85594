"""Bit-level pieces of deterministic stochastic rounding, shared by the fused optimizer kernel
(:mod:`fp8jax.kernels.adam_update`) and :func:`fp8jax.optim.stochastic_round`.

Random bits are a counter-based hash of an element's flat index and a seed (no RNG state);
:func:`round_with_bits` adds the high bits below the target dtype's last mantissa bit to an f32
value and truncates them, so the expected stored value is the f32 value.
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


def round_with_bits(y: jax.Array, dtype, random_bits: jax.Array) -> jax.Array:
  """f32 `y` rounded to `dtype` stochastically with the caller's uint32 `random_bits` (shaped
  like `y`; their high bits are used): unbiased where `dtype` is normal. Finite `y` within
  dtype's range never rounds past its largest finite value (the caller clips); values in
  dtype's subnormal range fall back to round-to-nearest; non-finite `y` passes through."""
  drop = 23 - int(jnp.finfo(dtype).nmant)
  if drop <= 0:
    return y.astype(dtype)
  bits = lax.bitcast_convert_type(y.astype(jnp.float32), jnp.uint32)
  noise = random_bits >> np.uint32(32 - drop)
  mask = jnp.uint32(((1 << 32) - 1) ^ ((1 << drop) - 1))
  rounded = lax.bitcast_convert_type((bits + noise) & mask, jnp.float32)
  return jnp.where(jnp.isfinite(y), rounded, y).astype(dtype)
