"""FP16 master weights with a per-tensor scale (MS-AMP O2) that keep small updates.

The model computes from the master weights (:func:`master_params` dequantizes them inside the
jitted step; no second copy persists). :func:`apply_master_updates` adds the optimizer's
update in f32 and re-quantizes, in one elementwise pass, with

* a power-of-two scale per tensor chosen *before* the pass from the tensor's amax after the
  previous update (kept in the state, a side output of that pass) with ``GROWTH`` (16x)
  headroom: the amax maps into (fmax/32, fmax/16]. FP16's precision is the same in every
  normal binade, so the headroom costs no precision (the normal range still spans 7.8
  decades below the amax); it only means a tensor whose largest weight grows more than 16x
  in one step is clipped there (a diverging run). Rescaling a stored tensor by a power of
  two is exact, so weights whose update is 0 never change. An all-zero tensor is written
  with scale ``ZERO_TENSOR_SCALE`` (range +-64) until it has an amax;
* stochastic rounding (default) from a counter-based hash of (step, tensor, element): the
  expected stored value equals the f32 sum, so an update of 1e-4 of a weight, a fifth of an
  FP16 ulp, accumulates over steps instead of being rounded away every step. It costs no
  memory: 2 bytes per parameter plus 8 per tensor. ``rounding="nearest"`` is MS-AMP's
  behaviour and loses every update below half an ulp.

A step with non-finite updates leaves every master weight unchanged. The check is a pass
over the updates; a caller that already knows (e.g. from the gradients' global norm, when the
optimizer zeroes the updates of a non-finite step as ``fp8jax.optim.adamw`` does) passes
``finite=`` and the update stays a single pass over parameters, gradients and state.

Training step with O2 state (FP16 master 2 + E4M3 mu 1 + FP16 nu 2 + FP8 gradient 1 = 6 bytes
per parameter)::

  params = fp8jax.optim.master_params(master)             # what the model computes from
  grads = jax.grad(loss_fn)(params, batch)
  grads = fp8jax.optim.quantize_updates(grads)           # FP8 + scale (gradient comm)
  updates, opt_state = tx.update(grads, opt_state, params)
  master = fp8jax.optim.apply_master_updates(master, updates)
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from fp8jax.gemm_weights import is_gemm_weight
from fp8jax.kernels.rounding import hash32
from fp8jax.optim.finite import all_finite
from fp8jax.optim.rounding import stochastic_round
from fp8jax.optim.scaled import (ScaledArray, amaxes, check_float_dtype, check_real,
                                 dequantize_scaled, is_scaled, payload_max, quantize_with_scale,
                                 scale_from_bound)

ROUNDINGS = ("stochastic", "nearest")
GROWTH = 16.0  # headroom of the write scale over the amax after the previous update
ZERO_TENSOR_SCALE = 2.0 ** -10  # write scale of a tensor that is all zeros so far


class MasterWeights(NamedTuple):
  """Master copy of the params.

  Attributes:
    params: tree like the params; floating leaves are ScaledArray (FP16 payload, f32[]
      power-of-two scale), other leaves are kept as they are.
    count: i32[] updates applied (seeds the stochastic rounding).
    amax: f32[L]: largest |weight| of each of the L floating leaves (tree order) after the
      last update; the next write scale is chosen from it. None: computed from the payloads.
    clipped: i32[] updates in which some tensor grew past its 16x headroom and was clipped
      at it (a diverging run; the next update's scale follows the new amax). None: 0.
  """

  params: Any
  count: jax.Array
  amax: Any = None
  clipped: Any = None


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def write_scales(amax: jax.Array, dtype) -> jax.Array:
  """f32[L] power-of-two scales mapping ``GROWTH * amax`` to FP16's largest value
  (``ZERO_TENSOR_SCALE`` where amax is 0)."""
  scale = scale_from_bound(amax * GROWTH, payload_max(dtype), power_of_two=True)
  return jnp.where(amax > 0, scale, ZERO_TENSOR_SCALE).astype(jnp.float32)


def init_master(params, dtype=jnp.float16, *, axis_names: Sequence[str] = ()) -> MasterWeights:
  """Master weights of `params` in `dtype` (FP16) with power-of-two per-tensor scales.

  Non-float leaves (integers, ...) are kept as they are and never updated; complex leaves
  are refused (ValueError naming the leaf): keep them out of the master tree.
  """
  dtype = check_float_dtype("init_master", "dtype", dtype)
  check_real("fp8jax.optim.init_master", "parameter", params)
  leaves, treedef = jax.tree.flatten(params)
  idx = [i for i, p in enumerate(leaves) if _is_float(p)]
  amax = amaxes([leaves[i] for i in idx], axis_names)
  scales = write_scales(amax, dtype)
  for k, i in enumerate(idx):
    leaves[i] = ScaledArray(quantize_with_scale(leaves[i], scales[k], dtype), scales[k])
  return MasterWeights(jax.tree.unflatten(treedef, leaves), jnp.zeros((), jnp.int32), amax,
                       jnp.zeros((), jnp.int32))


def master_params(master: MasterWeights, dtype=jnp.float32, *, matrix_dtype=None):
  """The params the model computes from: master weights dequantized to `dtype`, and the GEMM
  weights (leaves named ``kernel`` or ``embedding``, :mod:`fp8jax.gemm_weights`) to `matrix_dtype`
  when given (e.g. BF16 for a model that computes its GEMMs in BF16: the same values reach
  them, and the copy and its gradient take half the bytes)."""
  def decode(path, x):
    if not is_scaled(x):
      return x
    narrow = matrix_dtype is not None and is_gemm_weight(path)
    return dequantize_scaled(x, matrix_dtype if narrow else dtype)
  return jax.tree_util.tree_map_with_path(decode, master.params, is_leaf=is_scaled)


def apply_master_updates(master: MasterWeights, updates, *, rounding: str = "stochastic",
                         axis_names: Sequence[str] = (), finite=None) -> MasterWeights:
  """Master weights plus `updates` (a tree like the params), applied in f32 and re-quantized.

  Args:
    master: current master weights.
    updates: optimizer updates (plain arrays or ScaledArray), added as they are.
    rounding: "stochastic" (unbiased; small updates accumulate) or "nearest" (MS-AMP).
    axis_names: mesh axes to agree scales over inside ``shard_map``.
    finite: optional bool[] known to be True iff every update is finite (skips the check's
      pass over the updates); None checks them.
  """
  if rounding not in ROUNDINGS:
    raise ValueError(f"apply_master_updates: rounding={rounding!r} is not allowed; "
                     f"use one of {list(ROUNDINGS)}")
  leaves, treedef = jax.tree.flatten(master.params, is_leaf=is_scaled)
  ups = treedef.flatten_up_to(updates)
  ok = all_finite(ups, axis_names) if finite is None else jnp.asarray(finite, jnp.bool_)
  seed = hash32(master.count.astype(jnp.uint32))
  idx = [i for i, p in enumerate(leaves) if is_scaled(p)]
  old_amax = master.amax if master.amax is not None else \
      amaxes([leaves[i] for i in idx], axis_names)
  new, xs, limits = list(leaves), [], []
  for k, i in enumerate(idx):
    old = leaves[i]
    scale = write_scales(old_amax[k], old.data.dtype)
    limits.append(scale * payload_max(old.data.dtype))
    x = dequantize_scaled(old) + dequantize_scaled(ups[i])
    rnd = None if rounding == "nearest" else \
        functools.partial(stochastic_round, seed=seed + jnp.uint32(k))
    data = quantize_with_scale(x, scale, old.data.dtype, rounding=rnd)
    new[i] = ScaledArray(jnp.where(ok, data, old.data), jnp.where(ok, scale, old.scale))
    xs.append(x)
  new_amax = amaxes(xs, axis_names) if idx else old_amax
  clipped = ok & jnp.any(new_amax > jnp.stack(limits)) if idx else jnp.bool_(False)
  previous = jnp.zeros((), jnp.int32) if master.clipped is None else master.clipped
  return MasterWeights(jax.tree.unflatten(treedef, new),
                       master.count + jnp.where(ok, 1, 0).astype(jnp.int32),
                       jnp.where(ok, new_amax, old_amax),
                       previous + clipped.astype(jnp.int32))
