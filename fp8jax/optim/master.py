"""FP16 master weights with a per-tensor scale (MS-AMP O2) that keep small updates.

The model computes from the master weights (:func:`master_params` dequantizes them inside the
jitted step; no second copy persists). :func:`apply_master_updates` adds the optimizer's
update in f32 and re-quantizes with

* a power-of-two scale per tensor (amax maps into (fmax/2, fmax]): re-scaling a stored tensor
  when its range moves is exact, so weights whose update is 0 never change;
* stochastic rounding (default) from a counter-based hash of (step, tensor, element): the
  expected stored value equals the f32 sum, so an update of 1e-4 of a weight, a fifth of an
  FP16 ulp, accumulates over steps instead of being rounded away every step. It costs no
  memory: 2 bytes per parameter plus 4 per tensor. ``rounding="nearest"`` is MS-AMP's
  behaviour and loses every update below half an ulp.

A step with non-finite updates leaves every master weight unchanged.

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

from fp8jax.optim.finite import all_finite, select_tree
from fp8jax.optim.rounding import hash32, stochastic_round
from fp8jax.optim.scaled import (check_float_dtype, dequantize_scaled, is_scaled,
                                 quantize_leaves)

ROUNDINGS = ("stochastic", "nearest")


class MasterWeights(NamedTuple):
  """Master copy of the params.

  Attributes:
    params: tree like the params; floating leaves are ScaledArray (FP16 payload, f32[]
      power-of-two scale), other leaves are kept as they are.
    count: i32[] updates applied (seeds the stochastic rounding).
  """

  params: Any
  count: jax.Array


def _is_float(x) -> bool:
  return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def init_master(params, dtype=jnp.float16, *, axis_names: Sequence[str] = ()) -> MasterWeights:
  """Master weights of `params` in `dtype` (FP16) with power-of-two per-tensor scales."""
  dtype = check_float_dtype("init_master", "dtype", dtype)
  leaves, treedef = jax.tree.flatten(params)
  idx = [i for i, p in enumerate(leaves) if _is_float(p)]
  qs = quantize_leaves([leaves[i] for i in idx], dtype, power_of_two=True, axis_names=axis_names)
  for i, q in zip(idx, qs):
    leaves[i] = q
  return MasterWeights(jax.tree.unflatten(treedef, leaves), jnp.zeros((), jnp.int32))


def master_params(master: MasterWeights, dtype=jnp.float32):
  """The params the model computes from: master weights dequantized to `dtype`."""
  return jax.tree.map(lambda x: dequantize_scaled(x, dtype) if is_scaled(x) else x,
                      master.params, is_leaf=is_scaled)


def apply_master_updates(master: MasterWeights, updates, *, rounding: str = "stochastic",
                         axis_names: Sequence[str] = ()) -> MasterWeights:
  """Master weights plus `updates` (a tree like the params), applied in f32 and re-quantized.

  Args:
    master: current master weights.
    updates: optimizer updates (plain arrays or ScaledArray), added as they are.
    rounding: "stochastic" (unbiased; small updates accumulate) or "nearest" (MS-AMP).
    axis_names: mesh axes to agree scales over inside ``shard_map``.
  """
  if rounding not in ROUNDINGS:
    raise ValueError(f"apply_master_updates: rounding={rounding!r} is not allowed; "
                     f"use one of {list(ROUNDINGS)}")
  leaves, treedef = jax.tree.flatten(master.params, is_leaf=is_scaled)
  ups = treedef.flatten_up_to(updates)
  ok = all_finite(ups, axis_names)
  seed = hash32(master.count.astype(jnp.uint32))
  idx = [i for i, p in enumerate(leaves) if is_scaled(p)]
  xs = [dequantize_scaled(leaves[i]) + dequantize_scaled(ups[i]) for i in idx]
  rnd = None if rounding == "nearest" else \
      [functools.partial(stochastic_round, seed=seed + jnp.uint32(i)) for i in idx]
  dtypes = list(dict.fromkeys(leaves[i].data.dtype for i in idx))  # a fixed order
  new = list(leaves)
  for dtype in dtypes:  # one batch of scales per payload type (normally just FP16)
    sel = [k for k, i in enumerate(idx) if leaves[i].data.dtype == dtype]
    qs = quantize_leaves([xs[k] for k in sel], dtype, power_of_two=True, axis_names=axis_names,
                         roundings=None if rnd is None else [rnd[k] for k in sel])
    for k, q in zip(sel, qs):
      new[idx[k]] = select_tree(ok, q, leaves[idx[k]])
  return MasterWeights(jax.tree.unflatten(treedef, new),
                       master.count + jnp.where(ok, 1, 0).astype(jnp.int32))
