"""FP8 cast health of a model on one batch: per tensor role, the fraction of elements that
saturate and the fraction of nonzero elements flushed to zero by the FP8 casts of a step; and
the FP8 state the batch would leave (what a calibration needs).

A probe, not part of the train step: one forward+backward that differentiates only the FP8
state and, in the collection ``perturbations``, two zero taps per FP8 GEMM
(``fp8jax.linen``: identities with a custom backward): the gradient of "forward_health"
(f32[4]) is the (saturated, flushed) fractions of the GEMM's input and kernel casts, that of
"output_grad_health" (f32[2]) those of its output-gradient cast, each summed over the layer's
calls. It never differentiates the parameters and saves what the model's backward saves (its
remat policy). Through pipeline stages the taps ride in the stacked and shared variables
(``fp8jax.train.pipeline_loop.pipeline_probe``).
"""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp

from fp8jax.linen import FP8_COLLECTION, PERTURBATIONS, apply_fp8_updates
from fp8jax.recipe import Recipe
from fp8jax.scaling import Fp8Meta
from fp8jax.train.loss import cross_entropy

ROLES = ("input", "kernel", "output_grad")
_TAPS = {"forward_health": ("input", "kernel"), "output_grad_health": ("output_grad",)}


def taps(model, variables: dict, tokens) -> dict:
  """The zero taps of `model`'s FP8 GEMMs on `tokens` int[B, T] (the ``perturbations``
  collection: {"forward_health": f32[4], "output_grad_health": f32[2]} per GEMM, stacked
  [L, ...] under a layer scan); {} without FP8 GEMMs. No model runs: with an FP8 collection
  in `variables`, one pair beside each GEMM's FP8 state (where ``fp8jax.linen`` creates
  them, with the state's stacked axes); without one, from an abstract forward pass."""
  fp8 = variables.get(FP8_COLLECTION)
  if fp8:
    return _taps_beside(fp8)
  shapes = jax.eval_shape(
      lambda v: model.apply(v, tokens, mutable=[PERTURBATIONS])[1], variables)
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes.get(PERTURBATIONS, {}))


def _taps_beside(fp8: Mapping) -> dict:
  """The taps of the FP8 collection `fp8` (nested mappings; a GEMM's state is a mapping
  with an Fp8Meta "input")."""
  meta = fp8.get("input")
  if isinstance(meta, Fp8Meta):
    lead = jnp.shape(meta.scale)
    return {"forward_health": jnp.zeros(lead + (4,), jnp.float32),
            "output_grad_health": jnp.zeros(lead + (2,), jnp.float32)}
  out = {}
  for key, value in fp8.items():
    if isinstance(value, Mapping):
      inner = _taps_beside(value)
      if inner:
        out[key] = inner
  return out


def health_from_taps(tap_grads) -> dict:
  """{"fp8/<role>/saturated" | "fp8/<role>/flushed": worst fraction over all FP8 GEMMs}
  (role: input, kernel, output_grad; f32[] in [0, 1]) from the gradients of :func:`taps`."""
  worst = {f"fp8/{r}/{k}": jnp.zeros(()) for r in ROLES for k in ("saturated", "flushed")}
  for path, g in jax.tree_util.tree_flatten_with_path(tap_grads)[0]:
    roles = _TAPS.get(str(getattr(path[-1], "key", path[-1])))
    if roles is None:
      continue
    rows = jnp.max(jnp.reshape(g, (-1, 2 * len(roles))), axis=0)  # over a scan's layers
    for i, role in enumerate(roles):
      for j, k in enumerate(("saturated", "flushed")):
        name = f"fp8/{role}/{k}"
        worst[name] = jnp.maximum(worst[name], rows[2 * i + j])
  return worst


def probe(model, variables: dict, batch: jax.Array) -> tuple[dict, dict]:
  """(health, fp8): the probe of a linen `model` with FP8 layers on `batch` int32[B, T+1]
  (inputs and next-token targets) with `variables` ({"params", "fp8_meta"}).

  health: :func:`health_from_taps`' dict. fp8: the FP8 collection as a train step on `batch`
  would leave it (``fp8jax.apply_fp8_updates``; {} without one). Jit it."""
  tokens, targets = batch[:, :-1], batch[:, 1:]
  fp8 = variables.get(FP8_COLLECTION, {})

  def loss(t, fp8):
    v = {**variables, PERTURBATIONS: t, **({FP8_COLLECTION: fp8} if fp8 else {})}
    return cross_entropy(model.apply(v, tokens), targets)

  tap_grads, fp8_grads = jax.grad(loss, argnums=(0, 1))(taps(model, variables, tokens), fp8)
  if fp8:
    fp8 = apply_fp8_updates({FP8_COLLECTION: fp8}, {FP8_COLLECTION: fp8_grads})[FP8_COLLECTION]
  return health_from_taps(tap_grads), fp8


def fp8_cast_health(model, variables: dict, batch: jax.Array,
                    recipe: Recipe | None = None) -> dict:
  """The health half of :func:`probe` (same arguments). `recipe`: ignored (each FP8 layer
  casts with its own recipe); jit it for repeated use."""
  del recipe
  return probe(model, variables, batch)[0]
