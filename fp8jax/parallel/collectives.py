"""FP8 gradient collectives for ``jax.shard_map`` bodies: reduce-scatter and all-gather.

Scale convention: :mod:`fp8jax.scaling`'s (``scale`` is an f32 dequantization factor,
``x ~= f32(q) * scale``). Every rank casts with the *same* scale, so FP8 payloads from different
ranks can be added after the wire without rescaling.

Reduce-scatter (:func:`fp8_reduce_scatter`, :func:`fp8_reduce_scatter_tree`) computes what
``lax.psum_scatter(x, axis_name, scatter_dimension=d, tiled=True)`` computes: rank ``i`` gets
chunk ``i`` (along ``d``) of the sum over ranks. It sends FP8 through one ``lax.all_to_all`` (as
uint8 bits, so no backend widens it) and adds the ``n`` received pieces locally in f32, so every
input is rounded to FP8 exactly once and the sum is never rounded to FP8. Its error is that of
one FP8 rounding per input, whatever the number of ranks. A ring that accumulates in FP8 (``psum`` on FP8 arrays, MS-AMP's patched NCCL)
rounds the partial sum at every hop and needs a scale ``n`` times coarser to keep the sum in
range, so its error grows with ``n``. Never ``psum`` FP8 arrays.

Two ways to get the shared scale (the *scaling mode* of a call):

* current (``scales=None``): the agreed amax of this step's tensors (one ``lax.pmax`` of f32[L]
  for a tree of L leaves). Nothing ever saturates; costs a pass over the input before the cast
  and a scalar round trip across ranks before any byte is sent.
* delayed (``scales=`` given, e.g. :func:`comm_scales` of a :class:`CommScaling` state): the
  scale comes from the previous step's agreed amax divided by a pre-scale factor, so the cast
  needs no prior reduction (the amax for the next step is read in the same pass as the cast and
  agreed after it, off the critical path).
  Gradients that grow between steps saturate; FP8-LM's automatic scaling
  (:func:`update_comm_scaling`) halves the pre-scale when more than 0.001% of the values
  saturate and grows it back (x2 after ``growth_interval`` clean steps, at most 1).
  :func:`fp8_reduce_scatter_auto` runs the whole loop (current scaling at the first step).

All functions take a mesh axis name or a tuple of them (ranks numbered like
``lax.axis_index`` of the tuple, as ``psum_scatter`` does).
"""
from __future__ import annotations

import math
from typing import NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax.optim.scaled import (ScaledArray, local_amax, payload_max, quantize_with_scale,
                                 scale_from_bound)

AxisName = Union[str, Sequence[str]]

FP8_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
SATURATION_THRESHOLD = 1e-5  # FP8-LM: halve the pre-scale above 0.001% saturated values
GROWTH_INTERVAL = 1000  # FP8-LM: clean steps before the pre-scale doubles


class CommStats(NamedTuple):
  """What one FP8 collective saw, agreed across ranks (f32[] per tensor, f32[L] for a tree).

  Attributes:
    amax: max |x| over all ranks' inputs (inf if any input is NaN/inf).
    saturated: fraction of all ranks' elements that were clipped at the FP8 maximum.
  """

  amax: jax.Array
  saturated: jax.Array


class CommScaling(NamedTuple):
  """State of FP8-LM automatic scaling for gradient communication (delayed-scale mode).

  Shapes are ``[]`` for one tensor or ``[L]`` for a tree of L leaves (leaf order of
  ``jax.tree.leaves``). Replicated across ranks; updated by :func:`update_comm_scaling`.

  Attributes:
    amax: f32, agreed amax of the previous step's gradients (0: none observed yet).
    pre_scale: f32 in (0, 1], the gradient is multiplied by it before the cast.
    clean_steps: i32, consecutive steps at or below the saturation threshold.
    saturated: f32, saturated fraction of the last step (for logging).
  """

  amax: jax.Array
  pre_scale: jax.Array
  clean_steps: jax.Array
  saturated: jax.Array


# ----------------------------------------------------------------------------- checks

def _axis_tuple(axis_name: AxisName) -> tuple:
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _axis_size(axis_name: AxisName) -> int:
  return int(math.prod(lax.axis_size(a) for a in _axis_tuple(axis_name)))


def _check_fp8(where: str, dtype) -> np.dtype:
  try:
    dt = np.dtype(dtype)
  except TypeError:
    dt = None
  if dt not in FP8_DTYPES:
    raise ValueError(f"{where}: dtype={dtype!r} is not allowed; use one of "
                     f"{[d.name for d in FP8_DTYPES]}")
  return dt


def _check_out_dtype(where: str, dtype) -> np.dtype:
  try:
    dt = np.dtype(dtype)
  except TypeError:
    dt = None
  if dt is None or not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"{where}: out_dtype={dtype!r} is not allowed; use a floating dtype such as "
                     "float32 or bfloat16")
  return dt


def _check_input(where: str, name: str, x) -> None:
  dt = jnp.result_type(x)
  if not jnp.issubdtype(dt, jnp.floating):
    raise ValueError(f"{where}: {name} has dtype {dt}; only floating arrays can be sent in FP8 "
                     "(float32, bfloat16, float16)")


def _check_dim(where: str, name: str, x, dim: int, n: int, what: str) -> int:
  if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool):
    raise ValueError(f"{where}: {what}={dim!r} is not allowed; use an int")
  if not -x.ndim <= dim < max(x.ndim, 1) or x.ndim == 0:
    raise ValueError(f"{where}: {what}={dim} is out of range for {name} of shape {x.shape}; "
                     f"use -{x.ndim} <= {what} < {x.ndim}")
  dim = int(dim) % x.ndim
  if x.shape[dim] % n:
    raise ValueError(f"{where}: {name} has shape {x.shape}, whose dimension {dim} "
                     f"({x.shape[dim]}) is not divisible by the axis size {n}; pad it to a "
                     f"multiple of {n}")
  return dim


# ----------------------------------------------------------------------------- scales and stats

def _saturation_bound(dtype) -> float:
  """|x / scale| at or above which a cast to `dtype` clips (fp8_max plus half an ulp there)."""
  info = jnp.finfo(dtype)
  half_ulp = 2.0 ** (int(np.floor(np.log2(float(info.max)))) - int(info.nmant) - 1)
  return float(info.max) + half_ulp


def _local_saturated(x, scale, dtype) -> jax.Array:
  """Fraction of this rank's elements of `x` that a cast with `scale` clips, f32[]."""
  if x.size == 0:
    return jnp.zeros((), jnp.float32)
  inv = jnp.where(scale > 0, 1.0 / scale, 0.0)
  y = jnp.abs(x.astype(jnp.float32)) * inv
  count = jnp.sum(y >= _saturation_bound(dtype), dtype=jnp.int32)  # exact up to 2**31 elements
  return count.astype(jnp.float32) / x.size


def current_scales(leaves, axis_name: AxisName, dtype=jnp.float8_e4m3fn,
                   margin: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """(scales, amaxes), f32[L] each: one scale per leaf from its amax agreed over `axis_name`
  with one ``lax.pmax``; a scale maps the amax to ``fp8_max / 2**margin``."""
  amax = lax.pmax(jnp.stack([local_amax(x) for x in leaves]), _axis_tuple(axis_name))
  return scale_from_bound(amax, payload_max(dtype, margin)), amax


# ----------------------------------------------------------------------------- reduce-scatter

def _as_bytes(q):
  """FP8 payload reinterpreted as uint8 (free): every backend moves it as 1 byte per element
  (XLA:CPU would otherwise widen FP8 collectives to f16)."""
  return lax.bitcast_convert_type(q, jnp.uint8)


def _as_fp8(b, dtype):
  return lax.bitcast_convert_type(b, dtype)


def _all_to_all_fp8(buf, axis_name, chunks: int):
  """all_to_all of an FP8 [n, m] buffer (row j goes to rank j), in `chunks` column pieces."""
  bounds = np.linspace(0, buf.shape[1], min(chunks, max(buf.shape[1], 1)) + 1).astype(int)
  pieces = [_as_fp8(lax.all_to_all(_as_bytes(buf[:, a:b]), axis_name, 0, 0, tiled=True),
                    buf.dtype) for a, b in zip(bounds[:-1], bounds[1:])]
  return pieces[0] if len(pieces) == 1 else jnp.concatenate(pieces, axis=1)


def _to_chunks(x, dim: int, n: int):
  """`x` with dimension `dim` split into `n` chunks, as [n, chunk_size] (chunk i = rows i)."""
  return jnp.moveaxis(x, dim, 0).reshape(n, -1)


def _from_chunk(flat, x_shape, dim: int, n: int):
  """Inverse of :func:`_to_chunks` for one chunk: [chunk_size] -> x's shape with dim / n."""
  moved = (x_shape[dim] // n,) + tuple(s for i, s in enumerate(x_shape) if i != dim)
  return jnp.moveaxis(flat.reshape(moved), 0, dim)


def fp8_reduce_scatter_tree(tree, axis_name: AxisName, *, scatter_dimension: int = 0,
                            dtype=jnp.float8_e4m3fn, out_dtype=jnp.float32, scales=None,
                            margin: float = 0.0, with_stats: bool = False, chunks: int = 1):
  """``psum_scatter(leaf, axis_name, scatter_dimension, tiled=True)`` of every leaf, in FP8,
  with one ``all_to_all`` for the whole tree.

  Each leaf is cast to `dtype` with its scale (shared by all ranks), its chunks are packed
  into one [n, total / n] FP8 buffer, the buffer goes through one ``lax.all_to_all`` and the
  ``n`` received pieces of each leaf are added in f32 and multiplied by the scale once.

  Args:
    tree: pytree of floating arrays (this rank's gradients); each leaf's `scatter_dimension`
      must be divisible by the axis size n.
    axis_name: mesh axis name or tuple of names (inside ``jax.shard_map``).
    scatter_dimension: dimension of every leaf that is scattered.
    dtype: FP8 payload type on the wire (float8_e4m3fn or float8_e5m2).
    out_dtype: floating type of the result.
    scales: None for current scaling (one ``pmax`` of the amaxes), or f32[L] / a scalar: the
      scales to cast with (delayed scaling; must be equal on all ranks, e.g. :func:`comm_scales`).
    margin: current scaling maps the amax to ``fp8_max / 2**margin``.
    with_stats: also return :class:`CommStats` (f32[L] each; costs one pmax and one psum of
      f32[L] in delayed mode, one psum in current mode).
    chunks: send the packed buffer as this many ``all_to_all``s (along its columns), so the
      cast of one chunk can overlap the transfer of the previous one (a pipelining knob; 1 =
      a single collective).

  Returns:
    The tree of reduced chunks (leaf shape with `scatter_dimension` divided by n, `out_dtype`),
    and with `with_stats` a :class:`CommStats`.
  """
  where = "fp8_reduce_scatter"
  dtype, out_dtype = _check_fp8(where, dtype), _check_out_dtype(where, out_dtype)
  leaves, treedef = jax.tree.flatten(tree)
  if not leaves:
    raise ValueError(f"{where}: the gradient tree has no arrays")
  if not isinstance(chunks, (int, np.integer)) or isinstance(chunks, bool) or chunks < 1:
    raise ValueError(f"{where}: chunks={chunks!r} is not allowed; use an int >= 1")
  n = _axis_size(axis_name)
  names = (["x"] if len(leaves) == 1 else
           [f"leaf {i} ({jax.tree_util.keystr(p)})"
            for i, (p, _) in enumerate(jax.tree_util.tree_flatten_with_path(tree)[0])])
  dims = []
  for x, name in zip(leaves, names):
    _check_input(where, name, x)
    dims.append(_check_dim(where, name, x, scatter_dimension, n, "scatter_dimension"))
  if scales is None:
    scale_vec, amax = current_scales(leaves, axis_name, dtype, margin)
  else:
    if jnp.shape(scales) not in ((), (len(leaves),)):
      raise ValueError(f"{where}: scales has shape {jnp.shape(scales)}; use a scalar or one "
                       f"scale per leaf, shape ({len(leaves)},)")
    scale_vec = jnp.broadcast_to(jnp.asarray(scales, jnp.float32), (len(leaves),))
    amax = None
  packed = [_to_chunks(quantize_with_scale(x, scale_vec[i], dtype), dims[i], n)
            for i, x in enumerate(leaves)]
  buf = packed[0] if len(packed) == 1 else jnp.concatenate(packed, axis=1)
  recv = _all_to_all_fp8(buf, axis_name, chunks)
  # recv row j: this rank's chunk of every leaf, as sent by rank j
  out, offset = [], 0
  for i, (x, c) in enumerate(zip(leaves, packed)):
    piece = recv[:, offset:offset + c.shape[1]]
    offset += c.shape[1]
    total = piece[0].astype(jnp.float32)
    for j in range(1, n):  # a fixed order of f32 adds: one fused elementwise pass
      total = total + piece[j].astype(jnp.float32)
    out.append(_from_chunk((total * scale_vec[i]).astype(out_dtype), x.shape, dims[i], n))
  result = jax.tree.unflatten(treedef, out)
  if not with_stats:
    return result
  return result, _stats(leaves, scale_vec, amax, axis_name, dtype, n)


def _stats(leaves, scale_vec, amax, axis_name, dtype, n) -> CommStats:
  axes = _axis_tuple(axis_name)
  sat = jnp.stack([_local_saturated(x, scale_vec[i], dtype) for i, x in enumerate(leaves)])
  sat = lax.psum(sat, axes) / n  # every rank holds the same number of elements per leaf
  if amax is None:
    amax = lax.pmax(jnp.stack([local_amax(x) for x in leaves]), axes)
  return CommStats(amax, sat)


def fp8_reduce_scatter(x, axis_name: AxisName, *, scatter_dimension: int = 0,
                       dtype=jnp.float8_e4m3fn, out_dtype=jnp.float32, scale=None,
                       margin: float = 0.0, with_stats: bool = False, chunks: int = 1):
  """``lax.psum_scatter(x, axis_name, scatter_dimension=..., tiled=True)`` with an FP8 wire.

  `x` is cast to `dtype` with one scale shared by all ranks (current scaling: the amax agreed
  with one ``lax.pmax``; delayed: `scale`, f32[], equal on all ranks), sent through one
  ``lax.all_to_all``; the n received FP8 pieces are added in f32 and multiplied by the scale
  once. Result: f32 (`out_dtype`) of x's shape with `scatter_dimension` divided by the axis
  size. With `with_stats` also a :class:`CommStats` of f32[] values. See
  :func:`fp8_reduce_scatter_tree` for the arguments.
  """
  res = fp8_reduce_scatter_tree([x], axis_name, scatter_dimension=scatter_dimension,
                                dtype=dtype, out_dtype=out_dtype, scales=scale, margin=margin,
                                with_stats=with_stats, chunks=chunks)
  if not with_stats:
    return res[0]
  out, stats = res
  return out[0], CommStats(stats.amax[0], stats.saturated[0])


# ----------------------------------------------------------------------------- all-gather

def fp8_all_gather(x, axis_name: AxisName, *, axis: int = 0, dtype=jnp.float8_e4m3fn,
                   out_dtype=jnp.float32, scale=None, margin: float = 0.0,
                   return_scaled: bool = False):
  """``lax.all_gather(x, axis_name, axis=axis, tiled=True)`` with an FP8 wire.

  This rank's shard is cast to `dtype` with one scale shared by all ranks (its amax agreed with
  one ``lax.pmax``, or `scale` if given), the FP8 payload is all-gathered and dequantized.
  With `return_scaled` the result is a :class:`fp8jax.optim.scaled.ScaledArray`
  ``(data: FP8 gathered payload, scale: f32[])``, ready for an FP8 GEMM
  (``f32(data) * scale ~= gathered x``); otherwise the dequantized `out_dtype` array.
  """
  where = "fp8_all_gather"
  dtype, out_dtype = _check_fp8(where, dtype), _check_out_dtype(where, out_dtype)
  _check_input(where, "x", x)
  axis = _check_dim(where, "x", x, axis, 1, "axis")
  if scale is None:
    scale = current_scales([x], axis_name, dtype, margin)[0][0]
  scale = jnp.asarray(scale, jnp.float32)
  data = _as_fp8(lax.all_gather(_as_bytes(quantize_with_scale(x, scale, dtype)), axis_name,
                                axis=axis, tiled=True), dtype)
  if return_scaled:
    return ScaledArray(data, scale)
  return (data.astype(jnp.float32) * scale).astype(out_dtype)


# ----------------------------------------------------------------------------- automatic scaling

def init_comm_scaling(num_tensors: int | None = None) -> CommScaling:
  """A state that has observed nothing: shape [] (`num_tensors` None) or [num_tensors]."""
  shape = () if num_tensors is None else (int(num_tensors),)
  return CommScaling(jnp.zeros(shape, jnp.float32), jnp.ones(shape, jnp.float32),
                     jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32))


def comm_scales(state: CommScaling, dtype=jnp.float8_e4m3fn, margin: float = 0.0) -> jax.Array:
  """Delayed-mode scales: the previous amax divided by the pre-scale, mapped to
  ``fp8_max / 2**margin`` (0 where nothing was observed yet)."""
  dtype = _check_fp8("comm_scales", dtype)
  return scale_from_bound(state.amax / state.pre_scale, payload_max(dtype, margin))


def update_comm_scaling(state: CommScaling, stats: CommStats, *,
                        threshold: float = SATURATION_THRESHOLD, growth_interval: int = GROWTH_INTERVAL,
                        growth_factor: float = 2.0, backoff_factor: float = 0.5,
                        max_pre_scale: float = 1.0, min_pre_scale: float = 2.0 ** -24
                        ) -> CommScaling:
  """FP8-LM's rule: halve the pre-scale (`backoff_factor`) where more than `threshold` of the
  values saturated; after `growth_interval` consecutive clean steps multiply it by
  `growth_factor`, capped at `max_pre_scale`. Records the agreed amax for the next step's
  scale; a non-finite amax keeps the previous one and counts as not clean."""
  if not 0 < backoff_factor < 1 or growth_factor < 1 or growth_interval < 1:
    raise ValueError(f"update_comm_scaling: backoff_factor={backoff_factor} must be in (0, 1), "
                     f"growth_factor={growth_factor} >= 1, growth_interval={growth_interval} >= 1")
  if not 0 <= threshold < 1:
    raise ValueError(f"update_comm_scaling: threshold={threshold} must be in [0, 1)")
  finite = jnp.isfinite(stats.amax)
  over = stats.saturated > threshold
  clean = finite & ~over
  steps = jnp.where(clean, state.clean_steps + 1, 0)
  grow = steps >= growth_interval
  pre = jnp.where(over, jnp.maximum(state.pre_scale * backoff_factor, min_pre_scale),
                  jnp.where(grow, jnp.minimum(state.pre_scale * growth_factor, max_pre_scale),
                            state.pre_scale))
  amax = jnp.where(finite & (stats.amax > 0), stats.amax, state.amax)
  return CommScaling(amax.astype(jnp.float32), pre.astype(jnp.float32),
                     jnp.where(grow, 0, steps).astype(jnp.int32),
                     stats.saturated.astype(jnp.float32))


def fp8_reduce_scatter_auto(tree, axis_name: AxisName, state: CommScaling, *,
                            scatter_dimension: int = 0, dtype=jnp.float8_e4m3fn,
                            out_dtype=jnp.float32, margin: float = 0.0, chunks: int = 1,
                            **update_kwargs):
  """Delayed-mode FP8 reduce-scatter of a tree with automatic scaling.

  Casts with :func:`comm_scales` of `state` (current scaling instead while any leaf has not
  been observed, i.e. at the first step), then updates the state from what was sent.
  `state` has shape [L] for a tree of L leaves ([] for a single array). `update_kwargs` go to
  :func:`update_comm_scaling`.

  Returns:
    (reduced tree as :func:`fp8_reduce_scatter_tree`, new :class:`CommScaling`); the new
    state's ``saturated`` is this step's saturated fraction.
  """
  leaves = jax.tree.leaves(tree)
  n_leaves = len(leaves)
  if jnp.shape(state.amax) != (n_leaves,) and not (n_leaves == 1 and jnp.ndim(state.amax) == 0):
    raise ValueError(f"fp8_reduce_scatter_auto: state has shape {jnp.shape(state.amax)} but the "
                     f"tree has {n_leaves} leaves; use init_comm_scaling({n_leaves})")
  vec = jax.tree.map(lambda a: jnp.reshape(a, (n_leaves,)), state)
  dt = _check_fp8("fp8_reduce_scatter_auto", dtype)
  scales = lax.cond(jnp.all(vec.amax > 0),
                    lambda: comm_scales(vec, dt, margin),
                    lambda: current_scales(leaves, axis_name, dt, margin)[0])
  out, stats = fp8_reduce_scatter_tree(tree, axis_name, scatter_dimension=scatter_dimension,
                                       dtype=dt, out_dtype=out_dtype, scales=scales,
                                       margin=margin, with_stats=True, chunks=chunks)
  new = update_comm_scaling(vec, stats, **update_kwargs)
  new = jax.tree.map(lambda a, old: jnp.reshape(a, jnp.shape(old)), new, state)
  return out, new
