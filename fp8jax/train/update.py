"""The update half of a train step: optimizer, FP16 master weights or the fused update, FP8
state."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax

from fp8jax.accumulate import widen
from fp8jax.linen import FP8_COLLECTION, apply_fp8_updates
from fp8jax.optim import MasterWeights, apply_master_updates
from fp8jax.train.state import TrainState


def apply_gradients(state: TrainState, tx: optax.GradientTransformation, grads, loss,
                    fused_update: Callable | None = None):
  """The update half of a step: ``(new_state, {"loss", "grad_norm"})``.

  `grads`: the step's gradient of all variables: mean parameter gradients under "params"
  and the FP8 state combined by max over microbatches under the FP8 collection.
  `fused_update`: see :func:`make_train_step` (master weights only; other params raise).
  """
  param_grads = grads["params"]
  grad_norm = optax.tree.norm(jax.tree.map(widen, param_grads))  # summed in f32
  fp8 = apply_fp8_updates({FP8_COLLECTION: state.fp8} if state.fp8 else {}, grads).get(
      FP8_COLLECTION, {})
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

