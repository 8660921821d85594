"""A run's pieces from its :class:`fp8jax.config.Config`: model, optimizer, mesh, ZeRO plan,
the fused update, and the step of each microbatch count (one place for all users: the
Trainer, the device profiler, benchmarks)."""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from fp8jax import linen, parallel
from fp8jax.dot import native_fp8_reason
from fp8jax.parallel.tensor import GPT_RULES
from fp8jax.parallel.layout import group_count
from fp8jax.parallel.zero import ZeroPlan
from fp8jax.train.optimizer import make_fused_update, make_optimizer, schedule_for
from fp8jax.train.model import RunModel
from fp8jax.train.step import TrainStep, build_step


def run_model(config) -> RunModel:
  """The config's model (family, Hugging Face checkpoint or builder) for its microbatches."""
  return RunModel(config, config.train.microbatch_size, config.data.seq_len)


def model_and_optimizer(config, run: RunModel | None = None):
  """(the model at the config's level, learning-rate schedule, optax optimizer with
  clipping); `run`: the config's :func:`run_model` when already built."""
  level, t = config.level(), config.train
  model = (run or run_model(config)).at(level.recipe)
  schedule = schedule_for(config)
  tx = make_optimizer(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                      clip_norm=t.gradient_clipping, level=level)
  return model, schedule, tx


def calibration_on(config) -> bool:
  """fp8.calibrate resolved: whether steps after the first run ``Recipe(calibrated=True)``
  (delayed scaling at an FP8 level; auto: where FP8 GEMMs are native)."""
  recipe, mode = config.level().recipe, config.fp8.calibrate
  if recipe is None or recipe.scaling != "delayed" or mode == "never":
    return False
  return mode == "always" or native_fp8_reason() is None


def weight_cast_fn(config, model, microbatches: int) -> Callable | None:
  """fp8.cast_weights_once resolved for a step of `microbatches`: ``variables -> {collection:
  FP8 weight casts}`` (``fp8jax.linen.cast_weights`` with `model`'s recipe and compute dtype)
  to cast every weight once for all microbatches; None at O0, with one microbatch (the model
  casts once anyway) or with the option off."""
  if (not config.fp8.cast_weights_once or getattr(model, "recipe", None) is None
      or microbatches < 2):  # (a builder's converted module casts per microbatch)
    return None
  return functools.partial(linen.cast_weights, recipe=model.recipe,
                           dtype=jnp.dtype(model.config.dtype))


def run_devices(config) -> list | None:
  """The devices a run's mesh spans: one (the first) for a single-process run that asks for
  no parallelism (ZeRO stage 0, no sizes set, no device_map, native gradient communication),
  else None: every process's devices."""
  p = config.parallel
  alone = (config.zero_stage() == 0 and jax.process_count() == 1 and p.device_map is None
           and p.data_parallel_size in (-1, 1) and p.fsdp_size == 1
           and p.tensor_parallel_size == 1 and config.grad_comm() == "native")
  return jax.devices()[:1] if alone else None


def zero_plan(config, abstract_state, tensor_rules: Sequence = GPT_RULES) -> ZeroPlan:
  """Where `abstract_state` lives on the config's mesh (:func:`run_devices`; one device is a
  mesh of one) and how its step gathers and reduces (``fp8jax.parallel.plan``; the model's
  `tensor_rules`)."""
  p = config.parallel
  mesh = parallel.mesh_from_config(p, run_devices(config))
  if config.grad_comm() == "fp8" and group_count(mesh) < 2:
    raise ValueError("parallel.grad_comm='fp8' needs at least 2 data-parallel ranks; this "
                     f"run has {parallel.describe(mesh)}; use parallel.grad_comm "
                     "'native' / 'auto' or more devices")
  return parallel.plan(abstract_state, mesh, config.zero_stage(), level=config.level(),
                       offload=p.offload_optimizer, reduce_bucket_size=p.reduce_bucket_size,
                       allgather_bucket_size=p.allgather_bucket_size,
                       tensor_rules=tensor_rules)


def fused_update_fn(config, schedule, plan: ZeroPlan) -> Callable | None:
  """train.fused_optimizer resolved: the fused O2 update (one kernel per tensor) or None.
  It runs on unsharded arrays: one device, ZeRO stage 0, FP16 master weights; ``auto`` takes
  it there on GPUs. ValueError when ``true`` is asked for elsewhere."""
  t, level = config.train, config.level()
  single = plan.mesh.size == 1 and plan.stage == 0
  if t.fused_optimizer is True and not single:
    raise ValueError("train.fused_optimizer=True runs on one device (unsharded arrays); this "
                     f"run has {parallel.describe(plan.mesh)}, ZeRO stage {plan.stage}; use "
                     "train.fused_optimizer false or one device")
  use = t.fused_optimizer is True or (t.fused_optimizer == "auto" and level.fused_update
                                      and single and jax.default_backend() == "gpu")
  if not use:
    return None
  return make_fused_update(schedule, b1=t.b1, b2=t.b2, eps=t.eps,
                           weight_decay=t.weight_decay, clip_norm=t.gradient_clipping)


class StepCache:
  """The run's compiled train steps: one per model, or one per (model, microbatch count) when
  the count is fixed per step.

  With a batch ramp (``train.batch_ramp``) the step is dynamic (``build_step(...,
  dynamic=True)``): the microbatch count is data, so every step of the ramp runs one compiled
  program built for the largest count.

  Args:
    config: the run's config (gradient communication, weight casts, compute dtype, ramp).
    tx: the optimizer; plan: the ZeRO plan; fused_update: from :func:`fused_update_fn`.
    counts_fn: optional ``microbatches -> counts per data-parallel group`` (balanced runs,
      ``parallel.device_map``); None: every group runs every microbatch.
  """

  def __init__(self, config, tx, plan: ZeroPlan, fused_update: Callable | None = None,
               counts_fn: Callable[[int], Sequence[int]] | None = None):
    self.config, self.tx, self.plan = config, tx, plan
    self.fused_update, self.counts_fn = fused_update, counts_fn
    self.dynamic = config.train.batch_ramp is not None
    self._steps: dict = {}

  def get(self, model, microbatches: int) -> TrainStep:
    """The jitted step of `model` that runs steps of `microbatches` microbatches (built
    once; with a ramp, one step for every count up to ``train.microbatches``)."""
    c = self.config
    if self.dynamic:
      if not 1 <= microbatches <= c.train.microbatches:
        raise ValueError(f"a step of {microbatches} microbatches is outside the ramp's 1.."
                         f"{c.train.microbatches}")
      microbatches = c.train.microbatches
    key = (id(model), microbatches)
    if key not in self._steps:
      self._steps[key] = (model, build_step(
          model.apply, self.tx, self.plan, microbatches, counts=self.counts_fn,
          dynamic=self.dynamic, microbatch_size=c.train.microbatch_size,
          grad_comm=c.grad_comm(), comm_scaling=c.parallel.grad_comm_scaling,
          growth_interval=c.grad_comm_growth_interval(), fused_update=self.fused_update,
          cast_weights=weight_cast_fn(c, model, microbatches),
          matrix_dtype=c.model.dtype if c.model.builder is None else None))
    return self._steps[key][1]

  def built(self) -> list[tuple]:
    """(model, microbatches) of every step built so far (with a ramp: the largest count)."""
    return [(m, k[1]) for k, (m, _) in self._steps.items()]
