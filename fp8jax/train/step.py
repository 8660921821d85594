"""The train step, composed of small pieces.

One step ``(state, batch[, counts]) -> (state, metrics)`` is put together from:

* weight gather (ZeRO-3): the loss is traced under the plan's ``fp8jax.fsdp.WeightGather``,
  so the model gathers each parameter where it uses it (FP8 kernels as E4M3 bytes inside
  their GEMM, per layer inside the layer scan): XLA places the collectives in the uniform
  loop, explicit collectives do it inside the group loop's ``shard_map``
  (``GroupLoop.weight_gather``); none below stage 3;
* the microbatch loop: :func:`scan_microbatches` (every device runs the same static number of
  microbatches of the global batch, XLA places the collectives), :func:`group_microbatches`
  (inside ``jax.shard_map``: each data-parallel group loops over its own number of
  microbatches with no collective in the loop, then one reduction) or
  :func:`pipeline_microbatches` (pipeline stages over the mesh's "pipe" axis: the GPipe or
  1F1B schedule of :mod:`fp8jax.parallel.pipeline`);
* gradient reduction: ZeRO's layout constraint (``reduce_gradients``) in the scanned and
  pipeline loops; in the group loop each ZeRO-3 gradient is reduce-scattered where the
  backward makes it (f32, or FP8 with current scaling), the rest by
  :func:`fp8jax.parallel.grad_comm.reduce_over_groups` (f32 or FP8 with its scaling state)
  after the loop;
* the update: :func:`apply_gradients` (the optax transform plus FP16 master weights, or the
  fused O2 update);
* guards: ``fp8jax.train.guards.skip_nonfinite_steps``.

:func:`make_train_step` composes them into a jittable function; :func:`build_step` jits it on a
``fp8jax.parallel.ZeroPlan`` (shardings, donation, optimizer offload) together with the
placement of a host batch, as a :class:`TrainStep`.

Gradients: parameter gradients are summed over microbatches in f32 and divided by their
count (every microbatch holds the same number of tokens, so this is the full batch's mean-loss
gradient); FP8 state updates combine by max (``fp8jax.accumulate_gradients``). Clipping, weight
decay and the learning-rate schedule live in the optax transform `tx`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax

from fp8jax import fsdp
from fp8jax.accumulate import accumulate_gradients, accumulator_zeros, widen
from fp8jax.parallel import layout
from fp8jax.parallel import pipeline as pipeline_lib
from fp8jax.parallel.mesh import pipe_size
from fp8jax.parallel.zero import ZeroPlan
from fp8jax.train import guards
from fp8jax.train.batching import TrainStep, batch_placement, microbatch_count, pad_to
from fp8jax.train.group_loop import GroupLoop, group_microbatches, group_step_fn
from fp8jax.train.loss import batch_loss, microbatch_grads
from fp8jax.train.pipeline_loop import (PipelineLoop, pipeline_microbatches, pipeline_step_fn,
                                        stages_of)
from fp8jax.train.state import TrainState
from fp8jax.train.update import apply_gradients

__all__ = ["GroupLoop", "Loop", "PipelineLoop", "TrainStep", "UniformLoop", "apply_gradients",
           "build_step", "eval_loss_fn", "group_microbatches", "make_train_step",
           "microbatch_count", "pad_to",
           "pipeline_microbatches", "scan_microbatches", "stages_of"]


def scan_microbatches(grad_fn: Callable, variables, batch, microbatches: int, count=None):
  """The uniform loop: `batch` int32[B, T+1] split into `microbatches` equal parts, run in order.

  `grad_fn(variables, part) -> (loss, grads)`. `count`: None (all parts, a static scan) or an
  int32 scalar, possibly traced, in [1, microbatches]: only the first `count` parts run (a
  loop with a dynamic trip count over the fixed part shape, so one compiled program serves
  every count). Returns (mean loss, mean parameter gradients in f32 and FP8 state combined
  by max) over the parts that ran."""
  if batch.shape[0] % microbatches:
    raise ValueError(f"batch of {batch.shape[0]} sequences does not split into "
                     f"{microbatches} microbatches")
  if microbatches == 1 and count is None:  # no accumulator: the gradient as it comes
    return grad_fn(variables, batch)
  parts = batch.reshape(microbatches, batch.shape[0] // microbatches, *batch.shape[1:])
  zeros = (jnp.zeros((), jnp.float32), accumulator_zeros(variables))

  def add(carry, part):
    loss_sum, acc = carry
    loss, g = grad_fn(variables, part)
    return loss_sum + loss, accumulate_gradients(acc, g)

  if count is None:
    (loss_sum, acc), _ = lax.scan(lambda c, part: (add(c, part), None), zeros, parts)
    n = jnp.float32(microbatches)
  else:
    loss_sum, acc = lax.fori_loop(
        0, count, lambda i, c: add(c, lax.dynamic_index_in_dim(parts, i, keepdims=False)),
        zeros)
    n = jnp.asarray(count).astype(jnp.float32)
  acc = {**acc, "params": jax.tree.map(lambda g: g / n.astype(g.dtype), acc["params"])}
  return loss_sum / n, acc


@dataclasses.dataclass(frozen=True)
class UniformLoop:
  """The uniform loop's settings (:func:`scan_microbatches`): every data-parallel rank runs
  its share of every microbatch; the plan's gradient layout (ZeRO) and, at ZeRO-3, each
  parameter gathered where the model uses it.

  Attributes:
    microbatch_size: sequences per microbatch (needed with `dynamic`).
    dynamic: the step takes a batch of any whole number k in [1, microbatches] of
      microbatches of `microbatch_size` sequences (a batch ramp): the host pads it to the
      largest shape and passes k as data, so one compiled program serves every k.
    cast_weights, matrix_dtype: as :func:`make_train_step`'s (`cast_weights` below ZeRO-3
      only: at 3 the weights are cast where they are gathered).
  """

  microbatch_size: int | None = None
  dynamic: bool = False
  cast_weights: Callable | None = None
  matrix_dtype: Any = None

  def program(self, apply_fn, tx, plan: ZeroPlan, microbatches: int, fused_update=None):
    """(step, place, batch shardings) for :func:`build_step`."""
    weight_gather = plan.weight_gather()
    step = make_train_step(apply_fn, tx, microbatches, weight_gather=weight_gather,
                           reduce_gradients=plan.reduce_fn(), fused_update=fused_update,
                           cast_weights=self.cast_weights if weight_gather is None else None,
                           matrix_dtype=self.matrix_dtype)
    return (step, *batch_placement(plan, self.dynamic, microbatches, self.microbatch_size))


def make_train_step(apply_fn: Callable, tx: optax.GradientTransformation, microbatches: int = 1,
                    *, groups: GroupLoop | None = None,
                    pipeline: PipelineLoop | None = None,
                    weight_gather: fsdp.WeightGather | None = None,
                    reduce_gradients: Callable | None = None,
                    fused_update: Callable | None = None,
                    cast_weights: Callable | None = None,
                    matrix_dtype=None):
  """A jittable train step.

  Without `groups`: ``step(state, batch int32[B, T+1], count=None) -> (state, metrics)``
  running :func:`scan_microbatches` (`count`: an int32 scalar, the number of the batch's
  `microbatches` parts that run; None: all). With `groups`: ``step(state, batch int32[G, n, m, T+1],
  counts int32[G])`` running :func:`group_microbatches` inside
  ``shard_map`` (batch and counts sharded over the groups: ``fp8jax.parallel.layout``).
  With `pipeline`: ``step(state, batch int32[B, T+1], count=None) -> (state, metrics)``
  running :func:`pipeline_microbatches` (`count` as for the uniform loop).

  Args:
    apply_fn: ``apply_fn(variables, tokens[B, T]) -> logits[B, T, V]``.
    tx: the optimizer (including clipping); it sees parameters only.
    microbatches: equal parts the batch is split into (uniform loop; must divide B).
    groups: run the per-group loop with these settings.
    pipeline: run the pipeline loop with these settings (with `reduce_gradients`,
      `fused_update` and `matrix_dtype` only; `microbatches` >= its stages).
    weight_gather: optional ``fp8jax.fsdp.WeightGather`` (ZeRO-3, ``ZeroPlan.weight_gather``)
      the loss and its gradient are traced under: the model gathers its sharded parameters
      where it uses them. Uniform loop only (the group loop's is ``groups.weight_gather``).
    reduce_gradients: optional ``grads -> grads`` applied to each microbatch's f32 parameter
      gradients (uniform loop: ZeRO's all-reduce / reduce-scatter layout).
    fused_update: optional ``(master, opt_state, grads, finite, grad_norm) -> (master,
      opt_state)`` replacing `tx` plus ``apply_master_updates`` for FP16 master weights
      (:func:`fp8jax.train.optimizer.make_fused_update`).
    cast_weights: optional ``variables -> extra collections`` computed once per step before
      the microbatch loop (``fp8jax.linen.cast_weights``: FP8 weights cast once per optimizer
      step, not once per microbatch); uniform loop only, not with `weight_gather` (the
      weights are gathered at use).
    matrix_dtype: optional dtype the FP16 master weights' GEMM weights are decoded to for the
      forward and backward (the model's compute dtype, exact for a model that casts them to
      it before use; with `weight_gather` the shards are decoded); gradients are still
      summed, reduced and clipped in f32. Uniform loop only.
  Metrics: loss (mean over the step's tokens), grad_norm (before clipping); with automatic
  comm scaling also comm_pre_scale_min and comm_saturated_max over the FP8 leaves.
  """
  if microbatches < 1:
    raise ValueError(f"microbatches={microbatches!r} is not allowed; use an integer >= 1")
  if cast_weights is not None and weight_gather is not None:
    raise ValueError("cast_weights with weight_gather is not supported: the weights are "
                     "gathered per microbatch (ZeRO-3); cast them there")
  if weight_gather is not None and not isinstance(weight_gather, fsdp.WeightGather):
    raise TypeError(f"weight_gather must be an fp8jax.fsdp.WeightGather, got "
                    f"{type(weight_gather).__name__}")
  if weight_gather is not None and groups is not None:
    raise ValueError("weight_gather belongs to the uniform loop; the group loop takes "
                     "groups.weight_gather")
  if matrix_dtype is not None and not jnp.issubdtype(jnp.dtype(matrix_dtype), jnp.floating):
    raise ValueError(f"matrix_dtype={matrix_dtype!r} is not a floating dtype")
  if groups is not None and (cast_weights, matrix_dtype, reduce_gradients) != (None,) * 3:
    raise ValueError("cast_weights, matrix_dtype and reduce_gradients belong to the uniform "
                     "loop; the group loop reduces through groups.grad_comm")
  if pipeline is not None and (groups, weight_gather, cast_weights) != (None,) * 3:
    raise ValueError("the pipeline loop takes none of groups, weight_gather and cast_weights "
                     "(its stages hold their layers' weights)")
  if pipeline is not None:
    pipeline_lib.check_stages(pipeline.stages, microbatches)

  grad_fn = microbatch_grads(apply_fn, weight_gather, reduce_gradients)
  if pipeline is not None:
    return pipeline_step_fn(pipeline, tx, microbatches, reduce_gradients, fused_update,
                          matrix_dtype)
  if groups is not None:
    return group_step_fn(groups, grad_fn, tx, fused_update)
  return _uniform_step(grad_fn, tx, microbatches, fused_update, cast_weights, matrix_dtype)


def _uniform_step(grad_fn, tx, microbatches: int, fused_update, cast_weights, matrix_dtype):
  """The uniform loop's ``step(state, batch, count=None)`` (:func:`make_train_step`)."""
  def uniform_step(state: TrainState, batch, count=None):
    variables = state.variables(matrix_dtype)  # decoded once, for every microbatch
    extra = {}
    if cast_weights is not None:  # once, for every microbatch
      extra = cast_weights(jax.lax.stop_gradient(variables))
    loss, grads = scan_microbatches(
        functools.partial(grad_fn, extra=extra), variables, batch,
        microbatches, count)
    # One static microbatch returns its gradient as it comes; the fused update reads it
    # narrow, the rest in f32.
    if microbatches == 1 and count is None and fused_update is None:
      grads = {**grads, "params": jax.tree.map(widen, grads["params"])}
    return apply_gradients(state, tx, grads, loss, fused_update)
  return uniform_step


def eval_loss_fn(apply_fn: Callable, weight_gather: fsdp.WeightGather | None = None,
                 pipeline: PipelineLoop | None = None) -> Callable:
  """``(variables, batch int32[B, T+1]) -> mean loss`` forwards only (FP8 state is not
  updated); `weight_gather`: as for :func:`make_train_step` (ZeRO-3: parameters gathered at
  use); `pipeline`: the batch runs through the pipeline stages as one microbatch
  (``fp8jax.parallel.pipeline.gpipe_loss``; it gathers with its own ``weight_gather``, and
  `weight_gather` does not apply)."""
  def loss(variables, batch):
    if pipeline is not None:
      stacked, shared = pipeline.parts.split(variables)
      parts = lax.with_sharding_constraint(
          batch[None], layout.microbatches_sharding(pipeline.mesh, batch.shape[0]))
      with fsdp.gathering(pipeline.weight_gather):
        return pipeline_lib.pipeline_loss(pipeline.stage_fns(), pipeline.mesh, stacked,
                                          shared, parts, stage_layers=pipeline.stage_layers)
    with fsdp.gathering(weight_gather):
      return batch_loss(apply_fn, variables, batch)
  return loss


Loop = UniformLoop | GroupLoop | PipelineLoop


def build_step(apply_fn: Callable, tx: optax.GradientTransformation, plan: ZeroPlan,
               microbatches: int, loop: Loop | None = None, *,
               fused_update: Callable | None = None, skip_nonfinite: bool = True) -> TrainStep:
  """The jitted step of `plan`'s layout for steps of `microbatches` microbatches (with a
  dynamic loop, at most that many): `loop`'s step and batch placement
  (:class:`UniformLoop`, the default; :class:`GroupLoop`: per-group counts or FP8 gradient
  communication; :class:`PipelineLoop`: the plan's mesh has pipeline stages), wrapped with
  the update, the non-finite guard and ``jax.jit`` on the plan's shardings.

  Args:
    fused_update: as :func:`make_train_step`'s.
    skip_nonfinite: wrap the step in ``guards.skip_nonfinite_steps`` (metrics gain
      ``skipped``).
  """
  loop = UniformLoop() if loop is None else loop
  mesh = plan.mesh
  staged = isinstance(loop, PipelineLoop) or getattr(loop, "schedule", None) is not None
  if staged != (pipe_size(mesh) > 1):
    raise ValueError(f"build_step: a plan whose mesh has {pipe_size(mesh)} pipeline stages "
                     f"needs {'a' if pipe_size(mesh) > 1 else 'no'} pipeline loop "
                     f"(PipelineLoop, or GroupLoop(schedule=...)), got {type(loop).__name__}")
  wants_size = loop.dynamic or getattr(loop, "counts", None) is not None
  if wants_size and loop.microbatch_size is None:
    raise ValueError("build_step: counts and dynamic need microbatch_size (sequences per "
                     "microbatch)")
  step, place, batch_shardings = loop.program(apply_fn, tx, plan, microbatches, fused_update)
  if skip_nonfinite:
    inside = ("params", "opt_state") if fused_update is not None else ()
    step = guards.skip_nonfinite_steps(step, skipped_inside=inside)

  def train_step(state, *args):
    new, metrics = step(plan.to_device(state), *args)
    return plan.to_home(new), metrics

  jitted = jax.jit(train_step, in_shardings=(plan.state, *batch_shardings),
                   out_shardings=(plan.state, layout.replicated(mesh)), donate_argnums=0,
                   compiler_options=plan.compiler_options or None)
  return TrainStep(jitted, place)

