"""One training step: microbatch accumulation, clipping and update, FP8 state by max.

The batch is split into `microbatches` equal parts and scanned over; parameter gradients are
summed then averaged, FP8 state updates combine by max (``fp8jax.accumulate_gradients``), so
the step's gradient equals the full batch's and its FP8 state reflects the largest amax seen.
Clipping, weight decay and the learning-rate schedule live in the optax transform `tx`.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from fp8jax.accumulate import accumulate_gradients, accumulator_zeros, widen
from fp8jax.linen import FP8_COLLECTION, apply_fp8_updates
from fp8jax.optim import MasterWeights, apply_master_updates
from fp8jax.train.state import TrainState


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token loss in f32 nats; logits [B, T, V], targets int [B, T]."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return jnp.mean(losses)


def _loss(apply_fn: Callable, variables, batch):
  """batch int32[B, T+1] -> mean loss of predicting batch[:, 1:] from batch[:, :-1]."""
  return cross_entropy(apply_fn(variables, batch[:, :-1]), batch[:, 1:])


def make_train_step(apply_fn: Callable, tx: optax.GradientTransformation, microbatches: int = 1,
                    *, gather_params: Callable | None = None,
                    reduce_gradients: Callable | None = None,
                    fused_update: Callable | None = None,
                    cast_weights: Callable | None = None,
                    matrix_dtype=None):
  """A jittable ``step(state, batch) -> (state, metrics)``.

  Args:
    apply_fn: ``apply_fn(variables, tokens[B, T]) -> logits[B, T, V]``.
    tx: the optimizer (including clipping); it sees parameters only.
    microbatches: equal parts the batch is split into (must divide its first dimension).
    gather_params: optional ``params -> params`` applied before the forward (ZeRO-3's weight
      all-gather, ``fp8jax.parallel.zero``); differentiable.
    reduce_gradients: optional ``grads -> grads`` applied to each microbatch's parameter
      gradients (ZeRO's all-reduce / reduce-scatter layout); they reach it in f32.
    fused_update: optional ``(master, opt_state, grads, finite, grad_norm) -> (master,
      opt_state)`` replacing `tx` plus ``apply_master_updates`` for FP16 master weights
      (:func:`fp8jax.train.optimizer.make_fused_update`); `finite` (bool[]): loss and
      gradient norm are finite, else the update changes nothing.
    cast_weights: optional ``variables -> extra collections`` computed once per step, before
      the microbatch loop, and applied with every microbatch
      (``functools.partial(fp8jax.linen.cast_weights, recipe=..., dtype=...)``: FP8 weights
      cast once per optimizer step, not once per microbatch); not with `gather_params`.
    matrix_dtype: optional dtype the FP16 master weights' GEMM weights (leaves named kernel
      or embedding, ``fp8jax.params``) are decoded to for the forward and backward: the
      model's compute dtype (BF16), exact for a model that casts them to it before use, as
      fp8jax's GPT does. The decoded copy and its gradient then take 2 bytes per parameter
      instead of 4 each; gradients are still summed over microbatches, reduced and clipped
      in f32. No effect on plain (O0/O1) params; not with `gather_params`.
  Metrics: loss (mean over the batch), grad_norm (before clipping).
  """
  if microbatches < 1:
    raise ValueError(f"microbatches={microbatches!r} is not allowed; use an integer >= 1")
  if cast_weights is not None and gather_params is not None:
    raise ValueError("cast_weights with gather_params is not supported: the weights are "
                     "gathered per microbatch (ZeRO-3); cast them there")
  if matrix_dtype is not None and gather_params is not None:
    raise ValueError("matrix_dtype with gather_params is not supported: ZeRO-3 gathers the "
                     "master weights' payloads itself")
  if matrix_dtype is not None and not jnp.issubdtype(jnp.dtype(matrix_dtype), jnp.floating):
    raise ValueError(f"matrix_dtype={matrix_dtype!r} is not a floating dtype")

  def loss_of(variables, batch, extra):
    if gather_params is not None:
      variables = {**variables, "params": gather_params(variables["params"])}
    return _loss(apply_fn, {**variables, **extra}, batch)

  def grads(variables, batch, extra):
    loss, g = jax.value_and_grad(loss_of)(variables, batch, extra)
    if reduce_gradients is not None:
      g = {**g, "params": reduce_gradients(jax.tree.map(widen, g["params"]))}
    return loss, g

  def step(state: TrainState, batch):
    if batch.shape[0] % microbatches:
      raise ValueError(f"batch of {batch.shape[0]} sequences does not split into "
                       f"{microbatches} microbatches")
    variables = state.variables(matrix_dtype)  # decoded once, for every microbatch
    extra = {}
    if cast_weights is not None:  # once, for every microbatch
      extra = cast_weights(jax.lax.stop_gradient(variables))
    if microbatches == 1:  # no accumulator: the gradient as it comes
      loss, g = grads(variables, batch, extra)
      if fused_update is None:  # the fused update reads narrow gradients itself
        g = {**g, "params": jax.tree.map(widen, g["params"])}
      return apply_gradients(state, tx, g, loss, fused_update)
    parts = batch.reshape(microbatches, batch.shape[0] // microbatches, *batch.shape[1:])

    def body(carry, part):
      loss_sum, acc = carry
      loss, g = grads(variables, part, extra)
      return (loss_sum + loss, accumulate_gradients(acc, g)), None

    (loss_sum, acc), _ = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), accumulator_zeros(variables)), parts)
    acc = {**acc, "params": jax.tree.map(lambda g: g / microbatches, acc["params"])}
    return apply_gradients(state, tx, acc, loss_sum / microbatches, fused_update)

  return step


def apply_gradients(state: TrainState, tx: optax.GradientTransformation, grads, loss,
                    fused_update: Callable | None = None):
  """The update half of a step: ``(new_state, {"loss", "grad_norm"})``.

  `grads`: the step's gradient of all variables: mean parameter gradients under "params"
  and the FP8 state combined by max over microbatches under the FP8 collection.
  `fused_update`: see :func:`make_train_step` (master weights only; other params raise).
  """
  param_grads = grads["params"]
  grad_norm = optax.tree.norm(jax.tree.map(widen, param_grads))  # summed in f32
  fp8 = apply_fp8_updates(state.variables(), grads).get(FP8_COLLECTION, {})
  if fused_update is not None and not isinstance(state.params, MasterWeights):
    raise ValueError("fused_update needs FP16 master weights (level O2: params are "
                     f"MasterWeights), got params of type {type(state.params).__name__}")
  if fused_update is not None:
    # It skips a step whose loss or gradients are not finite by itself (nothing changes).
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_params, opt_state = fused_update(state.params, state.opt_state, param_grads, finite,
                                         grad_norm)
    return (state._replace(step=state.step + 1, params=new_params, fp8=fp8,
                           opt_state=opt_state), {"loss": loss, "grad_norm": grad_norm})
  updates, opt_state = tx.update(param_grads, state.opt_state, state.model_params())
  if isinstance(state.params, MasterWeights):  # FP16 master weights: update in f32, re-round
    # The level's optimizer zeroes the updates of a step with non-finite gradients, so the
    # gradient norm decides finiteness (no second pass over the updates).
    new_params = apply_master_updates(state.params, updates, finite=jnp.isfinite(grad_norm))
  else:
    new_params = optax.apply_updates(state.params, updates)
  new_state = state._replace(step=state.step + 1, params=new_params, fp8=fp8,
                             opt_state=opt_state)
  return new_state, {"loss": loss, "grad_norm": grad_norm}


def make_eval_step(apply_fn: Callable):
  """A jittable ``eval_step(state, batch) -> mean loss`` (FP8 state is not updated)."""
  return lambda state, batch: _loss(apply_fn, state.variables(), batch)
