"""A run's model and optimizer from its :class:`fp8jax.config.Config` (one place for all
users: the Trainer, the device profiler, benchmarks)."""
from __future__ import annotations

import dataclasses

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
