"""Programs a run runs besides its train step, on the train step's memory plan: the
evaluation step and the FP8 probe (cast health and calibration).

Both take the step's microbatch (its size, its placement over the batch axes), the model as
the step applies it (remat policy, GEMM weights decoded to the compute dtype inside the
program, ZeRO-3 gathering each parameter at use) and the parameters and FP8 state where the
plan keeps them, and neither forms a parameter gradient: neither needs more device memory
than the train step beside the state the run holds anyway. The evaluation step loops over up
to the step's microbatch count of microbatches inside one program (a loop with a dynamic
trip count: one compile serves a last, shorter call) and returns loss sums and token counts.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from fp8jax import fsdp
from fp8jax.linen import FP8_COLLECTION, apply_fp8_updates
from fp8jax.parallel import layout
from fp8jax.parallel import pipeline as pipeline_lib
from fp8jax.parallel.zero import ZeroPlan
from fp8jax.train import health as health_lib
from fp8jax.train.calibration import calibrated_scales
from fp8jax.train.state import TrainState
from fp8jax.train.step import PipelineLoop, next_token_loss


def _variables(params, fp8, matrix_dtype) -> dict:
  """The model's variables from the state's `params` and `fp8` (master weights decoded, GEMM
  weights to `matrix_dtype` when given), as the train step reads them."""
  return TrainState(jnp.zeros((), jnp.int32), params, fp8, ()).variables(matrix_dtype)


def microbatch_sharding(plan: ZeroPlan, microbatch_size: int) -> NamedSharding:
  """Where a microbatch int32[m, T+1] lives: split over the plan's batch axes like the train
  step's, or replicated when `microbatch_size` does not divide over them (a balanced split,
  whose groups each run whole microbatches)."""
  spec = tuple(plan.batch.spec)
  axes = spec[0] if spec else None
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  ways = int(np.prod([plan.mesh.shape[a] for a in names])) if names else 1
  if ways > 1 and microbatch_size % ways == 0:
    return NamedSharding(plan.mesh, P(axes))
  return layout.replicated(plan.mesh)


def make_eval_loop(apply_fn: Callable, *, weight_gather: fsdp.WeightGather | None = None,
                   pipeline: PipelineLoop | None = None, matrix_dtype=None) -> Callable:
  """A jittable ``eval_step(params, fp8, parts int32[k, m, T+1], count int32[]) ->
  (loss_sum f32[], tokens f32[])``: the summed next-token loss (nats) and the number of
  predicted tokens of the first `count` microbatches of `parts`, run one after another.

  `params`, `fp8`: the train state's (``TrainState.params``, ``.fp8``); `weight_gather`:
  ZeRO-3's (the model gathers its parameters at use); `pipeline`: each microbatch runs
  forward through the pipeline stages (``fp8jax.parallel.pipeline.pipeline_loss``);
  `matrix_dtype`: as for ``fp8jax.train.step.make_train_step``."""
  def microbatch_loss(variables, part):
    if pipeline is not None:
      stacked, shared = pipeline.parts.split(variables)
      parts = lax.with_sharding_constraint(
          part[None], NamedSharding(pipeline.mesh, P(None, layout.group_axes(pipeline.mesh))))
      return pipeline_lib.pipeline_loss(pipeline.stage_fns(), pipeline.mesh, stacked, shared,
                                        parts)
    with fsdp.gathering(weight_gather):
      return next_token_loss(apply_fn, variables, part)

  def eval_step(params, fp8, parts, count):
    variables = _variables(params, fp8, matrix_dtype)  # decoded once, for every microbatch
    tokens_each = parts.shape[1] * (parts.shape[2] - 1)

    def add(i, total):
      part = lax.dynamic_index_in_dim(parts, i, keepdims=False)
      return total + microbatch_loss(variables, part).astype(jnp.float32) * tokens_each

    total = lax.fori_loop(0, count, add, jnp.zeros((), jnp.float32))
    return total, count.astype(jnp.float32) * tokens_each
  return eval_step


class EvalStep(NamedTuple):
  """A jitted evaluation step (:func:`make_eval_loop`) and the placement of its batch.

  Attributes:
    jitted: ``(params, fp8, parts, count) -> (loss_sum, tokens)``.
    place: ``list of 1..microbatches microbatches int32[m, T+1] (numpy, the same on every
      process) -> (parts, count)`` placed; missing microbatches are zero slots no loop reads.
    microbatches: the most microbatches one call runs (the train step's count).
  """

  jitted: Callable
  place: Callable
  microbatches: int

  def __call__(self, state, microbatches: Sequence[np.ndarray]):
    """(loss_sum, tokens) of `microbatches` (at most :attr:`microbatches`) under `state`."""
    return self.jitted(state.params, state.fp8, *self.place(microbatches))


def build_eval_step(apply_fn: Callable, plan: ZeroPlan, microbatches: int,
                    microbatch_size: int, *, pipeline: PipelineLoop | None = None,
                    matrix_dtype=None) -> EvalStep:
  """The :class:`EvalStep` of the train step's plan: `microbatches` microbatches of
  `microbatch_size` sequences per call, each placed as the step places one
  (:func:`microbatch_sharding`), parameters and FP8 state in the plan's shardings."""
  part = microbatch_sharding(plan, microbatch_size)
  parts = NamedSharding(plan.mesh, P(None, *part.spec))
  scalar = layout.replicated(plan.mesh)
  step = make_eval_loop(apply_fn, weight_gather=None if pipeline else plan.weight_gather(),
                        pipeline=pipeline, matrix_dtype=matrix_dtype)
  jitted = jax.jit(step, in_shardings=(plan.state.params, plan.state.fp8, parts, scalar),
                   out_shardings=(scalar, scalar),
                   compiler_options=plan.compiler_options or None)

  def place(batch: Sequence[np.ndarray]):
    batch = [np.asarray(b, np.int32) for b in batch]
    if not 1 <= len(batch) <= microbatches or any(
        b.shape != batch[0].shape or b.shape[0] != microbatch_size for b in batch):
      raise ValueError(f"an evaluation call takes 1..{microbatches} microbatches of "
                       f"{microbatch_size} sequences, got shapes {[b.shape for b in batch]}")
    stacked = np.zeros((microbatches, *batch[0].shape), np.int32)
    stacked[:len(batch)] = batch
    return (layout.put_global(stacked, parts),
            layout.put_global(np.int32(len(batch)), scalar))
  return EvalStep(jitted, place, microbatches)


class Probe(NamedTuple):
  """The jitted FP8 probe of a run (:func:`build_probe`).

  Attributes:
    jitted: ``(params, fp8, microbatch) -> (health, fp8)``.
    place: ``microbatch int32[m, T+1] (numpy) -> placed microbatch``.
  """

  jitted: Callable
  place: Callable

  def __call__(self, state, microbatch: np.ndarray):
    """(health {name: f32[]}, FP8 state with calibrated scales) of `microbatch`."""
    return self.jitted(state.params, state.fp8, self.place(microbatch))


def fp8_updates(apply_fn: Callable, variables: dict, batch: jax.Array) -> dict:
  """The FP8 collection as a train step on `batch` int32[B, T+1] would leave it: the
  gradient of the loss with respect to the FP8 state alone (``fp8jax.apply_fp8_updates``; no
  parameter gradient is formed)."""
  fp8 = variables[FP8_COLLECTION]
  grads = jax.grad(lambda f: next_token_loss(apply_fn, {**variables, FP8_COLLECTION: f},
                                             batch))(fp8)
  return apply_fp8_updates({FP8_COLLECTION: fp8}, {FP8_COLLECTION: grads})[FP8_COLLECTION]


def build_probe(model, plan: ZeroPlan, microbatch_size: int, *, health: bool,
                matrix_dtype=None) -> Probe:
  """The FP8 probe of `model` (the uncalibrated model: on observed FP8 state it casts as the
  calibrated one) on one microbatch of the train step's plan: ``(health, fp8)`` where health
  is ``fp8jax.train.health.probe``'s (`health` True: a linen model; else {}) and fp8 is the
  state with :func:`fp8jax.train.calibration.calibrated_scales` from this microbatch."""
  part = microbatch_sharding(plan, microbatch_size)
  gather = plan.weight_gather()

  def fp8_probe(params, fp8, microbatch):
    variables = _variables(params, fp8, matrix_dtype)
    with fsdp.gathering(gather):
      if health:
        out, observed = health_lib.probe(model, variables, microbatch)
      else:
        out, observed = {}, fp8_updates(model.apply, variables, microbatch)
    return out, calibrated_scales(fp8, observed)

  jitted = jax.jit(fp8_probe, in_shardings=(plan.state.params, plan.state.fp8, part),
                   out_shardings=(layout.replicated(plan.mesh), plan.state.fp8),
                   compiler_options=plan.compiler_options or None)
  return Probe(jitted, lambda microbatch: layout.put_global(microbatch, part))
