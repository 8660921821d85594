"""Summing parameter gradients over data-parallel groups inside ``jax.shard_map``.

* ``"native"``: one f32 ``psum``; every group gets the full sum.
* ``"fp8"``: every gradient with at least 2 dimensions and one divisible by the group count
  goes through ONE :func:`fp8jax.parallel.collectives.fp8_reduce_scatter_tree` (E4M3, one
  scale per tensor shared by all groups), scattered along the dimension ZeRO shards
  (:func:`fp8_scatter_dim`), so the result is already in the ZeRO layout
  (:func:`grad_specs`). Each group's sum is rounded to FP8 once and the received pieces are
  summed in f32: the error is one E4M3 rounding of each group's sum (relative <= 2**-4 of
  sum_i |g_i| elementwise) whatever the group count. Other leaves (norm scales, biases) take
  an f32 ``psum``.

Scales of the FP8 wire (`comm_scaling`): ``"current"`` agrees this step's amax with one
``pmax`` of f32[L] (no state); ``"auto"`` is FP8-LM's automatic scaling
(:func:`fp8jax.parallel.collectives.fp8_reduce_scatter_auto`) from a
:class:`~fp8jax.parallel.collectives.CommScaling` with one entry per parameter leaf
(``jax.tree.leaves`` order; leaves that take the f32 ``psum`` keep their initial entry).
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8jax.parallel.collectives import (GROWTH_INTERVAL, CommScaling, fp8_reduce_scatter,
                                         fp8_reduce_scatter_auto, fp8_reduce_scatter_tree,
                                         init_comm_scaling)

GRAD_COMM = ("native", "fp8")
COMM_SCALING = ("current", "auto")


def check_options(grad_comm: str, comm_scaling: str, growth_interval: int) -> None:
  """Raises ValueError naming a bad value and what is allowed."""
  if grad_comm not in GRAD_COMM:
    raise ValueError(f"grad_comm={grad_comm!r} is not allowed; use one of {list(GRAD_COMM)}")
  if comm_scaling not in COMM_SCALING:
    raise ValueError(f"comm_scaling={comm_scaling!r} is not allowed; use one of "
                     f"{list(COMM_SCALING)}")
  if comm_scaling == "auto" and grad_comm != "fp8":
    raise ValueError(f"comm_scaling='auto' needs grad_comm='fp8', got grad_comm={grad_comm!r}")
  if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or \
      growth_interval < 1:
    raise ValueError(f"growth_interval={growth_interval!r} is not allowed; use an int >= 1")


def fp8_scatter_dim(shape: Sequence[int], n: int) -> int | None:
  """The dimension a gradient of `shape` is FP8-reduce-scattered along over `n` groups (ZeRO's
  choice: the largest divisible one, the first on ties), or None for an f32 ``psum`` (fewer
  than 2 dimensions, or none divisible by `n`)."""
  dims = [i for i, d in enumerate(shape) if d > 0 and d % n == 0]
  if len(shape) < 2 or n < 2 or not dims:
    return None
  return max(dims, key=lambda i: (shape[i], -i))


def grad_specs(params, axes: tuple[str, ...], n: int):
  """PartitionSpecs of FP8-reduced gradients of `params` (arrays or shapes) over `n` groups
  along `axes`: the scattered dimension over `axes`, P() for ``psum`` leaves."""
  def one(x):
    dim = fp8_scatter_dim(np.shape(x), n)
    if dim is None:
      return P()
    spec = [None] * np.ndim(x)
    spec[dim] = axes
    return P(*spec)
  return jax.tree.map(one, params)


def init_grad_comm_scaling(params) -> CommScaling:
  """The automatic-scaling state for parameters `params` (arrays or shapes): one
  observed-nothing entry per leaf."""
  return init_comm_scaling(len(jax.tree.leaves(params)))


def fp8_leaves(params, n: int) -> list[int]:
  """Indices (``jax.tree.leaves`` order) of the leaves that go through FP8 over `n` groups."""
  return [i for i, x in enumerate(jax.tree.leaves(params))
          if fp8_scatter_dim(np.shape(x), n) is not None]


def fp8_sum_into(g, axes: tuple[str, ...], dim: int):
  """One gradient `g` (f32, this group's) summed over the groups along `axes`, this group's
  chunk along `dim`, through an FP8 (E4M3) reduce-scatter with current scaling: the
  ``reduce`` of an ``fp8jax.fsdp.Local`` layout (ZeRO-3 reduces each gradient where the
  backward makes it)."""
  return fp8_reduce_scatter(g, axes, scatter_dimension=dim)


def reduce_over_groups(params, axes: tuple[str, ...], grad_comm: str = "native",
                       comm: CommScaling | None = None, growth_interval: int = GROWTH_INTERVAL):
  """Sums of the per-group gradients `params` over the groups along `axes` (call inside
  ``shard_map``). Returns (reduced tree, new `comm`): full sums for ``"native"``; for ``"fp8"``
  each FP8 leaf's chunk of its :func:`grad_specs` layout, with current scales when `comm` is
  None, else automatic scaling from `comm`."""
  if grad_comm == "native":
    return lax.psum(params, axes), comm
  leaves, treedef = jax.tree.flatten(params)
  n = int(np.prod([lax.axis_size(a) for a in axes]))
  dims = [fp8_scatter_dim(x.shape, n) for x in leaves]
  fp8_idx = [i for i, d in enumerate(dims) if d is not None]
  out = list(leaves)
  if fp8_idx:  # one all_to_all (and one pmax of f32[L]) for all of them
    moved = [jnp.moveaxis(leaves[i].astype(jnp.float32), dims[i], 0) for i in fp8_idx]
    if comm is None:
      chunks = fp8_reduce_scatter_tree(moved, axes, scatter_dimension=0)
    else:
      idx = np.asarray(fp8_idx)
      chunks, sub = fp8_reduce_scatter_auto(moved, axes, jax.tree.map(lambda a: a[idx], comm),
                                            growth_interval=growth_interval)
      comm = jax.tree.map(lambda a, b: a.at[idx].set(b), comm, sub)
    for i, c in zip(fp8_idx, chunks):
      out[i] = jnp.moveaxis(c, 0, dims[i]).astype(leaves[i].dtype)
  rest = [i for i, d in enumerate(dims) if d is None]
  if rest:
    summed = lax.psum([leaves[i] for i in rest], axes)
    for i, x in zip(rest, summed):
      out[i] = x
  return jax.tree.unflatten(treedef, out), comm
