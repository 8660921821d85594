"""A run's model and optimizer from its :class:`fp8jax.config.Config` (one place for all
users: the Trainer, the device profiler, benchmarks)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax.numpy as jnp

from fp8jax import linen
from fp8jax.dot import native_fp8_reason
from fp8jax.models.gpt import GPT, ModelConfig
from fp8jax.train.optimizer import lr_schedule, make_optimizer


def model_and_optimizer(config):
  """(GPT at the config's level, learning-rate schedule, optax optimizer with clipping)."""
  level, t = config.level(), config.train
  model = GPT(ModelConfig(**dataclasses.asdict(config.model)), level.recipe)
  schedule = lr_schedule(t.learning_rate, t.warmup_steps, t.steps, t.min_lr_ratio)
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


def calibrated(model: GPT) -> GPT:
  """`model` whose casts trust their stored scales (every FP8 state must have observed a
  tensor first, e.g. after one step of `model`)."""
  return model.clone(recipe=model.recipe.replace(calibrated=True))


def weight_cast_fn(config, model: GPT, microbatches: int) -> Callable | None:
  """fp8.cast_weights_once resolved for a step of `microbatches`: ``variables -> {collection:
  FP8 weight casts}`` (``fp8jax.linen.cast_weights`` with `model`'s recipe and compute dtype)
  to cast every weight once for all microbatches; None at O0, with one microbatch (the model
  casts once anyway) or with the option off."""
  if not config.fp8.cast_weights_once or model.recipe is None or microbatches < 2:
    return None
  return functools.partial(linen.cast_weights, recipe=model.recipe,
                           dtype=jnp.dtype(model.config.dtype))
