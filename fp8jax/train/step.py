"""The train step, composed of small pieces.

One step ``(state, batch[, counts]) -> (state, metrics)`` is put together from:

* weight gather (ZeRO-3): the loss is traced under the plan's ``fp8jax.fsdp.WeightGather``,
  so the model gathers each parameter where it uses it (FP8 kernels as E4M3 bytes inside
  their GEMM, per layer inside the layer scan): XLA places the collectives in the uniform
  loop, explicit collectives do it inside the group loop's ``shard_map``
  (``GroupLoop.weight_gather``); none below stage 3;
* the microbatch loop: :func:`scan_microbatches` (every device runs the same static number of
  microbatches of the global batch, XLA places the collectives), :func:`group_microbatches`
  (inside ``jax.shard_map``: each data-parallel group loops over its own number of
  microbatches with no collective in the loop, then one reduction) or
  :func:`pipeline_microbatches` (pipeline stages over the mesh's "pipe" axis: the GPipe or
  1F1B schedule of :mod:`fp8jax.parallel.pipeline`);
* gradient reduction: ZeRO's layout constraint (``reduce_gradients``) in the scanned and
  pipeline loops; in the group loop each ZeRO-3 gradient is reduce-scattered where the
  backward makes it (f32, or FP8 with current scaling), the rest by
  :func:`fp8jax.parallel.grad_comm.reduce_over_groups` (f32 or FP8 with its scaling state)
  after the loop;
* the update: :func:`apply_gradients` (the optax transform plus FP16 master weights, or the
  fused O2 update);
* guards: ``fp8jax.train.guards.skip_nonfinite_steps``.

:func:`make_train_step` composes them into a jittable function; :func:`build_step` jits it on a
``fp8jax.parallel.ZeroPlan`` (shardings, donation, optimizer offload) together with the
placement of a host batch, as a :class:`TrainStep`.

Gradients: parameter gradients are summed over microbatches in f32 and divided by their
count (every microbatch holds the same number of tokens, so this is the full batch's mean-loss
gradient); FP8 state updates combine by max (``fp8jax.accumulate_gradients``). Clipping, weight
decay and the learning-rate schedule live in the optax transform `tx`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fp8jax import fsdp
from fp8jax.accumulate import accumulate_gradients, accumulator_zeros, widen
from fp8jax.linen import FP8_COLLECTION, apply_fp8_updates
from fp8jax.optim import MasterWeights, apply_master_updates
from fp8jax.parallel import grad_comm as grad_comm_lib
from fp8jax.parallel import layer_major as layer_major_lib
from fp8jax.parallel import layout
from fp8jax.parallel import pipeline as pipeline_lib
from fp8jax.parallel.collectives import CommScaling
from fp8jax.parallel.mesh import BATCH_AXES, PIPE, pipe_size
from fp8jax.parallel.zero import ZeroPlan
from fp8jax.scaling import combine_max
from fp8jax.train import guards
from fp8jax.train.state import TrainState


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token loss in f32 nats; logits [B, T, V], targets int [B, T]."""
  losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
  return jnp.mean(losses)


def next_token_loss(apply_fn: Callable, variables, batch) -> jax.Array:
  """batch int32[B, T+1] -> mean loss (f32 nats) of predicting batch[:, 1:] from
  batch[:, :-1] with ``apply_fn(variables, tokens[B, T]) -> logits[B, T, V]``."""
  return cross_entropy(apply_fn(variables, batch[:, :-1]), batch[:, 1:])


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
      each parameter lives), or None (below ZeRO-3: parameters enter the loop whole).
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
      the gradients are summed over the groups (f32, or FP8 with `grad_comm` "fp8"). The
      parameters enter each replica whole (its stage's layers), not as ZeRO-3 shards.
  """

  mesh: Mesh
  axes: tuple[str, ...] = BATCH_AXES
  grad_comm: str = "native"
  comm_scaling: str = "current"
  growth_interval: int = 1000
  weight_gather: fsdp.WeightGather | None = None
  parts: Any = None
  layer_stacks: tuple[str, ...] = ()
  counts: Callable[[int], Sequence[int]] | None = None
  microbatch_size: int | None = None
  dynamic: bool = False
  schedule: str | None = None

  def __post_init__(self):
    grad_comm_lib.check_options(self.grad_comm, self.comm_scaling, self.growth_interval)
    object.__setattr__(self, "axes", layout.group_axes(self.mesh, self.axes))
    if self.schedule is not None:
      pipeline_lib.check_schedule(self.schedule)
      if pipe_size(self.mesh) < 2 or self.parts is None or self.weight_gather is not None:
        raise ValueError("GroupLoop(schedule=...) needs a mesh with a 'pipe' axis of 2 or more "
                         "stages, the model's parts and no weight_gather (each replica holds "
                         "its stage's layers whole)")
    if self.layer_major and self.auto:
      raise ValueError("comm_scaling='auto' with ZeRO-3's per-layer gradient reduce-scatter "
                       "is not supported (each layer's gradient is reduced inside its "
                       "backward, where no scaling state flows); use comm_scaling 'current'")

  @property
  def layer_major(self) -> bool:
    """Whether the loop runs layer-major (ZeRO-3 shards in, a model cut into parts)."""
    return self.weight_gather is not None and self.parts is not None

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
    loop = self if self.weight_gather is not None or self.schedule is not None else \
        dataclasses.replace(self, weight_gather=plan.weight_gather())
    n, m, sharding = loop.groups, self.microbatch_size, plan.batch
    if self.counts is not None:
      split = functools.lru_cache(maxsize=None)(
          lambda k: _checked_counts(self.counts(k), k, n))
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
      k = _microbatch_count(batch, microbatches, m, self.dynamic)
      c = split(k)
      laid = _pad_to(arrange(batch, k, c), 1, slots)
      return (layout.put_global(laid, sharding),
              layout.put_global(np.asarray(c, np.int32), sharding))
    step = make_train_step(apply_fn, tx, microbatches, groups=loop, fused_update=fused_update)
    return step, place, (sharding, sharding)

  @property
  def groups(self) -> int:
    return layout.group_count(self.mesh, self.axes)

  @property
  def auto(self) -> bool:
    return self.comm_scaling == "auto"


def scan_microbatches(grad_fn: Callable, variables, batch, microbatches: int, count=None):
  """The uniform loop: `batch` int32[B, T+1] split into `microbatches` equal parts, run in order.

  `grad_fn(variables, part) -> (loss, grads)`. `count`: None (all parts, a static scan) or an
  int32 scalar, possibly traced, in [1, microbatches]: only the first `count` parts run (a
  loop with a dynamic trip count over the fixed part shape, so one compiled program serves
  every count). Returns (mean loss, mean parameter gradients in f32 and FP8 state combined
  by max) over the parts that ran."""
  if batch.shape[0] % microbatches:
    raise ValueError(f"batch of {batch.shape[0]} sequences does not split into "
                     f"{microbatches} microbatches")
  if microbatches == 1 and count is None:  # no accumulator: the gradient as it comes
    return grad_fn(variables, batch)
  parts = batch.reshape(microbatches, batch.shape[0] // microbatches, *batch.shape[1:])
  zeros = (jnp.zeros((), jnp.float32), accumulator_zeros(variables))

  def add(carry, part):
    loss_sum, acc = carry
    loss, g = grad_fn(variables, part)
    return loss_sum + loss, accumulate_gradients(acc, g)

  if count is None:
    (loss_sum, acc), _ = lax.scan(lambda c, part: (add(c, part), None), zeros, parts)
    n = jnp.float32(microbatches)
  else:
    loss_sum, acc = lax.fori_loop(
        0, count, lambda i, c: add(c, lax.dynamic_index_in_dim(parts, i, keepdims=False)),
        zeros)
    n = jnp.asarray(count).astype(jnp.float32)
  acc = {**acc, "params": jax.tree.map(lambda g: g / n.astype(g.dtype), acc["params"])}
  return loss_sum / n, acc


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


def stages_of(parts) -> pipeline_lib.Stages:
  """`parts` (:class:`fp8jax.models.layers.DecoderParts`) as the schedules' first / stage /
  last functions (last: mean next-token loss of a microbatch int32[m, T+1])."""
  return pipeline_lib.Stages(
      first=lambda shared, part: parts.embed(shared, part[:, :-1]),
      stage=parts.layers,
      last=lambda shared, y, part: cross_entropy(parts.logits(shared, y), part[:, 1:]))


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


@dataclasses.dataclass(frozen=True)
class PipelineLoop:
  """The pipeline loop's settings (see :func:`pipeline_microbatches`).

  Attributes:
    mesh: the device mesh; its "pipe" axis holds the stages (2 or more).
    parts: the model cut into ``split(variables) -> (stacked, shared)``, ``merge(stacked,
      shared)``, ``embed(shared, tokens) -> x``, ``layers(stacked, x) -> x`` and
      ``logits(shared, x) -> logits`` (``fp8jax.models.layers.DecoderParts``, from
      ``model.parts()``).
    schedule: "gpipe" (all forwards, then all backwards: k kept inputs per stage) or "1f1b"
      (interleaved: at most 2P - 1 kept inputs, a larger bubble; ``fp8jax.parallel.pipeline``).
    microbatch_size, dynamic: for :func:`build_step`, as :class:`UniformLoop`'s.
    matrix_dtype: for :func:`build_step`, as :func:`make_train_step`'s.
  """

  mesh: Mesh
  parts: Any
  schedule: str = "gpipe"
  microbatch_size: int | None = None
  dynamic: bool = False
  matrix_dtype: Any = None

  def __post_init__(self):
    pipeline_lib.check_schedule(self.schedule)
    if pipe_size(self.mesh) < 2:
      raise ValueError(f"the pipeline loop needs a mesh with a 'pipe' axis of 2 or more "
                       f"stages, got axes {dict(self.mesh.shape)}")
    missing = [m for m in ("split", "merge", "embed", "layers", "logits")
               if not callable(getattr(self.parts, m, None))]
    if missing:
      raise ValueError(f"pipeline parallelism needs the model cut into parts; "
                       f"{type(self.parts).__name__} has no {missing} (the reference "
                       f"families give them: model.parts())")

  @property
  def stages(self) -> int:
    return pipe_size(self.mesh)

  def stage_fns(self) -> pipeline_lib.Stages:
    """The model as the schedule's first / stage / last functions (:func:`stages_of`)."""
    return stages_of(self.parts)

  def program(self, apply_fn, tx, plan: ZeroPlan, microbatches: int, fused_update=None):
    """(step, place, batch shardings) for :func:`build_step`: the pipeline step with the
    plan's gradient layout (`microbatches` >= the stages) and the batch over the batch axes
    (with :attr:`dynamic`, padded, plus its count)."""
    if self.mesh != plan.mesh:
      raise ValueError("build_step: the PipelineLoop's mesh is not the plan's")
    step = make_train_step(apply_fn, tx, microbatches, pipeline=self,
                           reduce_gradients=plan.reduce_fn(), fused_update=fused_update,
                           matrix_dtype=self.matrix_dtype)
    return (step, *_batch_placement(plan, self.dynamic, microbatches, self.microbatch_size))


@dataclasses.dataclass(frozen=True)
class UniformLoop:
  """The uniform loop's settings (:func:`scan_microbatches`): every data-parallel rank runs
  its share of every microbatch; the plan's gradient layout (ZeRO) and, at ZeRO-3, each
  parameter gathered where the model uses it.

  Attributes:
    microbatch_size: sequences per microbatch (needed with `dynamic`).
    dynamic: the step takes a batch of any whole number k in [1, microbatches] of
      microbatches of `microbatch_size` sequences (a batch ramp): the host pads it to the
      largest shape and passes k as data, so one compiled program serves every k.
    cast_weights, matrix_dtype: as :func:`make_train_step`'s (`cast_weights` below ZeRO-3
      only: at 3 the weights are cast where they are gathered).
  """

  microbatch_size: int | None = None
  dynamic: bool = False
  cast_weights: Callable | None = None
  matrix_dtype: Any = None

  def program(self, apply_fn, tx, plan: ZeroPlan, microbatches: int, fused_update=None):
    """(step, place, batch shardings) for :func:`build_step`."""
    weight_gather = plan.weight_gather()
    step = make_train_step(apply_fn, tx, microbatches, weight_gather=weight_gather,
                           reduce_gradients=plan.reduce_fn(), fused_update=fused_update,
                           cast_weights=self.cast_weights if weight_gather is None else None,
                           matrix_dtype=self.matrix_dtype)
    return (step, *_batch_placement(plan, self.dynamic, microbatches, self.microbatch_size))


def pipeline_microbatches(loop: PipelineLoop, variables, batch, microbatches: int, count=None):
  """The pipeline loop: `batch` int32[B, T+1] split into `microbatches` equal parts run
  through the stages of ``loop.mesh``'s "pipe" axis (``loop.schedule``: GPipe or 1F1B,
  :mod:`fp8jax.parallel.pipeline`; each part's sequences stay split over the batch axes).
  `count`: None, or an int32 scalar (possibly traced) in [1, microbatches]: only the first
  `count` parts run (a batch ramp), as in :func:`scan_microbatches`. Returns (mean loss, mean
  parameter gradients in f32 and FP8 state combined by max), as :func:`scan_microbatches`."""
  if batch.shape[0] % microbatches:
    raise ValueError(f"batch of {batch.shape[0]} sequences does not split into "
                     f"{microbatches} microbatches")
  pipeline_lib.check_stages(loop.stages, microbatches)
  parts = batch.reshape(microbatches, batch.shape[0] // microbatches, *batch.shape[1:])
  parts = lax.with_sharding_constraint(
      parts, NamedSharding(loop.mesh, P(None, layout.group_axes(loop.mesh))))
  stacked, shared = loop.parts.split(variables)
  loss, g_stacked, g_shared = pipeline_lib.pipeline_grads(
      loop.stage_fns(), loop.mesh, stacked, shared, parts, count, schedule=loop.schedule)
  grads = loop.parts.merge(g_stacked, g_shared)
  return loss, {**grads, "params": jax.tree.map(widen, grads["params"])}


def make_train_step(apply_fn: Callable, tx: optax.GradientTransformation, microbatches: int = 1,
                    *, groups: GroupLoop | None = None,
                    pipeline: PipelineLoop | None = None,
                    weight_gather: fsdp.WeightGather | None = None,
                    reduce_gradients: Callable | None = None,
                    fused_update: Callable | None = None,
                    cast_weights: Callable | None = None,
                    matrix_dtype=None):
  """A jittable train step.

  Without `groups`: ``step(state, batch int32[B, T+1], count=None) -> (state, metrics)``
  running :func:`scan_microbatches` (`count`: an int32 scalar, the number of the batch's
  `microbatches` parts that run; None: all). With `groups`: ``step(state, batch int32[G, n, m, T+1],
  counts int32[G])`` running :func:`group_microbatches` inside
  ``shard_map`` (batch and counts sharded over the groups: ``fp8jax.parallel.layout``).
  With `pipeline`: ``step(state, batch int32[B, T+1], count=None) -> (state, metrics)``
  running :func:`pipeline_microbatches` (`count` as for the uniform loop).

  Args:
    apply_fn: ``apply_fn(variables, tokens[B, T]) -> logits[B, T, V]``.
    tx: the optimizer (including clipping); it sees parameters only.
    microbatches: equal parts the batch is split into (uniform loop; must divide B).
    groups: run the per-group loop with these settings.
    pipeline: run the pipeline loop with these settings (with `reduce_gradients`,
      `fused_update` and `matrix_dtype` only; `microbatches` >= its stages).
    weight_gather: optional ``fp8jax.fsdp.WeightGather`` (ZeRO-3, ``ZeroPlan.weight_gather``)
      the loss and its gradient are traced under: the model gathers its sharded parameters
      where it uses them. Uniform loop only (the group loop's is ``groups.weight_gather``).
    reduce_gradients: optional ``grads -> grads`` applied to each microbatch's f32 parameter
      gradients (uniform loop: ZeRO's all-reduce / reduce-scatter layout).
    fused_update: optional ``(master, opt_state, grads, finite, grad_norm) -> (master,
      opt_state)`` replacing `tx` plus ``apply_master_updates`` for FP16 master weights
      (:func:`fp8jax.train.optimizer.make_fused_update`).
    cast_weights: optional ``variables -> extra collections`` computed once per step before
      the microbatch loop (``fp8jax.linen.cast_weights``: FP8 weights cast once per optimizer
      step, not once per microbatch); uniform loop only, not with `weight_gather` (the
      weights are gathered at use).
    matrix_dtype: optional dtype the FP16 master weights' GEMM weights are decoded to for the
      forward and backward (the model's compute dtype, exact for a model that casts them to
      it before use; with `weight_gather` the shards are decoded); gradients are still
      summed, reduced and clipped in f32. Uniform loop only.
  Metrics: loss (mean over the step's tokens), grad_norm (before clipping); with automatic
  comm scaling also comm_pre_scale_min and comm_saturated_max over the FP8 leaves.
  """
  if microbatches < 1:
    raise ValueError(f"microbatches={microbatches!r} is not allowed; use an integer >= 1")
  if cast_weights is not None and weight_gather is not None:
    raise ValueError("cast_weights with weight_gather is not supported: the weights are "
                     "gathered per microbatch (ZeRO-3); cast them there")
  if weight_gather is not None and not isinstance(weight_gather, fsdp.WeightGather):
    raise TypeError(f"weight_gather must be an fp8jax.fsdp.WeightGather, got "
                    f"{type(weight_gather).__name__}")
  if weight_gather is not None and groups is not None:
    raise ValueError("weight_gather belongs to the uniform loop; the group loop takes "
                     "groups.weight_gather")
  if matrix_dtype is not None and not jnp.issubdtype(jnp.dtype(matrix_dtype), jnp.floating):
    raise ValueError(f"matrix_dtype={matrix_dtype!r} is not a floating dtype")
  if groups is not None and (cast_weights, matrix_dtype, reduce_gradients) != (None,) * 3:
    raise ValueError("cast_weights, matrix_dtype and reduce_gradients belong to the uniform "
                     "loop; the group loop reduces through groups.grad_comm")
  if pipeline is not None and (groups, weight_gather, cast_weights) != (None,) * 3:
    raise ValueError("the pipeline loop takes none of groups, weight_gather and cast_weights "
                     "(its stages hold their layers' weights)")
  if pipeline is not None:
    pipeline_lib.check_stages(pipeline.stages, microbatches)

  grad_fn = _microbatch_grads(apply_fn, weight_gather, reduce_gradients)
  if pipeline is not None:
    return _pipeline_step(pipeline, tx, microbatches, reduce_gradients, fused_update,
                          matrix_dtype)
  if groups is not None:
    return _group_step(groups, grad_fn, tx, fused_update)
  return _uniform_step(grad_fn, tx, microbatches, fused_update, cast_weights, matrix_dtype)


def _microbatch_grads(apply_fn: Callable, weight_gather, reduce_gradients) -> Callable:
  """``(variables, part, extra=None) -> (loss, grads)`` of one microbatch (under ZeRO-3's
  gather at use; with `reduce_gradients` applied to the f32 parameter gradients)."""
  def grad_fn(variables, part, extra=None):
    def loss_of(v):
      return next_token_loss(apply_fn, {**v, **(extra or {})}, part)
    with fsdp.gathering(weight_gather):
      loss, g = jax.value_and_grad(loss_of)(variables)
    if reduce_gradients is not None:
      g = {**g, "params": reduce_gradients(jax.tree.map(widen, g["params"]))}
    return loss, g
  return grad_fn


def _uniform_step(grad_fn, tx, microbatches: int, fused_update, cast_weights, matrix_dtype):
  """The uniform loop's ``step(state, batch, count=None)`` (:func:`make_train_step`)."""
  def uniform_step(state: TrainState, batch, count=None):
    variables = state.variables(matrix_dtype)  # decoded once, for every microbatch
    extra = {}
    if cast_weights is not None:  # once, for every microbatch
      extra = cast_weights(jax.lax.stop_gradient(variables))
    loss, grads = scan_microbatches(
        functools.partial(grad_fn, extra=extra), variables, batch,
        microbatches, count)
    # One static microbatch returns its gradient as it comes; the fused update reads it
    # narrow, the rest in f32.
    if microbatches == 1 and count is None and fused_update is None:
      grads = {**grads, "params": jax.tree.map(widen, grads["params"])}
    return apply_gradients(state, tx, grads, loss, fused_update)
  return uniform_step


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
  out_specs) of the pipeline replicas' ``shard_map``: stacked leaves split over "pipe" along
  the layer axis; FP8 gradients (grad_comm "fp8") come out as :func:`fp8jax.parallel.
  grad_comm.reduce_over_groups` leaves them, chunked over the groups along a dimension of
  the stage's local shape."""
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
  return P(PIPE), P(), g_stacked, g_shared


def _replica_microbatches(loop: GroupLoop, stacked, shared, batch, counts, comm):
  """One pipeline replica's step (inside ``shard_map`` manual over "pipe" and `loop.axes`):
  its `counts[0]` microbatches of `batch` int32[1, S, m, T+1] through the stages, then the
  sums over the groups. Returns (mean loss, stacked gradients, shared gradients, comm)."""
  count = counts[0]
  run = pipeline_lib.SCHEDULE_FNS[loop.schedule]
  loss_sum, g_stacked, g_shared = run(stages_of(loop.parts), stacked, shared, batch[0], count,
                                      stages=pipe_size(loop.mesh), axis=PIPE, sums=True)
  total, loss_sum = lax.psum((count.astype(jnp.float32), loss_sum), loop.axes)
  acc = loop.parts.merge(g_stacked, g_shared)
  params, comm = _sum_over_groups(acc["params"], None, loop, comm)
  params = jax.tree.map(lambda g: g / total.astype(g.dtype), params)
  rest = {k: v for k, v in acc.items() if k != "params"}
  grads = {**(_max_over_groups(rest, loop.axes) if rest else {}), "params": params}
  return (loss_sum / total, *loop.parts.split(grads), comm)


def _group_step(groups: GroupLoop, grad_fn, tx, fused_update):
  """The per-group loop's ``step(state, batch, counts)`` (:func:`make_train_step`)."""
  def local_grads(variables, batch, counts, comm):
    spec = P(groups.axes)
    if groups.schedule is not None:
      stacked, shared = groups.parts.split(variables)
      st, sh, g_st, g_sh = _replica_specs(groups, stacked, shared)
      loss, g_stacked, g_shared, comm = jax.shard_map(
          functools.partial(_replica_microbatches, groups), mesh=groups.mesh,
          in_specs=(st, sh, spec, spec, P()), out_specs=(P(), g_st, g_sh, P()),
          check_vma=False)(stacked, shared, batch, counts, comm)
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


def _pipeline_step(pipeline: PipelineLoop, tx, microbatches: int, reduce_gradients,
                   fused_update, matrix_dtype):
  """The pipeline loop's ``step(state, batch, count=None)`` (:func:`make_train_step`)."""
  def pipeline_step(state: TrainState, batch, count=None):
    variables = state.variables(matrix_dtype)
    loss, grads = pipeline_microbatches(pipeline, variables, batch, microbatches, count)
    if reduce_gradients is not None:
      grads = {**grads, "params": reduce_gradients(grads["params"])}
    return apply_gradients(state, tx, grads, loss, fused_update)
  return pipeline_step


def apply_gradients(state: TrainState, tx: optax.GradientTransformation, grads, loss,
                    fused_update: Callable | None = None):
  """The update half of a step: ``(new_state, {"loss", "grad_norm"})``.

  `grads`: the step's gradient of all variables: mean parameter gradients under "params"
  and the FP8 state combined by max over microbatches under the FP8 collection.
  `fused_update`: see :func:`make_train_step` (master weights only; other params raise).
  """
  param_grads = grads["params"]
  grad_norm = optax.tree.norm(jax.tree.map(widen, param_grads))  # summed in f32
  fp8 = apply_fp8_updates({FP8_COLLECTION: state.fp8} if state.fp8 else {}, grads).get(
      FP8_COLLECTION, {})
  if fused_update is not None and not isinstance(state.params, MasterWeights):
    raise ValueError("fused_update needs FP16 master weights (level O2: params are "
                     f"MasterWeights), got params of type {type(state.params).__name__}")
  if fused_update is not None:
    # It skips a step whose loss or gradients are not finite by itself (nothing changes).
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    new_params, opt_state = fused_update(state.params, state.opt_state, param_grads, finite,
                                         grad_norm)
    return (state._replace(step=state.step + 1, params=new_params, fp8=fp8,
                           opt_state=opt_state), {"loss": loss, "grad_norm": grad_norm})
  updates, opt_state = tx.update(param_grads, state.opt_state, state.model_params())
  if isinstance(state.params, MasterWeights):  # FP16 master weights: update in f32, re-round
    # The level's optimizer zeroes the updates of a step with non-finite gradients, so the
    # gradient norm decides finiteness (no second pass over the updates).
    new_params = apply_master_updates(state.params, updates, finite=jnp.isfinite(grad_norm))
  else:
    new_params = optax.apply_updates(state.params, updates)
  new_state = state._replace(step=state.step + 1, params=new_params, fp8=fp8,
                             opt_state=opt_state)
  return new_state, {"loss": loss, "grad_norm": grad_norm}


def make_eval_step(apply_fn: Callable, weight_gather: fsdp.WeightGather | None = None,
                   pipeline: PipelineLoop | None = None):
  """A jittable ``eval_step(state, batch) -> mean loss`` (FP8 state is not updated);
  `weight_gather`: as for :func:`make_train_step` (ZeRO-3: parameters gathered at use);
  `pipeline`: the batch runs through the pipeline stages as one microbatch, forwards only
  (``fp8jax.parallel.pipeline.gpipe_loss``; `weight_gather` does not apply)."""
  def eval_step(state, batch):
    if pipeline is not None:
      stacked, shared = pipeline.parts.split(state.variables())
      parts = lax.with_sharding_constraint(
          batch[None], NamedSharding(pipeline.mesh, P(None, layout.group_axes(pipeline.mesh))))
      return pipeline_lib.pipeline_loss(pipeline.stage_fns(), pipeline.mesh, stacked, shared,
                                        parts)
    with fsdp.gathering(weight_gather):
      return next_token_loss(apply_fn, state.variables(), batch)
  return eval_step


class TrainStep(NamedTuple):
  """A jitted step and the placement of its host batch.

  Attributes:
    jitted: ``jax.jit``-wrapped ``(state, *placed) -> (state, metrics)``; the state is
      donated. ``jitted.lower(state, *place(batch))`` gives its compiled program.
    place: ``batch int32[B, T+1] (numpy, the same on every process) -> placed args``.
  """

  jitted: Callable
  place: Callable

  def __call__(self, state, batch):
    return self.jitted(state, *self.place(batch))


def _microbatch_count(batch, microbatches: int, microbatch_size: int | None,
                      dynamic: bool) -> int:
  """The microbatch count k of a host `batch`: `microbatches`, or with `dynamic` its rows /
  `microbatch_size` (ValueError unless a whole number in [1, microbatches])."""
  if not dynamic:
    return microbatches
  k, rest = divmod(batch.shape[0], microbatch_size)
  if rest or not 1 <= k <= microbatches:
    raise ValueError(f"a batch of {batch.shape[0]} sequences is not 1..{microbatches} "
                     f"microbatches of {microbatch_size} sequences")
  return k


def _batch_placement(plan: ZeroPlan, dynamic: bool, microbatches: int,
                     microbatch_size: int | None):
  """(place, batch shardings) of a step taking ``batch int32[B, T+1]`` sharded over the
  plan's batch axes, and with `dynamic` the batch padded to `microbatches` microbatches plus
  its count k (an int32 scalar, replicated)."""
  sharding = plan.batch  # the batch axes (not the ZeRO axes, which may be fewer)
  if not dynamic:
    return (lambda batch: (layout.put_global(batch, sharding),)), (sharding,)
  rows, scalar = microbatches * microbatch_size, layout.replicated(plan.mesh)
  place = lambda batch: (
      layout.put_global(_pad_to(batch, 0, rows), sharding),
      layout.put_global(np.int32(_microbatch_count(batch, microbatches, microbatch_size,
                                                   True)), scalar))
  return place, (sharding, scalar)


Loop = UniformLoop | GroupLoop | PipelineLoop


def build_step(apply_fn: Callable, tx: optax.GradientTransformation, plan: ZeroPlan,
               microbatches: int, loop: Loop | None = None, *,
               fused_update: Callable | None = None, skip_nonfinite: bool = True) -> TrainStep:
  """The jitted step of `plan`'s layout for steps of `microbatches` microbatches (with a
  dynamic loop, at most that many): `loop`'s step and batch placement
  (:class:`UniformLoop`, the default; :class:`GroupLoop`: per-group counts or FP8 gradient
  communication; :class:`PipelineLoop`: the plan's mesh has pipeline stages), wrapped with
  the update, the non-finite guard and ``jax.jit`` on the plan's shardings.

  Args:
    fused_update: as :func:`make_train_step`'s.
    skip_nonfinite: wrap the step in ``guards.skip_nonfinite_steps`` (metrics gain
      ``skipped``).
  """
  loop = UniformLoop() if loop is None else loop
  mesh = plan.mesh
  staged = isinstance(loop, PipelineLoop) or getattr(loop, "schedule", None) is not None
  if staged != (pipe_size(mesh) > 1):
    raise ValueError(f"build_step: a plan whose mesh has {pipe_size(mesh)} pipeline stages "
                     f"needs {'a' if pipe_size(mesh) > 1 else 'no'} pipeline loop "
                     f"(PipelineLoop, or GroupLoop(schedule=...)), got {type(loop).__name__}")
  wants_size = loop.dynamic or getattr(loop, "counts", None) is not None
  if wants_size and loop.microbatch_size is None:
    raise ValueError("build_step: counts and dynamic need microbatch_size (sequences per "
                     "microbatch)")
  step, place, batch_shardings = loop.program(apply_fn, tx, plan, microbatches, fused_update)
  if skip_nonfinite:
    inside = ("params", "opt_state") if fused_update is not None else ()
    step = guards.skip_nonfinite_steps(step, skipped_inside=inside)

  def train_step(state, *args):
    new, metrics = step(plan.to_device(state), *args)
    return plan.to_home(new), metrics

  jitted = jax.jit(train_step, in_shardings=(plan.state, *batch_shardings),
                   out_shardings=(plan.state, layout.replicated(mesh)), donate_argnums=0,
                   compiler_options=plan.compiler_options or None)
  return TrainStep(jitted, place)


def _checked_counts(counts: Sequence[int], k: int, groups: int) -> tuple[int, ...]:
  """`counts` as a tuple of ints; ValueError unless one count >= 0 per group summing to k."""
  counts = tuple(int(c) for c in counts)
  if len(counts) != groups or sum(counts) != k or min(counts) < 0:
    raise ValueError(f"counts {counts} must give each of the {groups} data-parallel groups a "
                     f"count >= 0, summing to the step's {k} microbatches")
  return counts


def _pad_to(x: np.ndarray, axis: int, size: int) -> np.ndarray:
  """`x` zero-padded at the end of `axis` to `size` (the slots no loop reads)."""
  if x.shape[axis] == size:
    return x
  width = [(0, 0)] * x.ndim
  width[axis] = (0, size - x.shape[axis])
  return np.pad(x, width)
