"""Flax linen support: an FP8 ``dot_general_cls`` and FP8 state handling.

Usage::

  dense = nn.Dense(1024, dot_general_cls=functools.partial(fp8jax.linen.Fp8DotGeneral,
                                                           recipe=fp8jax.Recipe()))
  variables = model.init(key, x)                    # {'params': ..., 'fp8_meta': ...}
  grads = jax.grad(loss_fn)(variables, batch)       # differentiate ALL variables
  updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
  variables = fp8jax.apply_fp8_updates(variables, grads)   # FP8 state <- its new value
  variables = {**variables, "params": optax.apply_updates(variables["params"], updates)}

The FP8 state lives in the collection ``FP8_COLLECTION``; its "gradient" is its updated
value, so the optimizer must only ever see ``grads["params"]``. Under ``nn.scan`` over layers
put ``FP8_COLLECTION`` in ``variable_axes`` (state stacked on the layer axis).
"""
from __future__ import annotations

import weakref
from typing import Any, Sequence

import flax.linen as nn

from fp8jax import dot, scaling
from fp8jax.dot import Fp8DotMeta
from fp8jax.recipe import Recipe

FP8_COLLECTION = "fp8_meta"
_ROLES = Fp8DotMeta._fields
# Per apply (keyed weakly by the root scope): the meta passthrough of each FP8 GEMM's last
# call, so that a second call of the same layer chains onto the first (updates combine by
# max instead of summing).
_CHAINS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


class Fp8DotGeneral(nn.Module):
  """Drop-in ``dot_general_cls`` for ``nn.Dense`` / ``nn.DenseGeneral`` running FP8 GEMMs.

  Attributes:
    recipe: FP8 formats and scaling rules.
    amax_axes: mesh axis names to agree amaxes over (only inside ``shard_map``).
  """

  recipe: Recipe = Recipe()
  amax_axes: Sequence[str] = ()

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               out_sharding=None):
    del precision  # FP8 GEMMs accumulate in f32
    variables = {role: self.variable(FP8_COLLECTION, role, scaling.init_meta,
                                     self.recipe.amax_history_len) for role in _ROLES}
    chain = _CHAINS.setdefault(self.scope.root, {})
    meta = chain.get(self.scope.path)
    if meta is None:
      meta = Fp8DotMeta(*(variables[role].value for role in _ROLES))
    out, chain[self.scope.path] = dot.fp8_dot_general_chained(
        lhs, rhs, dimension_numbers, meta, self.recipe,
        preferred_element_type=preferred_element_type, amax_axes=tuple(self.amax_axes))
    if out_sharding is not None:
      out = _constrain(out, out_sharding)
    return out


def _constrain(x, sharding):
  import jax
  return jax.lax.with_sharding_constraint(x, sharding)


def apply_fp8_updates(variables, grads):
  """`variables` with its FP8 collection replaced by the updated state found in `grads`.

  `grads` is the gradient of the loss with respect to all of `variables`; params are
  returned untouched. Raises ValueError when `grads` holds no FP8 state.
  """
  if FP8_COLLECTION not in variables:
    return variables
  if FP8_COLLECTION not in grads:
    raise ValueError(f"grads has no '{FP8_COLLECTION}' collection (keys: {sorted(grads)}); "
                     "differentiate the loss with respect to all variables, not only params")
  return {**variables, FP8_COLLECTION: grads[FP8_COLLECTION]}
