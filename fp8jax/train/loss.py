"""The loss of a microbatch and its gradient: next-token cross entropy of a model's logits."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from fp8jax import fsdp
from fp8jax.accumulate import widen


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean cross entropy (f32 nats per token) of logits [B, T, V] (any float dtype, computed
  in f32) against int targets [B, T]."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return jnp.mean(losses)


def batch_loss(apply_fn: Callable, variables, batch) -> jax.Array:
  """:func:`cross_entropy` of a model on a batch: batch int32[B, T+1] -> mean loss (f32 nats
  per token) of predicting batch[:, 1:] from batch[:, :-1] with
  ``apply_fn(variables, tokens[B, T]) -> logits[B, T, V]``."""
  return cross_entropy(apply_fn(variables, batch[:, :-1]), batch[:, 1:])


def microbatch_grads(apply_fn: Callable, weight_gather, reduce_gradients) -> Callable:
  """``(variables, part, extra=None) -> (loss, grads)`` of one microbatch (under ZeRO-3's
  gather at use; with `reduce_gradients` applied to the f32 parameter gradients)."""
  def grad_fn(variables, part, extra=None):
    def loss_of(v):
      return batch_loss(apply_fn, {**v, **(extra or {})}, part)
    with fsdp.gathering(weight_gather):
      loss, g = jax.value_and_grad(loss_of)(variables)
    if reduce_gradients is not None:
      g = {**g, "params": reduce_gradients(jax.tree.map(widen, g["params"]))}
    return loss, g
  return grad_fn

