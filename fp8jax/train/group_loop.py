"""The per-group loop of the train step: each data-parallel group runs its own number of
microbatches (balanced counts, or every microbatch's share with FP8 gradient communication)
inside ``jax.shard_map``, then one reduction over the groups; at ZeRO-3 layer-major
(:mod:`fp8jax.parallel.layer_major`); with pipeline stages each group a pipeline replica
(at ZeRO-3 gathering each layer where it runs: :mod:`fp8jax.parallel.stage_gather`)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from fp8jax import fsdp
from fp8jax.accumulate import accumulate_gradients, accumulator_zeros
from fp8jax.parallel import grad_comm as grad_comm_lib
from fp8jax.parallel import layer_major as layer_major_lib
from fp8jax.parallel import layout
from fp8jax.parallel import pipeline as pipeline_lib
from fp8jax.parallel import stage_gather
from fp8jax.parallel.collectives import GROWTH_INTERVAL, CommScaling
from fp8jax.parallel.mesh import BATCH_AXES, PIPE, pipe_size
from fp8jax.parallel.zero import ZeroPlan
from fp8jax.scaling import combine_max
from fp8jax.train.batching import checked_counts, microbatch_count, pad_to
from fp8jax.train.loss import microbatch_grads
from fp8jax.train.pipeline_loop import stages_of
from fp8jax.train.state import TrainState
from fp8jax.train.update import apply_gradients


@dataclasses.dataclass(frozen=True)
class GroupLoop:
  """The per-group microbatch loop's settings (see :func:`group_microbatches`).

  Attributes:
    mesh: the device mesh; groups are its positions along `axes` (other axes replicate).
    axes: the mesh axes that split the batch.
    grad_comm: "native" (f32 psum of the groups' sums) or "fp8" (FP8 reduce-scatter to the
      ZeRO layout, :mod:`fp8jax.parallel.grad_comm`).
    comm_scaling: "current" or "auto" (FP8-LM automatic scaling from ``state.comm``; needs
      grad_comm "fp8").
    growth_interval: clean steps before "auto" doubles a pre-scale.
    weight_gather: ZeRO-3's ``fp8jax.fsdp.WeightGather`` (``ZeroPlan.weight_gather``: where
      each parameter lives), or None (below ZeRO-3: parameters enter the loop whole);
      :meth:`program` takes the plan's when None.
    parts: with `weight_gather`, the model cut into parts (``model.parts()``,
      :class:`fp8jax.models.layers.DecoderParts`): the parameters then enter as their shards
      and the loop runs layer-major (:mod:`fp8jax.parallel.layer_major`: each layer gathered
      once per step, its gradients reduce-scattered once, whatever each group's count).
      None: the parameters enter whole (XLA gathers them before the loop).
    layer_stacks: top-level parameter keys holding layer stacks (leaves [L, ...]; one split
      along the layer axis enters whole).
    counts: for :func:`build_step`: ``k -> microbatches per group`` (one count >= 0 per
      group, summing to k) for a step of k microbatches, or None: every group runs every
      microbatch, each on its 1/G of the sequences (the uniform split).
    microbatch_size: for :func:`build_step`: sequences per microbatch (needed with `counts`
      or `dynamic`).
    dynamic: for :func:`build_step`: steps of any k up to its `microbatches` (a batch ramp),
      one program for every k.
    schedule: None, or "gpipe" / "1f1b": the groups are pipeline replicas over the mesh's
      "pipe" axis (`parts` needed): each runs its own count of microbatches through the
      stages (:mod:`fp8jax.parallel.pipeline`; slots beyond its count are bubbles), then
      the gradients are summed over the groups (f32, or FP8 with `grad_comm` "fp8"). With
      `weight_gather` the stage's parameters enter as their ZeRO-3 shards and each layer is
      gathered where it runs, in every slot (:mod:`fp8jax.parallel.stage_gather`); below
      ZeRO-3 each replica holds its stage's layers whole.
    stage_layers: with `schedule`: None (layers split evenly over the stages) or the layers
      each stage runs (``fp8jax.parallel.pipeline.split_layers``).
  """

  mesh: Mesh
  axes: tuple[str, ...] = BATCH_AXES
  grad_comm: str = "native"
  comm_scaling: str = "current"
  growth_interval: int = GROWTH_INTERVAL
  weight_gather: fsdp.WeightGather | None = None
  parts: Any = None
  layer_stacks: tuple[str, ...] = ()
  counts: Callable[[int], Sequence[int]] | None = None
  microbatch_size: int | None = None
  dynamic: bool = False
  schedule: str | None = None
  stage_layers: tuple[int, ...] | None = None

  def __post_init__(self):
    grad_comm_lib.check_options(self.grad_comm, self.comm_scaling, self.growth_interval)
    object.__setattr__(self, "axes", layout.group_axes(self.mesh, self.axes))
    if self.schedule is not None:
      pipeline_lib.check_schedule(self.schedule)
      if pipe_size(self.mesh) < 2 or self.parts is None:
        raise ValueError("GroupLoop(schedule=...) needs a mesh with a 'pipe' axis of 2 or more "
                         "stages and the model's parts")
    if self.weight_gather is not None and self.parts is not None and self.auto:
      raise ValueError("comm_scaling='auto' with ZeRO-3's per-layer gradient reduce-scatter "
                       "is not supported (each layer's gradient is reduced inside its "
                       "backward, where no scaling state flows); use comm_scaling 'current'")

  @property
  def layer_major(self) -> bool:
    """Whether the loop runs layer-major (ZeRO-3 shards in, a model cut into parts, no
    pipeline stages)."""
    return self.weight_gather is not None and self.parts is not None and self.schedule is None

  def layout(self, params):
    """(the params' ``shard_map`` in_specs, dims, reduced) for global `params`: dims a tree
    like `params` of the dimension each leaf enters split along (None: whole), reduced a
    tree of bools (True: its gradient comes out of the loop summed over the groups, in its
    home layout); (P(), None, None) unless :attr:`layer_major`."""
    if not self.layer_major:
      return P(), None, None
    wg = self.weight_gather
    home = jax.tree_util.tree_map_with_path(
        lambda path, x: wg.specs(jax.tree_util.keystr(path), np.shape(x))[0], params)
    table, specs = fsdp.local_table(params, home, self.axes, dict(self.mesh.shape),
                                    tuple(self.layer_stacks))
    entries = dict(table)
    dims = jax.tree_util.tree_map_with_path(
        lambda path, _: (lambda e: None if e is None else e[0])(
            entries[jax.tree_util.keystr(path)][1]), params)
    reduced = jax.tree.map(lambda d: d is not None, dims, is_leaf=lambda x: x is None)
    return specs, dims, reduced

  def gathering(self) -> layer_major_lib.Gathering:
    """How the layer-major loop gathers and reduces (:attr:`parts`' recipe and compute
    dtype, the plan's payload dtype, FP8 reduce-scatters under grad_comm "fp8")."""
    return layer_major_lib.Gathering(
        self.axes, recipe=getattr(self.parts, "recipe", None),
        matrix_dtype=getattr(self.parts, "compute_dtype", None),
        payload_dtype=self.weight_gather.payload_dtype,
        reduce=grad_comm_lib.fp8_sum_into if self.grad_comm == "fp8" else None)

  def program(self, apply_fn, tx, plan: ZeroPlan, microbatches: int, fused_update=None):
    """(step, place, batch shardings) for :func:`build_step`: the per-group step on `plan`
    (its ZeRO-3 gather unless :attr:`weight_gather` is given) and the host batch laid out
    per group (``fp8jax.parallel.layout``: int32[G, slots, m, T+1] and the counts)."""
    loop = self if self.weight_gather is not None else \
        dataclasses.replace(self, weight_gather=plan.weight_gather())
    n, m, sharding = loop.groups, self.microbatch_size, plan.batch
    if self.counts is not None:
      split = functools.lru_cache(maxsize=None)(
          lambda k: checked_counts(self.counts(k), k, n))
      arrange = lambda batch, k, c: layout.layout_counts(batch, c, m)
    else:
      if m is not None and m % n:
        raise ValueError(f"parallel.grad_comm='fp8': a microbatch of {m} sequences does not "
                         f"split over the {n} data-parallel ranks; use a microbatch size "
                         f"that is a multiple of {n}")
      split = lambda k: (k,) * n
      arrange = lambda batch, k, c: layout.layout_split(batch, k, n)
    sizes = range(1, microbatches + 1) if self.dynamic else (microbatches,)
    slots = max(max(split(k)) for k in sizes)
    if self.schedule is not None:  # a schedule has a slot per stage at least
      slots = max(slots, pipe_size(self.mesh))

    def place(batch):
      k = microbatch_count(batch, microbatches, m, self.dynamic)
      c = split(k)
      laid = pad_to(arrange(batch, k, c), 1, slots)
      return (layout.put_global(laid, sharding),
              layout.put_global(np.asarray(c, np.int32), sharding))
    step = group_step_fn(loop, microbatch_grads(apply_fn, None, None), tx, fused_update)
    return step, place, (sharding, sharding)

  @property
  def groups(self) -> int:
    return layout.group_count(self.mesh, self.axes)

  @property
  def auto(self) -> bool:
    return self.comm_scaling == "auto"


def _max_over_groups(tree, axes):
  """FP8 state combined by max over the groups (a group that ran nothing adds nothing)."""
  stacked = lax.all_gather(tree, axes)
  groups = jax.tree.leaves(stacked)[0].shape[0]
  return functools.reduce(combine_max, [jax.tree.map(lambda x: x[j], stacked)
                                        for j in range(groups)])


def group_microbatches(grad_fn: Callable, loop: GroupLoop, variables, batch, counts, comm,
                       dims=None, reduced=None):
  """One group's loop over its own microbatches, then the one cross-group reduction (call
  inside ``shard_map`` over `loop.axes`).

  Args:
    grad_fn: ``(variables, part int32[m, T+1]) -> (loss, grads)``.
    batch: int32[1, n, m, T+1], this group's slots; counts: int32[1].
    comm: ``CommScaling`` (grad_comm "fp8", comm_scaling "auto") or None.
    dims, reduced: :meth:`GroupLoop.layout`'s (layer-major: parameters as their shards), or
      None: a ``fori_loop`` over the group's microbatches on whole parameters.
  Returns (mean loss, gradients, new comm).
  """
  batch, count = batch[0], counts[0]
  if dims is None:
    def add_microbatch(i, carry):
      loss_sum, acc = carry
      loss, g = grad_fn(variables, lax.dynamic_index_in_dim(batch, i, keepdims=False))
      return loss_sum + loss, accumulate_gradients(acc, g)

    loss_sum, acc = lax.fori_loop(0, count, add_microbatch, (jnp.zeros((), jnp.float32),
                                                  accumulator_zeros(variables)))
  else:
    parts = loop.parts
    stacked, shared = parts.split(variables)
    split_dims = tuple(d["params"] for d in parts.split({"params": dims}))
    loss_sum, g_stacked, g_shared = layer_major_lib.layer_major_grads(
        stages_of(parts), loop.gathering(), stacked, shared, split_dims, batch, count)
    acc = parts.merge(g_stacked, g_shared)
  total, loss_sum = lax.psum((count.astype(jnp.float32), loss_sum), loop.axes)
  params, comm = _sum_over_groups(acc["params"], reduced, loop, comm)
  params = jax.tree.map(lambda g: g / total.astype(g.dtype), params)
  rest = {k: v for k, v in acc.items() if k != "params"}
  grads = {**(_max_over_groups(rest, loop.axes) if rest else {}), "params": params}
  return loss_sum / total, grads, comm


def _sum_over_groups(grads, reduced, loop: GroupLoop, comm):
  """`grads` summed over the groups (``grad_comm.reduce_over_groups``) except the leaves
  `reduced` marks as summed already."""
  if reduced is None:
    return grad_comm_lib.reduce_over_groups(grads, loop.axes, loop.grad_comm, comm,
                                            loop.growth_interval)
  leaves, treedef = jax.tree.flatten(grads)
  done = treedef.flatten_up_to(reduced)
  rest = [g for g, d in zip(leaves, done) if not d]
  if rest:
    rest, comm = grad_comm_lib.reduce_over_groups(rest, loop.axes, loop.grad_comm, comm,
                                                  loop.growth_interval)
  it = iter(rest)
  return jax.tree.unflatten(treedef, [g if d else next(it) for g, d in zip(leaves, done)]), comm


def _group_specs(groups: GroupLoop, variables):
  """(variables' in_specs, gradients' out_specs, dims, reduced) of the per-group
  ``shard_map`` (:meth:`GroupLoop.layout`; FP8 gradients come out in their reduce-scatter
  layout, the leaves reduced inside the loop in their home layout)."""
  param_spec, dims, reduced = groups.layout(variables["params"])
  grad_spec: Any = P()
  if groups.grad_comm == "fp8" or dims is not None:
    grad_spec = {k: P() for k in variables}
    grad_spec["params"] = (grad_comm_lib.grad_specs(variables["params"], groups.axes,
                                                    groups.groups)
                           if groups.grad_comm == "fp8" else
                           jax.tree.map(lambda _: P(), variables["params"]))
  if dims is not None:
    grad_spec["params"] = jax.tree.map(lambda s, g, d: s if d else g, param_spec,
                                       grad_spec["params"], reduced,
                                       is_leaf=lambda x: isinstance(x, P))
  var_spec = {k: (param_spec if k == "params" else P()) for k in variables}
  return var_spec, grad_spec, dims, reduced


def _replica_specs(groups: GroupLoop, stacked, shared):
  """(stacked in_specs, shared in_specs, stacked gradient out_specs, shared gradient
  out_specs, dims) of the pipeline replicas' ``shard_map``: stacked leaves split over "pipe"
  along the layer axis; FP8 gradients (grad_comm "fp8") come out as :func:`fp8jax.parallel.
  grad_comm.reduce_over_groups` leaves them, chunked over the groups along a dimension of
  the stage's local shape. With ZeRO-3 (``groups.weight_gather``) parameters split over the
  groups' axes enter and leave as their shards (their home layout) and dims is (stacked
  dims, shared dims): trees like the two parameter trees of the dimension each leaf is split
  along over the groups' axes (None: whole); else dims is None."""
  n, stages = groups.groups, pipe_size(groups.mesh)

  def grad_spec(path, x, stacked_leaf: bool):
    shape = tuple(np.shape(x))
    local = (shape[0] // stages, *shape[1:]) if stacked_leaf else shape
    entries: list = [PIPE if stacked_leaf else None] + [None] * (len(shape) - 1)
    dim = None
    if groups.grad_comm == "fp8" and getattr(path[0], "key", None) == "params":
      dim = grad_comm_lib.fp8_scatter_dim(local, n)
    if dim is not None:
      entries[dim] = (PIPE, *groups.axes) if (stacked_leaf and dim == 0) else groups.axes
    return P(*entries) if shape else P()

  g_stacked = jax.tree_util.tree_map_with_path(lambda p, x: grad_spec(p, x, True), stacked)
  g_shared = jax.tree_util.tree_map_with_path(lambda p, x: grad_spec(p, x, False), shared)
  if groups.weight_gather is None:
    return P(PIPE), P(), g_stacked, g_shared, None
  home, dims = _replica_homes(groups, stacked, shared)
  st_home, sh_home = groups.parts.split({"params": home})
  st_dims, sh_dims = (d["params"] for d in groups.parts.split({"params": dims}))

  def with_params(specs, params_specs, whole):
    return {c: (params_specs["params"] if c == "params" else whole) for c in specs}

  def grads(specs, params_home, params_dims):
    out = dict(specs)
    out["params"] = jax.tree.map(lambda h, g, d: g if d is None else h, params_home["params"],
                                 specs["params"], params_dims,
                                 is_leaf=lambda x: isinstance(x, P) or x is None)
    return out
  return (with_params(stacked, st_home, P(PIPE)), with_params(shared, sh_home, P()),
          grads(g_stacked, st_home, st_dims), grads(g_shared, sh_home, sh_dims),
          (st_dims, sh_dims))


def _replica_homes(groups: GroupLoop, stacked, shared):
  """(home specs, dims) of the parameters of merged (`stacked`, `shared`): each leaf's ZeRO-3
  home PartitionSpec (``groups.weight_gather``; stacked leaves over "pipe" too) and the
  dimension it splits over the groups' axes, or None (its spec is then "pipe" at most)."""
  params = groups.parts.merge(stacked, shared)["params"]
  wg, axes = groups.weight_gather, set(groups.axes)

  def one(path, x):
    spec = wg.specs(jax.tree_util.keystr(path), tuple(np.shape(x)))[0]
    entries = tuple(spec)
    split = [i for i, e in enumerate(entries) if e is not None and e != PIPE
             and set(e if isinstance(e, tuple) else (e,)) <= axes]
    return spec, (split[0] if split else None)
  both = jax.tree_util.tree_map_with_path(one, params)
  is_pair = lambda x: isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], P)
  home = jax.tree.map(lambda t: t[0] if t[1] is not None else _pipe_only(t[0]), both,
                      is_leaf=is_pair)
  dims = jax.tree.map(lambda t: t[1], both, is_leaf=is_pair)
  return home, dims


def _pipe_only(spec: P) -> P:
  """`spec` with every axis but "pipe" dropped (a leaf that enters whole over the groups)."""
  entries = [e if e == PIPE else None for e in tuple(spec)]
  return P(*entries) if any(e is not None for e in entries) else P()


def _replica_microbatches(loop: GroupLoop, stacked, shared, batch, counts, comm, dims=None):
  """One pipeline replica's step (inside ``shard_map`` manual over "pipe" and `loop.axes`):
  its `counts[0]` microbatches of `batch` int32[1, S, m, T+1] through the stages, then the
  sums over the groups. `dims`: :func:`_replica_specs`' (ZeRO-3: parameters as shards, each
  layer gathered where it runs; the shared ones gathered once). Returns (mean loss, stacked
  gradients, shared gradients, comm)."""
  count = counts[0]
  run = pipeline_lib.SCHEDULE_FNS[loop.schedule]
  fns, reduced = stages_of(loop.parts), None
  if dims is not None:
    gathering = loop.gathering()
    fns, shared = stage_gather.lockstep_stages(fns, gathering, dims[0], shared, dims[1])
  if loop.stage_layers is not None:
    fns = pipeline_lib.uneven(fns, loop.stage_layers, PIPE)
  loss_sum, g_stacked, g_shared = run(fns, stacked, shared, batch[0], count,
                                      stages=pipe_size(loop.mesh), axis=PIPE, sums=True)
  if dims is not None:
    g_shared = gathering.reduce_grads(g_shared, dims[1])
    merged = loop.parts.merge({"params": dims[0]}, {"params": dims[1]})["params"]
    reduced = jax.tree.map(lambda d: d is not None, merged, is_leaf=lambda x: x is None)
  total, loss_sum = lax.psum((count.astype(jnp.float32), loss_sum), loop.axes)
  acc = loop.parts.merge(g_stacked, g_shared)
  params, comm = _sum_over_groups(acc["params"], reduced, loop, comm)
  params = jax.tree.map(lambda g: g / total.astype(g.dtype), params)
  rest = {k: v for k, v in acc.items() if k != "params"}
  grads = {**(_max_over_groups(rest, loop.axes) if rest else {}), "params": params}
  return (loss_sum / total, *loop.parts.split(grads), comm)


def group_step_fn(groups: GroupLoop, grad_fn, tx, fused_update):
  """The per-group loop's ``step(state, batch, counts)`` (:func:`make_train_step`)."""
  def local_grads(variables, batch, counts, comm):
    spec = P(groups.axes)
    if groups.schedule is not None:
      stacked, shared = groups.parts.split(variables)
      stacked = pipeline_lib.pad_stack(stacked, groups.stage_layers)
      st, sh, g_st, g_sh, dims = _replica_specs(groups, stacked, shared)
      loss, g_stacked, g_shared, comm = jax.shard_map(
          functools.partial(_replica_microbatches, groups, dims=dims), mesh=groups.mesh,
          in_specs=(st, sh, spec, spec, P()), out_specs=(P(), g_st, g_sh, P()),
          check_vma=False)(stacked, shared, batch, counts, comm)
      g_stacked = pipeline_lib.unpad_stack(g_stacked, groups.stage_layers)
      return loss, groups.parts.merge(g_stacked, g_shared), comm
    var_spec, grad_spec, dims, reduced = _group_specs(groups, variables)
    local = functools.partial(group_microbatches, grad_fn, groups, dims=dims, reduced=reduced)
    return jax.shard_map(
        local, mesh=groups.mesh, in_specs=(var_spec, spec, spec, P()),
        out_specs=(P(), grad_spec, P()), check_vma=False)(variables, batch, counts, comm)

  def group_step(state: TrainState, batch, counts):
    variables = state.variables()
    comm = state.comm if groups.auto else None
    if groups.auto:
      want = len(jax.tree.leaves(variables["params"]))
      if not isinstance(comm, CommScaling) or jnp.shape(comm.amax) != (want,):
        raise ValueError(f"comm_scaling='auto' needs state.comm = CommScaling of shape "
                         f"[{want}] (one entry per parameter leaf), got "
                         f"{jax.tree.map(jnp.shape, comm)}; use init_grad_comm_scaling(params)")
    loss, grads, comm = local_grads(variables, batch, counts, comm)
    new, metrics = apply_gradients(state, tx, grads, loss, fused_update)
    if not groups.auto:
      return new, metrics
    idx = np.asarray(grad_comm_lib.fp8_leaves(variables["params"], groups.groups) or [0])
    metrics = {**metrics, "comm_pre_scale_min": jnp.min(comm.pre_scale[idx]),
               "comm_saturated_max": jnp.max(comm.saturated[idx])}
    return new._replace(comm=comm), metrics
  return group_step

