"""Programs a run runs besides its train step, on the train step's memory plan: the
evaluation step and the FP8 probe (cast health and calibration).

Both take the step's microbatch (its size, its placement over the batch axes), the model as
the step applies it (remat policy, GEMM weights decoded to the compute dtype inside the
program, ZeRO-3 gathering each parameter at use; with pipeline stages through the stages,
each holding its own layers: the evaluation and the calibration pass, not the cast-health
probe) and the parameters and FP8 state where the plan keeps them, and neither forms a
parameter gradient (the compiled memory of each against the step's, on CPU:
``tests/integration/test_phase_memory.py``; on a GPU the cast-health probe of the 7B config
needed more temporaries than its step, and the Trainer switches the probe off when it runs
out of memory). The evaluation step loops over up
to the step's microbatch count of microbatches inside one program (a loop with a dynamic
trip count: one compile serves a last, shorter call) and returns loss sums and token counts.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from fp8jax import fsdp
from fp8jax.linen import FP8_COLLECTION, PERTURBATIONS, apply_fp8_updates
from fp8jax.parallel import layout
from fp8jax.parallel.zero import ZeroPlan
from fp8jax.train import health as health_lib
from fp8jax.train.calibration import calibrated_scales
from fp8jax.train.state import TrainState
from fp8jax.train.loss import batch_loss
from fp8jax.train.pipeline_loop import pipeline_probe
from fp8jax.train.step import PipelineLoop, eval_loss_fn, scan_microbatches


def _variables(params, fp8, matrix_dtype) -> dict:
  """The model's variables from the state's `params` and `fp8` (master weights decoded, GEMM
  weights to `matrix_dtype` when given), as the train step reads them."""
  return TrainState(jnp.zeros((), jnp.int32), params, fp8, ()).variables(matrix_dtype)


def batch_sharding(plan: ZeroPlan, balanced: bool = False) -> NamedSharding:
  """Where a batch int32[k m, T+1] of the train step's size lives: the step's batch
  sharding, or replicated in a balanced run (``parallel.device_map``: groups run whole
  microbatches of their own)."""
  return layout.replicated(plan.mesh) if balanced else plan.batch


def make_eval_loop(apply_fn: Callable, microbatches: int, *,
                   weight_gather: fsdp.WeightGather | None = None,
                   pipeline: PipelineLoop | None = None, matrix_dtype=None) -> Callable:
  """A jittable ``eval_step(params, fp8, batch int32[k m, T+1], count int32[]) -> (loss_sum
  f32[], tokens f32[])``: the summed next-token loss (nats) and the number of predicted
  tokens of the first `count` of the batch's k = `microbatches` microbatches, run one after
  another as the train step runs them (``fp8jax.train.step.scan_microbatches``).

  `params`, `fp8`: the train state's (``TrainState.params``, ``.fp8``); `weight_gather`:
  ZeRO-3's (the model gathers its parameters at use); `pipeline`: each microbatch runs
  forward through the pipeline stages (``fp8jax.parallel.pipeline.pipeline_loss``);
  `matrix_dtype`: as for ``fp8jax.train.step.make_train_step``."""
  microbatch_loss = eval_loss_fn(apply_fn, weight_gather, pipeline)

  def eval_step(params, fp8, batch, count):
    variables = _variables(params, fp8, matrix_dtype)  # decoded once, for every microbatch
    # The loop's "gradients" are an empty tree: it sums and averages the losses alone.
    loss_only = lambda none, part: (microbatch_loss(variables, part), none)
    mean, _ = scan_microbatches(loss_only, {"params": {}}, batch, microbatches, count)
    tokens = count.astype(jnp.float32) * (batch.shape[0] // microbatches) * (batch.shape[1] - 1)
    return mean * tokens, tokens
  return eval_step


def _step_batch(batch: Sequence[np.ndarray] | np.ndarray, microbatches: int,
                microbatch_size: int) -> tuple[np.ndarray, int]:
  """(int32[microbatches * microbatch_size, T+1], n): the n given microbatches (a list of
  int32[m, T+1], or their concatenation) followed by zero slots no loop reads."""
  rows = np.concatenate([np.asarray(b, np.int32) for b in batch]) if isinstance(
      batch, (list, tuple)) else np.asarray(batch, np.int32)
  n, rest = divmod(rows.shape[0], microbatch_size)
  if rest or not 1 <= n <= microbatches:
    raise ValueError(f"expected 1..{microbatches} microbatches of {microbatch_size} "
                     f"sequences, got {rows.shape[0]} sequences")
  padded = np.zeros((microbatches * microbatch_size, *rows.shape[1:]), np.int32)
  padded[:rows.shape[0]] = rows
  return padded, n


class EvalStep(NamedTuple):
  """A jitted evaluation step (:func:`make_eval_loop`) and the placement of its batch.

  Attributes:
    jitted: ``(params, fp8, batch, count) -> (loss_sum, tokens)``.
    place: ``1..microbatches microbatches (a list of int32[m, T+1] or their concatenation;
      numpy, the same on every process) -> (batch, count)`` placed as the train step places
      its batch; missing microbatches are zero slots no loop reads.
    microbatches: the most microbatches one call runs (the train step's count).
  """

  jitted: Callable
  place: Callable
  microbatches: int

  def __call__(self, state, microbatches):
    """(loss_sum, tokens) of `microbatches` (at most :attr:`microbatches`) under `state`."""
    return self.jitted(state.params, state.fp8, *self.place(microbatches))

  def lower(self, state, microbatches):
    """The program :meth:`__call__` runs on these arguments, lowered (``jax.stages.Lowered``)."""
    return self.jitted.lower(state.params, state.fp8, *self.place(microbatches))


def build_eval_step(apply_fn: Callable, plan: ZeroPlan, microbatches: int,
                    microbatch_size: int, *, balanced: bool = False,
                    pipeline: PipelineLoop | None = None, matrix_dtype=None,
                    name: str = "eval_step") -> EvalStep:
  """The :class:`EvalStep` of the train step's plan: up to `microbatches` microbatches of
  `microbatch_size` sequences per call in a batch placed as the step's
  (:func:`batch_sharding`; `balanced`: a balanced run), parameters and FP8 state in the
  plan's shardings. `name`: the jitted program's name (compile logs, profiles)."""
  sharding, scalar = batch_sharding(plan, balanced), layout.replicated(plan.mesh)
  step = make_eval_loop(apply_fn, microbatches,
                        weight_gather=None if pipeline else plan.weight_gather(),
                        pipeline=pipeline and pipeline.with_plan(plan),
                        matrix_dtype=matrix_dtype)
  step.__name__ = step.__qualname__ = name
  jitted = jax.jit(step, in_shardings=(plan.state.params, plan.state.fp8, sharding, scalar),
                   out_shardings=(scalar, scalar),
                   compiler_options=plan.compiler_options or None)

  def place(batch):
    rows, n = _step_batch(batch, microbatches, microbatch_size)
    return layout.put_global(rows, sharding), layout.put_global(np.int32(n), scalar)
  return EvalStep(jitted, place, microbatches)


# The jitted programs' names (compile logs, profiles): the cast-health probe (which also gives
# calibrated scales) and the calibration pass alone.
PROBE_NAMES = {True: "fp8_probe", False: "fp8_calibration"}


class Probe(NamedTuple):
  """The jitted FP8 probe of a run (:func:`build_probe`).

  Attributes:
    jitted: ``(params, fp8, batch) -> (health, fp8)``.
    place: ``batch (1..k microbatches int32[m, T+1], concatenated; numpy) -> placed batch``
      (the train step's shape and placement).
  """

  jitted: Callable
  place: Callable

  def __call__(self, state, batch):
    """(health {name: f32[]}, FP8 state with calibrated scales) of `batch`'s first
    microbatch."""
    return self.jitted(state.params, state.fp8, self.place(batch))

  def lower(self, state, batch):
    """The program :meth:`__call__` runs on these arguments, lowered (``jax.stages.Lowered``)."""
    return self.jitted.lower(state.params, state.fp8, self.place(batch))


def fp8_updates(apply_fn: Callable, variables: dict, batch: jax.Array) -> dict:
  """The FP8 collection as a train step on `batch` int32[B, T+1] would leave it: the
  gradient of the loss with respect to the FP8 state alone (``fp8jax.apply_fp8_updates``; no
  parameter gradient is formed)."""
  fp8 = variables[FP8_COLLECTION]
  grads = jax.grad(lambda f: batch_loss(apply_fn, {**variables, FP8_COLLECTION: f},
                                        batch))(fp8)
  return apply_fp8_updates({FP8_COLLECTION: fp8}, {FP8_COLLECTION: grads})[FP8_COLLECTION]


def build_probe(model, plan: ZeroPlan, microbatches: int, microbatch_size: int, *,
                health: bool, balanced: bool = False, pipeline: PipelineLoop | None = None,
                matrix_dtype=None) -> Probe:
  """The FP8 probe of `model` (the uncalibrated model: on observed FP8 state it casts as the
  calibrated one) on the first microbatch of a batch of the train step's shape and placement
  (`microbatches` x `microbatch_size` sequences; `balanced`: see :func:`batch_sharding`):
  ``(health, fp8)`` where health is ``fp8jax.train.health.probe``'s (`health` True: a linen
  model; else {}) and fp8 is the state with :func:`fp8jax.train.calibration.
  calibrated_scales` from that microbatch. The jitted program is named after what it gives
  (:data:`PROBE_NAMES`): without `health` it is the smaller calibration pass a run runs
  before its first step.

  `pipeline`: the train step's pipeline loop, or None. With it the microbatch runs through
  the pipeline's stages as the step runs it (``fp8jax.train.pipeline_loop.pipeline_probe``:
  each stage its own layers, no parameter gradient; the cast-health taps ride in the
  stacked and shared variables)."""
  sharding = batch_sharding(plan, balanced)
  gather = None if pipeline is not None else plan.weight_gather()
  pipeline = pipeline and pipeline.with_plan(plan)  # (ZeRO-3: gathered per layer, as the step)

  def probe(params, fp8, batch):
    variables = _variables(params, fp8, matrix_dtype)
    # the first microbatch, sliced as the train step's loop slices it
    part = batch.reshape(microbatches, microbatch_size, *batch.shape[1:])[0]
    if pipeline is not None:
      taps = health_lib.taps(model, variables, part[:, :-1]) if health else {}
      observed, tap_grads = pipeline_probe(
          pipeline, {**variables, PERTURBATIONS: taps} if taps else variables, part)
      out = health_lib.health_from_taps(tap_grads) if health else {}
      return out, calibrated_scales(fp8, observed)
    with fsdp.gathering(gather):
      if health:
        out, observed = health_lib.probe(model, variables, part)
      else:
        out, observed = {}, fp8_updates(model.apply, variables, part)
    return out, calibrated_scales(fp8, observed)

  probe.__name__ = probe.__qualname__ = PROBE_NAMES[health]
  jitted = jax.jit(probe, in_shardings=(plan.state.params, plan.state.fp8, sharding),
                   out_shardings=(layout.replicated(plan.mesh), plan.state.fp8),
                   compiler_options=plan.compiler_options or None)
  return Probe(jitted, lambda batch: layout.put_global(
      _step_batch(batch, microbatches, microbatch_size)[0], sharding))
