"""Gradient accumulation that knows FP8 state: parameters sum, FP8 state combines by max.

FP8 state arrives in a gradient tree as its updated value (overwrite-with-gradient), so over
microbatches it must combine by max (the largest amax seen) and never be summed or averaged.
Any :class:`~fp8jax.Fp8Meta` subtree of a gradient tree is treated as FP8 state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.scaling import Fp8Meta, combine_max


def _is_fp8(x) -> bool:
  return isinstance(x, Fp8Meta)


def widen(x):
  """A floating array in at least f32 (gradient sums and reductions run in f32); others as
  they are."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))
  return x


def accumulator_zeros(tree):
  """Zeros shaped like `tree` to sum microbatch gradients into: floating leaves in at least
  f32 whatever their compute dtype (BF16 gradients sum in f32), others in their dtype."""
  return jax.tree.map(lambda x: jnp.zeros_like(widen(x)), tree)


def accumulate_gradients(acc, grads, where=None):
  """acc + grads for gradients, max for FP8 state; `acc=None` starts from `grads`.
  `where`: None, or a bool scalar (possibly traced): `acc` unchanged where it is False (a
  microbatch slot that did not run)."""
  if acc is None:
    return grads
  out = jax.tree.map(lambda a, g: combine_max(a, g) if _is_fp8(a) else a + g, acc, grads,
                     is_leaf=_is_fp8)
  if where is None:
    return out
  return jax.tree.map(lambda n, o: jnp.where(where, n, o), out, acc)


def mean_gradients(acc, count):
  """Divides accumulated gradients by `count` microbatches (an int >= 1, or an int32 scalar,
  possibly traced); FP8 state is left as is."""
  if isinstance(count, int) and count < 1:
    raise ValueError(f"count={count!r} is not allowed; use an integer >= 1")
  n = count if isinstance(count, int) else jnp.asarray(count).astype(jnp.float32)
  return jax.tree.map(lambda a: a if _is_fp8(a) else a / jnp.asarray(n, a.dtype), acc,
                      is_leaf=_is_fp8)
