"""Gradient accumulation that knows FP8 state: parameters sum, FP8 state combines by max.

FP8 state arrives in a gradient tree as its updated value (overwrite-with-gradient), so over
microbatches it must combine by max (the largest amax seen) and never be summed or averaged.
Any :class:`~fp8jax.Fp8Meta` subtree of a gradient tree is treated as FP8 state.
"""
from __future__ import annotations

import jax

from fp8jax.scaling import Fp8Meta, combine_max


def _is_fp8(x) -> bool:
  return isinstance(x, Fp8Meta)


def accumulate_gradients(acc, grads):
  """acc + grads for gradients, max for FP8 state; `acc=None` starts from `grads`."""
  if acc is None:
    return grads
  return jax.tree.map(lambda a, g: combine_max(a, g) if _is_fp8(a) else a + g, acc, grads,
                      is_leaf=_is_fp8)


def mean_gradients(acc, count: int):
  """Divides accumulated gradients by `count` microbatches; FP8 state is left as is."""
  if count < 1:
    raise ValueError(f"count={count!r} is not allowed; use an integer >= 1")
  return jax.tree.map(lambda a: a if _is_fp8(a) else a / count, acc, is_leaf=_is_fp8)
