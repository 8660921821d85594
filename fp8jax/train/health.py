"""FP8 cast health of a model on one batch: per tensor role, the fraction of elements that
saturate and the fraction of nonzero elements flushed to zero by the FP8 casts of a step; and
the FP8 state the batch would leave (what a calibration needs).

A probe, not part of the train step: one forward+backward with the Flax collection
``fp8_health`` mutable (the forward casts' fractions, sown by the FP8 layers) and, in the
collection ``perturbations``, one f32[2] per FP8 GEMM whose gradient is the (saturated,
flushed) fractions of that GEMM's output-gradient cast (``fp8jax.linen``: an identity with a
custom backward). It differentiates only those and the FP8 state, never the parameters, and
keeps nothing beyond what the model's backward keeps (its remat policy): on the same batch it
needs no more memory than a train step's microbatch. A layer called twice in one forward
reports the sum of its calls' output-gradient fractions (its forward casts: max over calls).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from fp8jax.linen import FP8_COLLECTION, HEALTH_COLLECTION, PERTURBATIONS, apply_fp8_updates
from fp8jax.recipe import Recipe
from fp8jax.train.loss import cross_entropy

ROLES = ("input", "kernel", "output_grad")


def _by_module(tree) -> dict:
  """{module path: {leaf name: value}} of a collection."""
  out: dict = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = tuple(str(getattr(k, "key", k)) for k in path)
    out.setdefault(keys[:-1], {})[keys[-1]] = leaf
  return out


def probe(model, variables: dict, batch: jax.Array) -> tuple[dict, dict]:
  """(health, fp8): the probe of a linen `model` with FP8 layers on `batch` int32[B, T+1]
  (inputs and next-token targets) with `variables` ({"params", "fp8_meta"}).

  health: {"fp8/<role>/saturated" | "fp8/<role>/flushed": worst fraction over all FP8 GEMMs}
  (role: input, kernel, output_grad; f32[] in [0, 1]). fp8: the FP8 collection as a train
  step on `batch` would leave it (``fp8jax.apply_fp8_updates``; {} without one). Jit it."""
  tokens, targets = batch[:, :-1], batch[:, 1:]
  shapes = jax.eval_shape(
      lambda v: model.apply(v, tokens, mutable=[HEALTH_COLLECTION, PERTURBATIONS])[1],
      variables)
  taps = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes.get(PERTURBATIONS, {}))
  fp8 = variables.get(FP8_COLLECTION, {})

  def loss(taps, fp8):
    v = {**variables, PERTURBATIONS: taps, **({FP8_COLLECTION: fp8} if fp8 else {})}
    logits, sown = model.apply(v, tokens, mutable=[HEALTH_COLLECTION])
    return cross_entropy(logits, targets), sown.get(HEALTH_COLLECTION, {})

  (tap_grads, fp8_grads), sown = jax.grad(loss, argnums=(0, 1), has_aux=True)(taps, fp8)
  worst = {f"fp8/{r}/{k}": jnp.zeros(()) for r in ROLES for k in ("saturated", "flushed")}
  for values in _by_module(sown).values():
    for role in ("input", "kernel"):
      for k in ("saturated", "flushed"):
        name = f"fp8/{role}/{k}"
        worst[name] = jnp.maximum(worst[name], jnp.max(values[f"{role}_{k}"]))
  for g in jax.tree.leaves(tap_grads):  # [..., 2] (stacked over the layers of a scan)
    pair = jnp.max(jnp.reshape(g, (-1, 2)), axis=0)
    for i, k in enumerate(("saturated", "flushed")):
      name = f"fp8/output_grad/{k}"
      worst[name] = jnp.maximum(worst[name], pair[i])
  if fp8:
    fp8 = apply_fp8_updates({FP8_COLLECTION: fp8}, {FP8_COLLECTION: fp8_grads})[FP8_COLLECTION]
  return worst, fp8


def fp8_cast_health(model, variables: dict, batch: jax.Array,
                    recipe: Recipe | None = None) -> dict:
  """The health half of :func:`probe` (same arguments). `recipe`: ignored (each FP8 layer
  casts with its own recipe); jit it for repeated use."""
  del recipe
  return probe(model, variables, batch)[0]
