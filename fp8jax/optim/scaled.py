"""Scaled low-precision arrays: a narrow-float payload plus one f32 scale per tensor.

Same convention as :mod:`fp8jax.scaling`: ``scale`` is an f32 *dequantization* factor, the
tensor is stored as ``data = dtype(clip(x / scale))`` and read back as ``x ~= f32(data) * scale``.
A fresh scale maps the tensor's amax to :func:`payload_max` (``finfo(dtype).max / 2**margin``
for FP8/FP16 payloads, 1 for wide ones such as bfloat16/float32), so the payload neither
saturates nor spends its range above the largest element. A scale of 0 means "all zeros"; a
non-finite amax gives a non-finite scale, so a NaN/inf tensor reads back as NaN, never as
silent zeros.

Amaxes are agreed per tensor: under ``jax.jit`` with sharded arrays ``jnp.max`` is already
global; inside ``shard_map`` they are reduced with ``lax.pmax`` over ``axis_names`` and over
every mesh axis the array is known to vary over.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.scaling import compute_amax, power_of_two_at_least

# Smallest normal f32: scales are kept at or above it (XLA flushes f32 subnormals to zero).
_TINY = float(np.finfo(np.float32).tiny)


class ScaledArray(NamedTuple):
  """One tensor stored in a narrow float type with a per-tensor f32 scale.

  Attributes:
    data: payload, any shape, low-precision float (E4M3, E5M2, FP16, ...).
    scale: f32[] dequantization factor: ``x ~= f32(data) * scale``; 0 for an all-zero tensor.
  """

  data: jax.Array
  scale: jax.Array

  @property
  def shape(self):
    return self.data.shape

  @property
  def dtype(self):
    return self.data.dtype


def is_scaled(x) -> bool:
  """True for a :class:`ScaledArray` (use as ``is_leaf`` in tree maps)."""
  return isinstance(x, ScaledArray)


def check_float_dtype(where: str, name: str, dtype):
  """`dtype` as a numpy dtype; ValueError naming `where`.`name` unless it is a float type."""
  if isinstance(dtype, (jax.Array, np.ndarray)):  # an array, e.g. a dtype run as a schedule
    raise ValueError(f"{where}: {name} is an array of {dtype.dtype}, not a dtype; under "
                     "optax.inject_hyperparams name it in static_args")
  try:
    dt = np.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"{where}: {name}={dtype!r} is not allowed; use a floating dtype such as "
                     "float8_e4m3fn, float8_e5m2, float16, bfloat16 or float32")
  return dt


def check_real(where: str, what: str, tree) -> None:
  """ValueError naming the first complex leaf of `tree` (its key path and dtype).

  Scaled payloads, scales and amaxes are real: a complex leaf would lose its imaginary part.
  `what` names the leaves in the message ("parameter", "gradient").
  """
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_scaled)[0]:
    x = leaf.data if is_scaled(leaf) else leaf
    dtype = getattr(x, "dtype", None)
    if dtype is None and isinstance(x, complex):
      dtype = np.dtype(complex)
    if dtype is not None and jnp.issubdtype(dtype, jnp.complexfloating):
      where_in_tree = jax.tree_util.keystr(path) or "(the whole tree)"
      raise ValueError(f"{where}: {what} {where_in_tree} is {np.dtype(dtype)}; fp8jax.optim "
                       "supports real leaves only: give complex leaves a plain optax optimizer "
                       "with optax.partition (docs/optim.md)")


def payload_max(dtype, margin: float = 0) -> float:
  """The payload magnitude a fresh scale maps the amax to.

  ``finfo(dtype).max / 2**margin`` for narrow types (FP8: 448 / 57344, FP16: 65504); 1.0 for
  wide types (bfloat16, float32), whose range needs no scaling (their scale only normalises).
  """
  fmax = float(jnp.finfo(dtype).max)
  return fmax / 2.0 ** margin if fmax <= 65504.0 else 1.0


def varying_axes(x) -> frozenset:
  """Manual mesh axes (inside ``shard_map``) that `x` is typed as varying over; empty outside."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; older releases: aval.vma
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", None) or ())


def local_amax(x) -> jax.Array:
  """max(|x|) of this device's data as f32[] (:func:`fp8jax.scaling.compute_amax`) with a NaN
  as inf; for a :class:`ScaledArray` the payload's amax times the scale; 0 if empty."""
  a = compute_amax(x.data if is_scaled(x) else x)
  if is_scaled(x):
    a = a * x.scale
  return jnp.where(jnp.isnan(a), jnp.inf, a)


def amaxes(leaves, axis_names: Sequence[str] = ()) -> jax.Array:
  """f32[len(leaves)]: the agreed amax of each leaf (see :func:`local_amax`).

  All leaves share one ``lax.pmax`` over `axis_names` and every mesh axis any leaf varies
  over inside ``shard_map`` (a no-op reduction for leaves that do not vary over an axis), so a
  tree costs one collective, not one per tensor.
  """
  leaves = list(leaves)
  if not leaves:
    return jnp.zeros((0,), jnp.float32)
  a = jnp.stack([local_amax(x) for x in leaves])
  axes = set(axis_names)
  for x in leaves:
    axes |= varying_axes(x.data if is_scaled(x) else x)
  return lax.pmax(a, tuple(sorted(axes))) if axes else a


def amax(x, axis_names: Sequence[str] = ()) -> jax.Array:
  """max(|x|) as f32[], agreed across devices; a NaN anywhere gives inf (it never vanishes).

  `x` may be a :class:`ScaledArray` (amax of the payload times the scale) or an empty array
  (amax 0). Inside ``shard_map`` the amax is reduced with pmax over `axis_names` and every
  axis `x` varies over, so all devices get the same value.
  """
  return amaxes([x], axis_names)[0]


def scale_from_bound(bound: jax.Array, pmax: float, power_of_two: bool = False) -> jax.Array:
  """The f32 scale mapping `bound` (>= amax) to `pmax`: 0 for a zero bound, never below the
  smallest normal f32 otherwise, inf for an infinite or NaN bound."""
  bound = jnp.asarray(bound, jnp.float32)
  bound = jnp.where(jnp.isnan(bound), jnp.inf, bound)
  scale = jnp.maximum(bound * (1.0 / pmax), _TINY)
  if power_of_two:
    scale = power_of_two_at_least(scale)
  return jnp.where(bound > 0, scale, 0.0).astype(jnp.float32)


def quantize_with_scale(x, scale: jax.Array, dtype, *, rounding=None) -> jax.Array:
  """The payload ``dtype(clip(x / scale))`` (math in f32); zeros for finite `x` where scale
  is 0, inf or NaN.

  `rounding` is None (round to nearest even) or a callable ``(y_f32, dtype) -> payload``
  such as :func:`fp8jax.optim.stochastic_round` bound to a seed.
  """
  scale = jnp.asarray(scale, jnp.float32)
  inv = jnp.where(scale > 0, 1.0 / scale, 0.0)
  bound = float(jnp.finfo(dtype).max)
  y = jnp.clip(jnp.asarray(x).astype(jnp.float32) * inv, -bound, bound)
  return y.astype(dtype) if rounding is None else rounding(y, dtype)


def quantize_scaled(x, dtype, *, margin: float = 0, axis_names: Sequence[str] = (),
                    power_of_two: bool = False, rounding=None) -> ScaledArray:
  """`x` as a :class:`ScaledArray` of payload type `dtype` with a just-in-time scale.

  The scale maps the (agreed) amax of `x` to ``payload_max(dtype, margin)``; with
  `power_of_two` it is rounded up to a power of two, so rescaling an already stored tensor is
  exact. An all-zero `x` gets scale 0; a non-finite one a non-finite scale.
  """
  return quantize_leaves([x], dtype, margin=margin, axis_names=axis_names,
                         power_of_two=power_of_two,
                         roundings=None if rounding is None else [rounding])[0]


def quantize_leaves(xs, dtype, *, margin: float = 0, axis_names: Sequence[str] = (),
                    power_of_two: bool = False, roundings=None) -> list:
  """:func:`quantize_scaled` of every array in `xs`, with one agreement of all amaxes and the
  scales computed together (one small kernel for the tree, not one per tensor)."""
  dtype = check_float_dtype("quantize_scaled", "dtype", dtype)
  xs = list(xs)
  scales = scale_from_bound(amaxes(xs, axis_names), payload_max(dtype, margin), power_of_two)
  roundings = roundings or [None] * len(xs)
  return [ScaledArray(quantize_with_scale(x, scales[i], dtype, rounding=roundings[i]), scales[i])
          for i, x in enumerate(xs)]


def dequantize_scaled(x, dtype=jnp.float32) -> jax.Array:
  """``f32(data) * scale`` cast to `dtype`; a plain array is only cast."""
  if is_scaled(x):
    return (x.data.astype(jnp.float32) * x.scale).astype(dtype)
  return jnp.asarray(x).astype(dtype)


def zeros_like_scaled(p, dtype) -> ScaledArray:
  """An all-zero :class:`ScaledArray` (scale 0) shaped, and outside jit sharded, like `p`."""
  data = p.data if is_scaled(p) else p
  return ScaledArray(jnp.zeros_like(data, dtype=dtype), jnp.zeros((), jnp.float32))
