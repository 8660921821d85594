"""The balanced train step: each data-parallel group runs its own number of microbatches.

On a mesh of unequal devices (A100 + H100), shards must keep equal shapes, so every group
(device along the mesh's data axes) runs microbatches of the same size m, and a faster group
runs more of them (counts from :mod:`fp8jax.parallel.balance`). Layout:

  batch  int32[G, n, m, T+1], sharded over the groups; group i uses its first counts[i]
         microbatches (the rest is padding, never read)
  counts int32[G], the same sharding; sum(counts) * m = the step's sequences

Inside ``shard_map`` each group loops over its own count with no collective in the loop
(groups finish at different times and never wait for each other mid-step), summing the
microbatches' mean-loss gradients; then one reduction adds the sums and the counts. Each
microbatch holds the same m x T tokens, so sum / count weights every microbatch by its tokens:
exactly the full-batch mean-loss gradient whatever the counts. FP8
state combines by max over microbatches and then over groups (a group with no microbatch
contributes nothing). The optimizer update follows as in :func:`fp8jax.train.step.make_train_step`.

Parameters enter the loop replicated (under ZeRO-2/3 XLA gathers them once per step at the
``shard_map`` boundary; stage 3 then holds full weights for the step, like stage 2).

Gradient communication (`grad_comm`): "native" adds the groups' sums with one f32 ``psum``.
"fp8" sends them in FP8 (``parallel.grad_comm=fp8``): every parameter gradient with a
dimension divisible by the number of groups and at least 2 dimensions goes through ONE
:func:`fp8jax.parallel.collectives.fp8_reduce_scatter_tree` (E4M3, one scale per tensor shared
by all groups: current scaling, i.e. this step's amax agreed with one ``pmax`` of f32[L]; no
state to carry or checkpoint), scattered along the dimension ZeRO shards
(:func:`fp8jax.parallel.zero.shard_spec`), so the result leaves ``shard_map`` already in the
ZeRO layout. Each group's sum is rounded to FP8 once and the sum of the received pieces is
taken in f32, so the error is one E4M3 rounding per group's sum (relative <= 2**-4 of
sum_i |g_i| elementwise) whatever the group count. Where a rank needs the full sum (stage 0,
and the replicated parameter update of stage 1) XLA all-gathers the reduced f32 chunks: a
second FP8 rounding there would double the error for a quarter of the gather bytes. Leaves
with fewer than 2 dimensions (norm scales, biases) or no divisible dimension are added with
an f32 ``psum`` (a negligible share of the bytes).

`comm_scaling="auto"` (``parallel.grad_comm_scaling=auto``) casts with delayed scales instead:
FP8-LM's automatic scaling (:func:`fp8jax.parallel.collectives.fp8_reduce_scatter_auto`), the
previous step's agreed amax divided by a pre-scale that halves when more than 0.001% of a
tensor's values saturate and doubles after `growth_interval` clean steps. Its
:class:`~fp8jax.parallel.collectives.CommScaling` (one entry per parameter leaf, in
``jax.tree.leaves`` order; leaves that take the f32 ``psum`` keep their initial entry) is
``state.comm``, replicated, updated by the step like the FP8 GEMM state (a skipped non-finite
step leaves it as it was).
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax.accumulate import accumulate_gradients, accumulator_zeros
from fp8jax.parallel.collectives import (CommScaling, fp8_reduce_scatter_auto,
                                         fp8_reduce_scatter_tree, init_comm_scaling)
from fp8jax.scaling import combine_max
from fp8jax.train.state import TrainState
from fp8jax.train.step import apply_gradients, cross_entropy


def group_axes(mesh: Mesh, axes: Sequence[str] = ("data", "fsdp")) -> tuple[str, ...]:
  """The mesh axes that split the batch (those of `axes` present in `mesh`)."""
  out = tuple(a for a in axes if a in mesh.shape)
  if not out:
    raise ValueError(f"mesh axes {tuple(mesh.shape)} contain none of {tuple(axes)}")
  return out


def group_count(mesh: Mesh, axes: Sequence[str] = ("data", "fsdp")) -> int:
  """Number of data-parallel groups G."""
  return int(np.prod([mesh.shape[a] for a in group_axes(mesh, axes)]))


def group_devices(mesh: Mesh, axes: Sequence[str] = ("data", "fsdp")) -> list:
  """The first device of each group, in group order (for its kind)."""
  names = list(mesh.axis_names)
  keep = group_axes(mesh, axes)
  devices = np.moveaxis(mesh.devices, [names.index(a) for a in keep],
                        list(range(len(keep))))
  return list(devices.reshape(group_count(mesh, axes), -1)[:, 0])


def layout_batch(batch: np.ndarray, counts: Sequence[int], microbatch_size: int) -> np.ndarray:
  """int32[B, T+1] -> int32[G, max(counts), m, T+1]: group i gets the next counts[i]
  microbatches of m sequences, in order; unused slots are zeros."""
  counts = [int(c) for c in counts]
  if any(c < 0 for c in counts) or sum(counts) < 1:
    raise ValueError(f"counts {counts} must be >= 0 with a positive sum")
  if batch.shape[0] != sum(counts) * microbatch_size:
    raise ValueError(f"batch of {batch.shape[0]} sequences != sum(counts)={sum(counts)} x "
                     f"microbatch_size={microbatch_size}")
  out = np.zeros((len(counts), max(counts), microbatch_size, *batch.shape[1:]), batch.dtype)
  start = 0
  for i, c in enumerate(counts):
    n = c * microbatch_size
    out[i, :c] = batch[start:start + n].reshape(c, microbatch_size, *batch.shape[1:])
    start += n
  return out


def layout_split(batch: np.ndarray, microbatches: int, groups: int) -> np.ndarray:
  """int32[B, T+1] -> int32[G, microbatches, B / (microbatches G), T+1]: every group runs all
  `microbatches` microbatches, each on its 1/G of the microbatch's sequences (the split of the
  uniform ZeRO step, ``make_train_step`` under a batch sharded over the groups)."""
  b = batch.shape[0]
  if b % (microbatches * groups):
    raise ValueError(f"batch of {b} sequences does not split into {microbatches} microbatches "
                     f"x {groups} data-parallel groups")
  parts = batch.reshape(microbatches, groups, b // (microbatches * groups), *batch.shape[1:])
  return np.ascontiguousarray(np.swapaxes(parts, 0, 1))


def _mean_loss(apply_fn: Callable, variables, part):
  """Mean next-token loss (f32 nats) of part int32[m, T+1]."""
  return cross_entropy(apply_fn(variables, part[:, :-1]), part[:, 1:])


GRAD_COMM = ("native", "fp8")
COMM_SCALING = ("current", "auto")


def fp8_scatter_dim(shape, n: int) -> int | None:
  """The dimension a parameter gradient of `shape` is FP8-reduce-scattered along over `n`
  groups (ZeRO's choice: the largest divisible one, the first on ties), or None for an f32
  ``psum`` (fewer than 2 dimensions, or none divisible by `n`)."""
  dims = [i for i, d in enumerate(shape) if d > 0 and d % n == 0]
  if len(shape) < 2 or n < 2 or not dims:
    return None
  return max(dims, key=lambda i: (shape[i], -i))


def _grad_specs(params, axes: tuple[str, ...], n: int):
  """out_specs of the reduced parameter gradients (see :func:`fp8_scatter_dim`)."""
  def one(x):
    dim = fp8_scatter_dim(np.shape(x), n)
    if dim is None:
      return P()
    spec = [None] * np.ndim(x)
    spec[dim] = axes
    return P(*spec)
  return jax.tree.map(one, params)


def init_grad_comm_scaling(params) -> CommScaling:
  """The ``state.comm`` of ``comm_scaling="auto"`` for model parameters `params` (arrays or
  shapes): one observed-nothing entry per leaf."""
  return init_comm_scaling(len(jax.tree.leaves(params)))


def _fp8_leaves(params, n: int) -> list[int]:
  """Indices (``jax.tree.leaves`` order) of the leaves that go through FP8 over `n` groups."""
  return [i for i, x in enumerate(jax.tree.leaves(params))
          if fp8_scatter_dim(np.shape(x), n) is not None]


def _fp8_reduce(params, axes: tuple[str, ...], comm: CommScaling | None = None,
                growth_interval: int = 1000):
  """Sums over the groups of the parameter gradients `params` (f32 local sums): FP8
  reduce-scatter to this group's chunk where :func:`fp8_scatter_dim` allows, f32 psum else.
  Current scaling when `comm` is None, else automatic scaling from `comm` (one entry per leaf).
  Returns (reduced tree, new comm)."""
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


def _local_grads(apply_fn: Callable, axes: tuple[str, ...], grad_comm: str,
                 growth_interval: int, variables, batch, counts, repeats, comm):
  """One group's loop over its microbatches, then the one cross-group reduction."""
  batch, count, repeat = batch[0], counts[0], repeats[0]
  grad_fn = jax.value_and_grad(functools.partial(_mean_loss, apply_fn))

  def extra_work(part, carry):
    """`repeat` more forward+backward passes whose results are added times zero (a slowdown
    hook for tests and benchmarks; the loop carry keeps XLA from hoisting them)."""
    def again(_, c):
      shift, acc = c
      moved = jax.tree.map(lambda v: v + shift.astype(v.dtype), variables)
      loss, g = grad_fn(moved, part)
      return 0.0 * loss, jax.tree.map(lambda a, b: a + 0.0 * b.astype(a.dtype), acc, g)
    return lax.fori_loop(0, repeat, again, (jnp.zeros((), jnp.float32), carry))[1]

  def one(i, carry):
    loss_sum, acc = carry
    part = lax.dynamic_index_in_dim(batch, i, keepdims=False)
    loss, g = grad_fn(variables, part)
    acc = accumulate_gradients(acc, g)
    acc = extra_work(part, acc)
    return loss_sum + loss, acc

  # Sums in f32 at least (ZeRO-3's gathered FP8 kernels arrive as bf16, so do their grads).
  loss_sum, acc = lax.fori_loop(0, count, one,
                                (jnp.zeros((), jnp.float32), accumulator_zeros(variables)))
  # Every microbatch holds m x T target tokens, so weighting each microbatch's mean-loss
  # gradient by its tokens is dividing the sum by the step's microbatch count.
  total, loss_sum = lax.psum((count.astype(jnp.float32), loss_sum), axes)
  if grad_comm == "fp8":
    params, comm = _fp8_reduce(acc["params"], axes, comm if comm else None, growth_interval)
  else:
    params = lax.psum(acc["params"], axes)
  params = jax.tree.map(lambda g: g / total.astype(g.dtype), params)
  grads = {**acc, "params": params}
  rest = {k: v for k, v in acc.items() if k != "params"}
  if rest:  # FP8 state: max over microbatches (in the loop), then over groups
    stacked = lax.all_gather(rest, axes)
    groups = jax.tree.leaves(stacked)[0].shape[0]
    merged = functools.reduce(combine_max, [jax.tree.map(lambda x: x[j], stacked)
                                            for j in range(groups)])
    grads = {**merged, "params": params}
  return grads, loss_sum / total, comm


def make_balanced_train_step(apply_fn: Callable, tx: optax.GradientTransformation, mesh: Mesh,
                             axes: Sequence[str] = ("data", "fsdp"), *,
                             grad_comm: str = "native", comm_scaling: str = "current",
                             growth_interval: int = 1000, gather_params: Callable | None = None):
  """A jittable ``step(state, batch, counts, repeats=None) -> (state, metrics)``.

  Args:
    apply_fn: ``apply_fn(variables, tokens[m, T]) -> logits[m, T, V]``.
    tx: the optimizer (with clipping), as for ``make_train_step``.
    mesh: the device mesh; groups are the devices along `axes` (other axes replicate).
    grad_comm: "native" (f32 psum of the groups' gradient sums) or "fp8" (FP8 reduce-scatter
      to the ZeRO layout, module docstring).
    comm_scaling: scales of the FP8 wire: "current" or "auto" (FP8-LM automatic scaling
      from ``state.comm``, see :func:`init_grad_comm_scaling`; needs grad_comm "fp8").
    growth_interval: clean steps before "auto" doubles a pre-scale.
    gather_params: optional ``params -> params`` replicating ZeRO-3-sharded weights before
      they enter ``shard_map`` (``ZeroPlan.gather_fn``: FP8 kernels travel as E4M3 + scale);
      without it XLA gathers them in their own dtype at the boundary.
  The step's arguments: batch int32[G, n, m, T+1] and counts int32[G] (module docstring),
  sharded over the groups; `repeats` int32[G] (optional) adds that many extra forward+backward
  passes per microbatch on each group (a slowdown hook: same program, different data).
  Metrics: loss (mean over the step's tokens), grad_norm (before clipping); with "auto" also
  comm_pre_scale_min (smallest pre-scale after the update) and comm_saturated_max (largest
  saturated fraction of this step) over the FP8 leaves.
  """
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
  auto = comm_scaling == "auto"
  axes = group_axes(mesh, axes)
  spec = P(axes)
  n = group_count(mesh, axes)

  def step(state: TrainState, batch, counts, repeats=None):
    if repeats is None:
      repeats = jnp.zeros_like(counts)
    variables = state.variables()
    if gather_params is not None:  # not differentiated: gradients are taken inside
      variables = {**variables, "params": gather_params(variables["params"])}
    comm = state.comm if auto else ()
    if auto:
      want = jax.tree.leaves(variables["params"])
      if not isinstance(comm, CommScaling) or jnp.shape(comm.amax) != (len(want),):
        raise ValueError(f"comm_scaling='auto' needs state.comm = CommScaling of shape "
                         f"[{len(want)}] (one entry per parameter leaf), got "
                         f"{jax.tree.map(jnp.shape, comm)}; use init_grad_comm_scaling(params)")
    grad_spec = P()
    if grad_comm == "fp8":
      grad_spec = {k: P() for k in variables}
      grad_spec["params"] = _grad_specs(variables["params"], axes, n)
    local = functools.partial(_local_grads, apply_fn, axes, grad_comm, growth_interval)
    grads, loss, comm = jax.shard_map(local, mesh=mesh, in_specs=(P(), spec, spec, spec, P()),
                                      out_specs=(grad_spec, P(), P()), check_vma=False)(
        variables, batch, counts, repeats, comm)
    new, metrics = apply_gradients(state, tx, grads, loss)
    if not auto:
      return new, metrics
    idx = np.asarray(_fp8_leaves(variables["params"], n) or [0])
    metrics = {**metrics, "comm_pre_scale_min": jnp.min(comm.pre_scale[idx]),
               "comm_saturated_max": jnp.max(comm.saturated[idx])}
    return new._replace(comm=comm), metrics

  return step


def batch_sharding(mesh: Mesh, axes: Sequence[str] = ("data", "fsdp")) -> NamedSharding:
  """Sharding of the balanced batch / counts: leading axis over the groups."""
  return NamedSharding(mesh, P(group_axes(mesh, axes)))


def put_global(x: np.ndarray, sharding: NamedSharding) -> jax.Array:
  """A host array that every process holds in full, placed with `sharding`."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
