"""Per-tensor FP8 scaling: the state pytree, quantize/dequantize and scale updates.

Scale convention (one for all of fp8jax): ``scale`` is an f32 scalar *dequantization*
factor. A tensor ``x`` is stored as ``q = fp8(clip(x / scale, -fp8_max, fp8_max))`` and read
back as ``x ~= f32(q) * scale``. A fresh scale maps the tensor's amax to
``fp8_max / 2**margin``: ``scale = amax * 2**margin / fp8_max`` (rounded up to a power of two
when the recipe asks). An amax that is zero, inf or NaN keeps the previous scale.

Delayed scaling uses ``Fp8Meta.scale``, computed from the amax history at the previous
update, so quantization needs no extra pass over the tensor. Current scaling computes the
scale from the tensor's own amax just in time. A meta whose history is still all zero (never
observed a tensor) uses current scaling once, so the first step does not quantize with an
arbitrary scale of 1; that fallback makes every delayed cast depend on its tensor's amax (two
passes over the tensor), which ``Recipe(calibrated=True)`` removes once every state has
observed a tensor.

A chained FP8 op (``fp8jax.dot``) returns its state as passed in and gets its updated
state back as that state's cotangent: its custom VJP is defined with symbolic zeros
(:func:`primal_values_fwd`), and :func:`combine_cotangent` combines the update with what a
later call of the same layer gave, if any.

Amaxes are reduced with ``lax.pmax`` over ``axis_names`` (the mesh axes a tensor is sharded
on inside ``shard_map``), so every device computes the same scale. Under plain ``jax.jit`` with
sharded arrays the reduction is already global and ``axis_names`` stays empty.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from fp8jax.recipe import Recipe


class Fp8Meta(NamedTuple):
  """FP8 state of one tensor role.

  Attributes:
    scale: f32[] dequantization factor to use at the next cast.
    amax_history: f32[L] past amaxes, newest at index 0.
  """

  scale: jax.Array
  amax_history: jax.Array


def init_meta(history_len: int) -> Fp8Meta:
  """A meta that has seen no tensor yet: scale 1, history of zeros."""
  return Fp8Meta(jnp.ones((), jnp.float32), jnp.zeros((history_len,), jnp.float32))


def fp8_max(fmt) -> float:
  """Largest finite value of FP8 dtype `fmt` (448 for E4M3, 57344 for E5M2)."""
  return float(jnp.finfo(fmt).max)


# Float types whose sign is the top bit and whose |x| bit patterns sort like |x|, with inf
# and NaN patterns on top: their amax is an integer max over the bits (exact, NaN-safe).
_AMAX_BITS = {np.dtype(d): u for d, u in (
    (jnp.float8_e4m3fn, jnp.uint8), (jnp.float8_e5m2, jnp.uint8), (jnp.float16, jnp.uint16),
    (jnp.bfloat16, jnp.uint16), (jnp.float32, jnp.uint32))}


# The per-cast scalar updates below are written in lax: every cast of every traced program
# runs them, and jax.numpy's functions each add a nested jit to trace.
def _f32(x) -> jax.Array:
  return lax.convert_element_type(x, jnp.float32)


def _zero(x: jax.Array) -> np.ndarray:
  """0 of x's dtype (a scalar the lax comparisons broadcast)."""
  return np.zeros((), x.dtype)


def _finite_positive(x: jax.Array) -> jax.Array:
  """0 < x < inf (bool, x's shape; False for NaN)."""
  return lax.bitwise_and(lax.gt(x, _zero(x)), lax.lt(x, np.asarray(np.inf, x.dtype)))


def _reduce_max(x: jax.Array) -> jax.Array:
  """The max over every axis of a non-empty `x` (NaN wins, as jnp.max)."""
  return lax.reduce_max(x, tuple(range(x.ndim)))


def compute_amax(x: jax.Array, axis_names: Sequence[str] = ()) -> jax.Array:
  """max(|x|) as f32[]: NaN if any element is NaN, 0 for an empty array; reduced with pmax
  over the named mesh axes `axis_names`. For the float types of ``_AMAX_BITS`` it is an
  integer max over the bit patterns without the sign (exact, and a NaN never vanishes)."""
  x = jnp.asarray(x)
  dt = np.dtype(x.dtype)
  if dt in _AMAX_BITS:
    utype = _AMAX_BITS[dt]
    magnitude = np.iinfo(utype).max >> 1  # all bits but the sign
    bits = lax.bitcast_convert_type(x, utype)
    bits = lax.bitwise_and(bits, np.asarray(magnitude, utype))
    code = lax.reduce_max(bits, tuple(range(x.ndim)))  # (0, the unsigned identity, if empty)
    a = _f32(lax.bitcast_convert_type(code, x.dtype))
  else:
    a = jnp.max(jnp.abs(x), initial=0).astype(jnp.float32)
    if jnp.issubdtype(dt, jnp.inexact):  # the float max reduction may drop NaNs
      a = jnp.where(jnp.any(jnp.isnan(x)), jnp.nan, a)
  if axis_names:
    a = lax.pmax(a, tuple(axis_names))
  return a


def power_of_two_at_least(x: jax.Array) -> jax.Array:
  """The least power of two >= `x`, exactly (``exp2(ceil(log2(x)))`` may miss by an ulp),
  where `x` is finite and > 0; `x` itself elsewhere."""
  x = jnp.asarray(x)
  m, e = jnp.frexp(x)  # x = m * 2**e, 0.5 <= |m| < 1
  p = jnp.ldexp(jnp.ones_like(x), jnp.where(m == 0.5, e - 1, e))
  return jnp.where(jnp.isfinite(x) & (x > 0), p, x)


def scale_from_amax(amax: jax.Array, prev_scale: jax.Array, fmt, margin: float = 0,
                    power_of_two: bool = False) -> jax.Array:
  """The scale mapping `amax` to fp8_max / 2**margin; `prev_scale` where amax is 0/inf/NaN
  (or the scale would under- or overflow f32). Shapes: `amax` any (f32 after conversion);
  `prev_scale` a scalar or an array broadcasting to `amax`'s trailing axes; the result has
  `amax`'s shape."""
  return _scale(amax, prev_scale, _factor(fmt, margin), power_of_two)


def _factor(fmt, margin: float) -> np.ndarray:
  """2**margin / fp8_max(fmt) as f32: the scale per unit of amax."""
  return np.float32(2.0 ** margin / fp8_max(fmt))


def _scale(amax: jax.Array, prev_scale: jax.Array, factor, power_of_two: bool) -> jax.Array:
  """:func:`scale_from_amax` with its factor given (an f32 scalar, or an array of `amax`'s
  shape: one factor per element)."""
  amax = _f32(amax)
  scale = lax.mul(amax, factor)
  if power_of_two:
    scale = power_of_two_at_least(scale)
  # amax * c with a finite c > 0 is finite and > 0 exactly when amax is, unless the product
  # under- or overflows, which makes the scale unusable too: testing the scale is enough.
  usable = _finite_positive(scale)
  prev = lax.broadcast_in_dim(_f32(prev_scale), scale.shape,
                              tuple(range(scale.ndim - jnp.ndim(prev_scale), scale.ndim)))
  return lax.select(usable, scale, prev)


def record_amax(history: jax.Array, amax: jax.Array) -> jax.Array:
  """History [..., L] with `amax` [...] pushed at index 0 of its last axis (oldest dropped); a
  non-finite amax records 0."""
  amax = lax.convert_element_type(amax, history.dtype)
  amax = lax.select(lax.is_finite(amax), amax, lax.broadcast(_zero(amax), amax.shape))
  last = history.ndim - 1
  older = lax.slice_in_dim(history, 0, history.shape[last] - 1, axis=last)
  return lax.concatenate([lax.expand_dims(amax, (last,)), older], last)


def history_amax(history: jax.Array, recipe: Recipe) -> jax.Array:
  """The amax a scale is chosen from, over the last axis of `history` [..., L]: its max, or
  its newest entry."""
  last = history.ndim - 1
  return (lax.reduce_max(history, (last,)) if recipe.amax_compute_algo == "max"
          else lax.index_in_dim(history, 0, last, keepdims=False))


def _update(scale: jax.Array, history: jax.Array, amax: jax.Array, factor,
            recipe: Recipe) -> Fp8Meta:
  """The delayed update of states (scale [...], history [..., L]) with `amax` [...] and the
  scale factor `factor` (see :func:`_scale`)."""
  history = record_amax(history, amax)
  return Fp8Meta(_scale(history_amax(history, recipe), scale, factor,
                        recipe.power_of_two_scales), history)


def update_meta(meta: Fp8Meta, amax: jax.Array, recipe: Recipe, fmt) -> Fp8Meta:
  """Delayed update: record `amax`, then the next scale from the new history."""
  return _update(meta.scale, meta.amax_history, amax, _factor(fmt, recipe.margin), recipe)


def _stack(xs: Sequence[jax.Array]) -> jax.Array:
  """The arrays `xs` (one shape) stacked on a new leading axis."""
  return lax.concatenate([lax.expand_dims(x, (0,)) for x in xs], 0)


def update_metas(metas: Sequence[Fp8Meta], amaxes: Sequence[jax.Array], recipe: Recipe,
                 fmts: Sequence) -> tuple[Fp8Meta, ...]:
  """:func:`update_meta` of each ``(metas[i], amaxes[i], fmts[i])``, bit-identical, computed
  as one stacked update when the metas' scales and histories share their shapes (e.g. one
  GEMM's input, kernel and output-gradient states: one set of small XLA kernels instead of
  three), one by one otherwise. `amaxes[i]`: f32, shaped like ``metas[i].scale``. Returns the
  updated metas in order."""
  if len(metas) < 2 or len({(m.scale.shape, m.amax_history.shape) for m in metas}) != 1:
    return tuple(update_meta(m, a, recipe, f) for m, a, f in zip(metas, amaxes, fmts))
  scale = _stack([m.scale for m in metas])  # [n, ...]
  factor = np.array([_factor(f, recipe.margin) for f in fmts], np.float32)
  new = _update(scale, _stack([m.amax_history for m in metas]),
                _stack([lax.convert_element_type(a, jnp.float32) for a in amaxes]),
                lax.broadcast_in_dim(factor, scale.shape, (0,)), recipe)
  return tuple(Fp8Meta(lax.index_in_dim(new.scale, i, keepdims=False),
                       lax.index_in_dim(new.amax_history, i, keepdims=False))
               for i in range(len(metas)))


def scale_for_cast(meta: Fp8Meta, amax: jax.Array, recipe: Recipe, fmt) -> jax.Array:
  """The scale to cast a tensor of amax `amax` with now (delayed or current scaling)."""
  current = scale_from_amax(amax, meta.scale, fmt, recipe.margin, recipe.power_of_two_scales)
  if recipe.scaling == "current":
    return current
  if recipe.calibrated:  # no dependence on this tensor's amax: XLA fuses amax and cast
    return meta.scale
  history = meta.amax_history
  never_observed = lax.le(_reduce_max(history), _zero(history))
  return lax.select(never_observed, current, _f32(meta.scale))


def quantize(x: jax.Array, scale: jax.Array, fmt) -> jax.Array:
  """x / scale, clipped to the finite range of `fmt`, cast to `fmt` (math in f32)."""
  bound = fp8_max(fmt)
  inverse = lax.div(np.float32(1), _f32(scale))
  y = _f32(x)
  if inverse.shape == y.shape:
    y = lax.mul(y, inverse)
  elif inverse.ndim == 0:
    y = lax.mul(y, lax.broadcast(inverse, y.shape))
  else:
    y = y * inverse  # (numpy broadcasting)
  return lax.convert_element_type(lax.clamp(np.float32(-bound), y, np.float32(bound)), fmt)


def cast_health(x: jax.Array, scale: jax.Array, fmt) -> tuple[jax.Array, jax.Array]:
  """What casting `x` with `scale` to `fmt` loses: (fraction of elements saturated, i.e. that
  round beyond fp8_max and are clipped; fraction of nonzero elements flushed to zero), f32[]."""
  info = jnp.finfo(fmt)
  half_ulp_at_max = 2.0 ** (int(np.floor(np.log2(float(info.max)))) - int(info.nmant) - 1)
  y = jnp.abs(x.astype(jnp.float32)) * (1.0 / scale)
  saturated = jnp.mean((y >= float(info.max) + half_ulp_at_max).astype(jnp.float32))
  flushed = (x != 0) & (quantize(x, scale, fmt).astype(jnp.float32) == 0)
  return saturated, jnp.mean(flushed.astype(jnp.float32))


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.float32) -> jax.Array:
  """f32(q) * scale, cast to `dtype`."""
  return (q.astype(jnp.float32) * scale).astype(dtype)


def keep_untouched(new: Fp8Meta, old: Fp8Meta) -> Fp8Meta:
  """`new` where it was updated, else `old`.

  An updated scale is always > 0; a GEMM that did not run in the forward gets a zero
  cotangent (scale 0) for its state, which must never be written back.
  """
  touched = lax.gt(new.scale, _zero(new.scale))
  rows = lax.broadcast_in_dim(touched, new.amax_history.shape, tuple(range(touched.ndim)))
  return Fp8Meta(lax.select(touched, new.scale, old.scale),
                 lax.select(rows, new.amax_history, old.amax_history))


def _combine_meta(a: Fp8Meta, b: Fp8Meta) -> Fp8Meta:
  newest_a, newest_b = a.amax_history[..., 0], b.amax_history[..., 0]
  scale = lax.select(lax.gt(newest_b, newest_a), b.scale,
                     lax.select(lax.gt(newest_a, newest_b), a.scale, lax.max(a.scale, b.scale)))
  return Fp8Meta(scale, lax.max(a.amax_history, b.amax_history))


def combine_max(a, b):
  """Combines two updated FP8 states of the same tensors by max (any pytree of Fp8Meta).

  Updates that start from one state (microbatches, repeated calls of a layer) differ only
  in the amax they recorded at history index 0: the result keeps the elementwise max of the
  histories and the scale of the update that recorded the larger amax, i.e. exactly the
  update the larger amax alone would give. Never sum FP8 state.
  """
  return jax.tree.map(_combine_meta, a, b, is_leaf=lambda x: isinstance(x, Fp8Meta))


def primal_values_fwd(fwd, static: tuple[int, ...]):
  """`fwd` as a ``custom_vjp`` forward rule defined with ``symbolic_zeros=True``, whose
  differentiable arguments arrive as ``CustomVJPPrimal`` leaves: `fwd` gets their values
  (the arguments at positions `static`, the ``nondiff_argnums``, as they come)."""
  def values_fwd(*args):
    return fwd(*(a if i in static else custom_vjp_primal_tree_values(a)
                 for i, a in enumerate(args)))
  return values_fwd


def dense_cotangent(ct):
  """`ct` (a cotangent given to a ``custom_vjp`` rule defined with ``symbolic_zeros=True``)
  with each symbolic zero leaf made an array of zeros of its shape and dtype."""
  return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype) if isinstance(x, SymbolicZero)
                      else x, ct)


def combine_cotangent(new, meta_ct):
  """A chained FP8 op's state cotangent: `new`, its own updated FP8 state, combined by max
  (:func:`combine_max`) with `meta_ct`, the cotangent of the state it passed through to a
  later call of the same layer; `new` itself when the passthrough fed nothing (`meta_ct`'s
  leaves all symbolic zeros: ``defvjp(..., symbolic_zeros=True)``), which leaves a single
  call's backward without a combine against zeros."""
  if all(isinstance(x, SymbolicZero) for x in jax.tree.leaves(meta_ct)):
    return new
  return combine_max(new, dense_cotangent(meta_ct))


def checkpoint_named(name: str, *arrays):
  """`arrays` (FP8 payloads, f32 scales / amaxes) tagged ``checkpoint_name(.., name)``;
  values unchanged.

  FP8 payloads are tagged as their uint8 bits: remat rounds saved float residuals with
  ``reduce_precision(finfo(dtype))``, whose IEEE-style E4M3 (max 240, with inf) turns
  E4M3FN values above 240 into NaN.
  """
  out = []
  for a in arrays:
    if jnp.dtype(a.dtype).itemsize == 1:
      bits = checkpoint_name(lax.bitcast_convert_type(a, jnp.uint8), name)
      out.append(lax.bitcast_convert_type(bits, a.dtype))
    else:
      out.append(checkpoint_name(a, name))
  return tuple(out)
