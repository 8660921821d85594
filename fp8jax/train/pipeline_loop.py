"""The pipeline loop of the train step: microbatches through the stages of the mesh's "pipe"
axis (:mod:`fp8jax.parallel.pipeline`'s GPipe and 1F1B schedules)."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh

from fp8jax import fsdp
from fp8jax.accumulate import widen
from fp8jax.linen import FP8_COLLECTION, PERTURBATIONS, apply_fp8_updates
from fp8jax.parallel import layout
from fp8jax.parallel import pipeline as pipeline_lib
from fp8jax.parallel.mesh import pipe_size
from fp8jax.parallel.zero import ZeroPlan
from fp8jax.train.batching import batch_placement
from fp8jax.train.loss import cross_entropy
from fp8jax.train.state import TrainState
from fp8jax.train.update import apply_gradients


@dataclasses.dataclass(frozen=True)
class PipelineLoop:
  """The pipeline loop's settings (see :func:`pipeline_microbatches`).

  Attributes:
    mesh: the device mesh; its "pipe" axis holds the stages (2 or more).
    parts: the model cut into ``split(variables) -> (stacked, shared)``, ``merge(stacked,
      shared)``, ``embed(shared, tokens) -> x``, ``layers(stacked, x) -> x`` and
      ``logits(shared, x) -> logits`` (``fp8jax.models.layers.DecoderParts``, from
      ``model.parts()``).
    schedule: "gpipe" (all forwards, then all backwards: k kept inputs per stage) or "1f1b"
      (interleaved: at most 2P - 1 kept inputs, a larger bubble; ``fp8jax.parallel.pipeline``).
    microbatch_size, dynamic: for :func:`build_step`, as :class:`UniformLoop`'s.
    matrix_dtype: for :func:`build_step`, as :func:`make_train_step`'s.
    stage_layers: None (the layers split evenly over the stages) or the layers each stage
      runs, e.g. in proportion to its speed (``fp8jax.parallel.pipeline.split_layers``).
    weight_gather: ZeRO-3's ``fp8jax.fsdp.WeightGather`` for a stage's code
      (``ZeroPlan.weight_gather(in_stage=True)``; :meth:`program` takes the plan's when
      None): the stages' variables stay split over the ZeRO axes and each layer is gathered
      where it runs (FP8 kernels as E4M3 bytes inside their GEMM), in every forward and
      backward slot; gradients are reduce-scattered into the shards as they are made.
      None below ZeRO-3.
  """

  mesh: Mesh
  parts: Any
  schedule: str = "gpipe"
  microbatch_size: int | None = None
  dynamic: bool = False
  matrix_dtype: Any = None
  stage_layers: tuple[int, ...] | None = None
  weight_gather: fsdp.WeightGather | None = None

  def __post_init__(self):
    pipeline_lib.check_schedule(self.schedule)
    if pipe_size(self.mesh) < 2:
      raise ValueError(f"the pipeline loop needs a mesh with a 'pipe' axis of 2 or more "
                       f"stages, got axes {dict(self.mesh.shape)}")
    missing = [m for m in ("split", "merge", "embed", "layers", "logits")
               if not callable(getattr(self.parts, m, None))]
    if missing:
      raise ValueError(f"pipeline parallelism needs the model cut into parts; "
                       f"{type(self.parts).__name__} has no {missing} (the reference "
                       f"families give them: model.parts())")

  @property
  def stages(self) -> int:
    return pipe_size(self.mesh)

  def stage_fns(self) -> pipeline_lib.Stages:
    """The model as the schedule's first / stage / last functions (:func:`stages_of`)."""
    return stages_of(self.parts)

  def program(self, apply_fn, tx, plan: ZeroPlan, microbatches: int, fused_update=None):
    """(step, place, batch shardings) for :func:`build_step`: the pipeline step with the
    plan's gradient layout (`microbatches` >= the stages) and the batch over the batch axes
    (with :attr:`dynamic`, padded, plus its count)."""
    if self.mesh != plan.mesh:
      raise ValueError("build_step: the PipelineLoop's mesh is not the plan's")
    pipeline_lib.check_stages(self.stages, microbatches)
    loop = self.with_plan(plan)
    step = pipeline_step_fn(loop, tx, microbatches, plan.reduce_fn(), fused_update,
                            self.matrix_dtype)
    return (step, *batch_placement(plan, self.dynamic, microbatches, self.microbatch_size))

  def with_plan(self, plan: ZeroPlan) -> "PipelineLoop":
    """This loop with `plan`'s ZeRO-3 gathering for stage code, unless it has its own."""
    if self.weight_gather is not None:
      return self
    return dataclasses.replace(self, weight_gather=plan.weight_gather(in_stage=True))


def stages_of(parts) -> pipeline_lib.Stages:
  """`parts` (:class:`fp8jax.models.layers.DecoderParts`) as the schedules' first / stage /
  last functions (last: mean next-token loss of a microbatch int32[m, T+1])."""
  return pipeline_lib.Stages(
      first=lambda shared, part: parts.embed(shared, part[:, :-1]),
      stage=parts.layers,
      last=lambda shared, y, part: cross_entropy(parts.logits(shared, y), part[:, 1:]))


def pipeline_microbatches(loop: PipelineLoop, variables, batch, microbatches: int, count=None):
  """The pipeline loop: `batch` int32[B, T+1] split into `microbatches` equal parts run
  through the stages of ``loop.mesh``'s "pipe" axis (``loop.schedule``: GPipe or 1F1B,
  :mod:`fp8jax.parallel.pipeline`; each part's sequences stay split over the batch axes).
  `count`: None, or an int32 scalar (possibly traced) in [1, microbatches]: only the first
  `count` parts run (a batch ramp), as in :func:`scan_microbatches`. Returns (mean loss, mean
  parameter gradients in f32 and FP8 state combined by max), as :func:`scan_microbatches`."""
  if batch.shape[0] % microbatches:
    raise ValueError(f"batch of {batch.shape[0]} sequences does not split into "
                     f"{microbatches} microbatches")
  pipeline_lib.check_stages(loop.stages, microbatches)
  parts = batch.reshape(microbatches, batch.shape[0] // microbatches, *batch.shape[1:])
  parts = lax.with_sharding_constraint(
      parts, layout.microbatches_sharding(loop.mesh, parts.shape[1]))
  stacked, shared = loop.parts.split(variables)
  with fsdp.gathering(loop.weight_gather):  # ZeRO-3: each layer gathered where it runs
    loss, g_stacked, g_shared = pipeline_lib.pipeline_grads(
        loop.stage_fns(), loop.mesh, stacked, shared, parts, count, schedule=loop.schedule,
        stage_layers=loop.stage_layers)
  grads = loop.parts.merge(g_stacked, g_shared)
  return loss, {**grads, "params": jax.tree.map(widen, grads["params"])}


def _frozen_params(variables):
  """`variables` whose parameters are constants to differentiation (``lax.stop_gradient``)."""
  if "params" not in variables:
    return variables
  return {**variables, "params": lax.stop_gradient(variables["params"])}


def pipeline_probe(loop: PipelineLoop, variables, part) -> tuple[dict, dict]:
  """(fp8, tap gradients): the FP8 collection as a train step's pipeline on the microbatch
  `part` int32[m, T+1] would leave it (``fp8jax.apply_fp8_updates``; {} without one), and the
  gradients of the cast-health taps in `variables`' ``perturbations`` collection
  (``fp8jax.train.health.taps``; {} without them). The microbatch runs forward and backward
  through the stages of ``loop.mesh``'s "pipe" axis (the GPipe schedule over P slots of which
  the first runs, so each stage keeps at most P inputs, no more than either schedule's step
  keeps; ``loop.stage_layers`` as the step runs them), its sequences split over the batch
  axes as the step splits a microbatch's, parameters gathered as the step gathers them
  (``loop.weight_gather``: ZeRO-3 per layer; give the loop :meth:`PipelineLoop.with_plan`).
  Only the FP8 state and the taps are differentiated: the parameters enter as constants, so
  no weight-gradient GEMM runs (the schedule's parameter accumulators stay zero, the step's
  size). Jittable; `variables` as the step reads them (``TrainState.variables``)."""
  fp8 = variables.get(FP8_COLLECTION, {})
  if not fp8:
    return {}, {}
  stages = loop.stages
  parts = lax.with_sharding_constraint(
      jnp.broadcast_to(part, (stages, *part.shape)),
      layout.microbatches_sharding(loop.mesh, part.shape[0]))
  fns = loop.stage_fns()
  frozen = pipeline_lib.Stages(
      first=lambda shared, p: fns.first(_frozen_params(shared), p),
      stage=lambda stacked, x: fns.stage(_frozen_params(stacked), x),
      last=lambda shared, y, p: fns.last(_frozen_params(shared), y, p))
  stacked, shared = loop.parts.split(variables)
  with fsdp.gathering(loop.weight_gather):  # ZeRO-3: each layer gathered where it runs
    _, g_stacked, g_shared = pipeline_lib.pipeline_grads(
        frozen, loop.mesh, stacked, shared, parts, 1, schedule="gpipe",
        stage_layers=loop.stage_layers)
  grads = loop.parts.merge(g_stacked, g_shared)
  fp8 = apply_fp8_updates({FP8_COLLECTION: fp8},
                          {FP8_COLLECTION: grads[FP8_COLLECTION]})[FP8_COLLECTION]
  return fp8, grads.get(PERTURBATIONS, {})


def pipeline_step_fn(pipeline: PipelineLoop, tx, microbatches: int, reduce_gradients,
                   fused_update, matrix_dtype):
  """The pipeline loop's ``step(state, batch, count=None)`` (:func:`make_train_step`)."""
  def pipeline_step(state: TrainState, batch, count=None):
    variables = state.variables(matrix_dtype)
    loss, grads = pipeline_microbatches(pipeline, variables, batch, microbatches, count)
    if reduce_gradients is not None:
      grads = {**grads, "params": reduce_gradients(grads["params"])}
    return apply_gradients(state, tx, grads, loss, fused_update)
  return pipeline_step

