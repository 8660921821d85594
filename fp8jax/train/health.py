"""FP8 cast health of a model on one batch: per tensor role, the fraction of elements that
saturate and the fraction of nonzero elements flushed to zero by the FP8 casts of a step.

A probe, not part of the train step: one extra forward+backward with the Flax collections
``fp8_health`` (forward casts, sown by the FP8 layers) and ``perturbations`` (zero additions to
each FP8 GEMM's output whose gradient is that GEMM's output gradient) made mutable.
A layer called twice in one forward shares one perturbation, so its output-gradient numbers
describe the sum of both calls' gradients (its forward casts are exact: max over calls).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax import scaling
from fp8jax.linen import HEALTH_COLLECTION, PERTURBATIONS
from fp8jax.recipe import Recipe
from fp8jax.train.step import cross_entropy

ROLES = ("input", "kernel", "output_grad")


def _by_module(tree) -> dict:
  """{module path: {leaf name: value}} of a collection."""
  out: dict = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    out.setdefault(keys[:-1], {})[keys[-1]] = leaf
  return out


def _output_grad_health(g, scale, fmt):
  """cast_health of an output gradient with the scale the step would use (0: its own amax)."""
  own = scaling.scale_from_amax(scaling.compute_amax(g), jnp.float32(1), fmt)
  return scaling.cast_health(g, jnp.where(scale > 0, scale, own), fmt)


def fp8_cast_health(model, variables: dict, batch: jax.Array, recipe: Recipe) -> dict:
  """{"fp8/<role>/saturated" | "fp8/<role>/flushed": worst fraction over all FP8 GEMMs}.

  `batch` is int32[B, T+1] (inputs and next-token targets); jit it for repeated use.
  """
  tokens, targets = batch[:, :-1], batch[:, 1:]
  _, probe = model.apply(variables, tokens, mutable=[HEALTH_COLLECTION, PERTURBATIONS])

  def loss(perturbations):
    logits, _ = model.apply({**variables, PERTURBATIONS: perturbations}, tokens,
                            mutable=[HEALTH_COLLECTION])
    return cross_entropy(logits, targets)

  grads = _by_module(jax.grad(loss)(probe[PERTURBATIONS]))
  worst = {f"fp8/{r}/{k}": jnp.zeros(()) for r in ROLES for k in ("saturated", "flushed")}
  for path, sown in _by_module(probe[HEALTH_COLLECTION]).items():
    for role in ("input", "kernel"):
      for k in ("saturated", "flushed"):
        name = f"fp8/{role}/{k}"
        worst[name] = jnp.maximum(worst[name], jnp.max(sown[f"{role}_{k}"]))
    g, scale = grads[path]["output"], sown["output_grad_scale"]
    health = _output_grad_health
    if scale.ndim:  # stacked over the layers of a scan
      health = jax.vmap(health, in_axes=(0, 0, None))
    for k, v in zip(("saturated", "flushed"), health(g, scale, recipe.bwd_format)):
      worst[f"fp8/output_grad/{k}"] = jnp.maximum(worst[f"fp8/output_grad/{k}"], jnp.max(v))
  return worst
