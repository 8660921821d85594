"""Chosen data-parallel groups made slower by extra work: a stand-in for a slower GPU kind
when every device is the same kind (a balancing benchmark's input, not part of fp8jax)."""
from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def slowed_apply(apply_fn: Callable, repeats: Sequence[int], axes) -> Callable:
  """`apply_fn` (``(variables, tokens int32[B, T]) -> logits``) whose call on data-parallel
  group g also runs ``repeats[g]`` extra forward + backward passes of it, with results
  multiplied by zero. Use inside ``jax.shard_map`` manual over `axes` (the per-group loop);
  every group runs the same program, the count is data.

  The extra passes see stop-gradient inputs, so the step's gradients are unchanged."""
  table = jnp.asarray(repeats, jnp.int32)

  def apply(variables, tokens):
    logits = apply_fn(variables, tokens)
    fixed = lax.stop_gradient(variables)
    total = lambda v, t: jnp.sum(apply_fn(v, t).astype(jnp.float32))

    def again(_, acc):
      shift = (acc * 0).astype(tokens.dtype)  # depends on the carry: not hoisted
      loss, grads = jax.value_and_grad(total)(fixed, tokens + shift)
      return acc + loss + sum(jnp.sum(g.astype(jnp.float32)) for g in jax.tree.leaves(grads))

    extra = lax.fori_loop(0, table[lax.axis_index(axes)], again, jnp.zeros((), jnp.float32))
    return logits + (0.0 * lax.stop_gradient(extra)).astype(logits.dtype)
  return apply
