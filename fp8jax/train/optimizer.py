"""The optimizer of a level: clipping, AdamW with warmup + cosine, decay mask."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax

from fp8jax import optim as fp8_optim
from fp8jax.gemm_weights import gemm_weight_mask
from fp8jax.optim.fused import adamw_master_step
from fp8jax.recipe import O1, OptLevel


def lr_schedule(peak: float, warmup_steps: int, total_steps: int, min_ratio: float):
  """Linear warmup from 0 to `peak`, then cosine decay to `peak * min_ratio` at `total_steps`."""
  warmup = max(0, min(warmup_steps, total_steps - 1))
  return optax.warmup_cosine_decay_schedule(0.0, peak, warmup, max(total_steps, warmup + 1),
                                            end_value=peak * min_ratio)


def on_token_clock(schedule, tokens_seen, full_step_tokens: int):
  """`schedule` (a function of full-batch steps) read at tokens seen / `full_step_tokens`: a
  schedule of the optimizer step for a run whose batch grows. `tokens_seen`: int[S + 1],
  the tokens before each step 0..S (later steps read the last entry)."""
  clock = jnp.asarray(np.asarray(tokens_seen, np.float64) / full_step_tokens, jnp.float32)
  return lambda count: schedule(clock[jnp.minimum(count, clock.shape[0] - 1)])


def schedule_for(config):
  """The run's learning-rate schedule: :func:`lr_schedule` of the train section by optimizer
  step, or with ``train.batch_ramp.lr_follows: tokens`` by tokens seen (warmup over
  warmup_steps full steps' worth of tokens, decay ending with the run's last token)."""
  t, ramp = config.train, config.train.batch_ramp
  if ramp is None or ramp.lr_follows == "steps":
    return lr_schedule(t.learning_rate, t.warmup_in_run, t.steps, t.min_lr_ratio)
  full = t.batch_size * config.data.seq_len
  per_step = [config.batch_size_at(s) * config.data.seq_len for s in range(t.steps)]
  seen = np.concatenate([[0], np.cumsum(per_step)])
  total = max(float(seen[-1]) / full, 1.0)
  warmup = min(t.warmup_in_run, total - 1)
  base = optax.warmup_cosine_decay_schedule(0.0, t.learning_rate, max(warmup, 0), total,
                                            end_value=t.learning_rate * t.min_lr_ratio)
  return on_token_clock(base, seen, full)


def decay_mask(params):
  """Weight decay on GEMM weights only (kernels, embeddings; not on norm gains or biases,
  also when layers are stacked under scan)."""
  return gemm_weight_mask(params)


def make_optimizer(schedule, *, b1: float, b2: float, eps: float, weight_decay: float,
                   clip_norm: float, level: OptLevel = O1) -> optax.GradientTransformation:
  """Global-norm clipping (`clip_norm` 0 disables) then AdamW: optax's with f32 states at
  O0/O1, ``fp8jax.optim.adamw`` with the level's moment dtypes at O2/O3."""
  if not level.scaled_moments:
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                        mask=decay_mask)
  else:
    adamw = fp8_optim.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                            mask=decay_mask, mu_dtype=level.mu_dtype, nu_dtype=level.nu_dtype)
  return optax.chain(optax.clip_by_global_norm(clip_norm), adamw) if clip_norm > 0 else adamw


def make_fused_update(schedule, *, b1: float, b2: float, eps: float, weight_decay: float,
                      clip_norm: float):
  """``update(master, opt_state, grads, finite, grad_norm) -> (master, opt_state)``: what
  :func:`make_optimizer` at O2 followed by ``apply_master_updates`` computes, through
  :func:`fp8jax.optim.fused.adamw_master_step` (one kernel per tensor on a GPU; the clipping
  factor comes from `grad_norm`). A step with `finite` False (bool[]) changes nothing.
  `opt_state` has :func:`make_optimizer`'s structure, so either path resumes the other's."""
  def update(master, opt_state, grads, finite, grad_norm):
    adam_state = opt_state[1] if clip_norm > 0 else opt_state
    factor = None
    if clip_norm > 0:  # optax.clip_by_global_norm's rule, as one scalar
      factor = jnp.where(grad_norm < clip_norm, 1.0, clip_norm / grad_norm)
    new_master, new_adam = adamw_master_step(
        grads, adam_state, master, learning_rate=schedule, b1=b1, b2=b2, eps=eps,
        weight_decay=weight_decay, mask=decay_mask, finite=finite,
        grad_scale=factor)
    return new_master, ((opt_state[0], new_adam) if clip_norm > 0 else new_adam)

  return update
