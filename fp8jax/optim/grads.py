"""Gradients that arrive in FP8 with a per-tensor scale.

:func:`quantize_updates` casts a gradient tree to :class:`ScaledArray` leaves (what FP8
gradient communication sends: 1 byte per element plus one f32 scale per tensor).
:func:`fp8jax.optim.scale_by_adam`, :func:`~fp8jax.optim.adam` and
:func:`~fp8jax.optim.adamw` take such trees directly. Transforms that do not know
ScaledArray (``optax.clip_by_global_norm``, ``optax.MultiSteps``, ...) need
:func:`dequantize_updates` in front of them; under ``jax.jit`` the dequantization fuses into
its consumers, so no f32 copy of the gradients is materialised.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from fp8jax.optim.scaled import dequantize_scaled, is_scaled, quantize_leaves


def quantize_updates(updates, dtype=jnp.float8_e4m3fn, *, margin: float = 0,
                     axis_names: Sequence[str] = ()):
  """Every floating leaf of `updates` as a ScaledArray of `dtype` (one agreed scale per tensor)."""
  leaves, treedef = jax.tree.flatten(updates, is_leaf=is_scaled)
  idx = [i for i, u in enumerate(leaves) if not is_scaled(u)
         and jnp.issubdtype(jnp.asarray(u).dtype, jnp.floating)]
  qs = quantize_leaves([leaves[i] for i in idx], dtype, margin=margin, axis_names=axis_names)
  for i, q in zip(idx, qs):
    leaves[i] = q
  return jax.tree.unflatten(treedef, leaves)


def dequantize_tree(tree, dtype=jnp.float32):
  """ScaledArray leaves of `tree` as plain `dtype` arrays; other leaves unchanged."""
  return jax.tree.map(lambda x: dequantize_scaled(x, dtype) if is_scaled(x) else x, tree,
                      is_leaf=is_scaled)


def dequantize_updates(dtype=jnp.float32) -> optax.GradientTransformation:
  """Stateless transform: ScaledArray gradients -> plain `dtype` arrays (put first in a chain)."""
  def update(updates, state, params=None):
    del params
    return dequantize_tree(updates, dtype), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)
