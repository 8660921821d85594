"""Non-finite gradients: detect them globally and skip the whole step.

A step whose gradients hold an inf or NaN anywhere (any leaf, any device) returns zero
updates and leaves the optimizer state exactly as it was (counts included, so bias
correction and schedules do not advance). Nothing is silently corrupted; callers that want
to count or report skipped steps check :func:`all_finite` themselves.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import optax

from fp8jax.optim.scaled import amaxes, is_scaled


def all_finite(tree, axis_names: Sequence[str] = ()) -> jax.Array:
  """bool[]: every element of every leaf (plain or :class:`ScaledArray`) is finite, agreed
  across devices (inside ``shard_map`` over `axis_names` and the leaves' varying axes)."""
  return jnp.all(jnp.isfinite(amaxes(jax.tree.leaves(tree, is_leaf=is_scaled), axis_names)))


def select_tree(pred, on_true, on_false):
  """Leafwise ``where(pred, on_true, on_false)`` over two trees of the same structure."""
  return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def skip_not_finite(inner: optax.GradientTransformation,
                    axis_names: Sequence[str] = ()) -> optax.GradientTransformationExtraArgs:
  """`inner`, except that a step with any non-finite gradient is skipped.

  Skipped: zero updates (shaped like the gradients, f32 for :class:`ScaledArray` ones) and
  the state of `inner` unchanged. The state is `inner`'s own (same structure), so the wrapper
  composes with ``optax.chain``, ``optax.masked`` and ``optax.MultiSteps``. Unlike
  ``optax.apply_if_finite`` it never applies a non-finite update after N failures.
  """
  inner = optax.with_extra_args_support(inner)

  def update(updates, state, params=None, **extra_args):
    ok = all_finite(updates, axis_names)
    new_updates, new_state = inner.update(updates, state, params, **extra_args)
    zeros = jax.tree.map(jnp.zeros_like, new_updates)
    return select_tree(ok, new_updates, zeros), select_tree(ok, new_state, state)

  return optax.GradientTransformationExtraArgs(inner.init, update)
