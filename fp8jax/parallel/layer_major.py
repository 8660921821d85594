"""The layer-major microbatch loop: per-group microbatch counts with ZeRO-3 weights gathered
once per layer and step (call inside ``jax.shard_map`` manual over the ZeRO axes).

Each data-parallel group runs its own number k_g of microbatches (a balanced run gives fast
groups more; k_g may be 0) out of S slots of the same shape. Per-layer collectives must pair
up across groups, so they cannot sit inside loops of different lengths. Here the loop over
layers is outside and each group's loop over its microbatches inside (as Cephalo, ICS'25):

* the shared variables (embedding, final norm, head) are gathered once;
* forward, layer by layer (a scan over the stacked layers): the layer is gathered (kernels of
  FP8 GEMMs cast to E4M3 as shards with the tensor's one scale and all-gathered as bytes,
  other leaves in their payload dtype), then run on each slot s < k_g (a slot >= k_g computes
  nothing: ``lax.cond``), keeping only the layer's input per slot (the layer boundary);
* the head gives each slot's loss and the gradient of its last activation;
* backward, layer by layer in reverse: the layer is gathered again and each slot s < k_g runs
  ``jax.vjp`` of the layer at its kept input (its forward runs again: a layer-level remat);
  the slots' parameter gradients are summed in f32 and their FP8 state updates combined by
  max; then each gradient split over the ZeRO axes is reduce-scattered ONCE into its shard
  (f32, or the :class:`Gathering`'s reduce, e.g. FP8);
* the embedding's backward per slot; the shared gradients reduced once.

So every collective runs once per layer and step in each direction (a gather forward, a
gather and a reduce-scatter backward) on every group whatever its count, and the groups
never wait on each other inside a layer beyond their share of its compute. The cost is the
layer boundaries: S slots x L layers of one activation [m, T, D] each. Gradients are not
differentiated through the schedule: each slot's gradient is accumulated explicitly
(``fp8jax.accumulate_gradients``), as in :mod:`fp8jax.parallel.pipeline`.

The model comes cut into :class:`fp8jax.parallel.pipeline.Stages` (``first``, ``stage``,
``last``), its variables into ``stacked`` (leaves [L, ...]) and ``shared``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import traverse_util
from jax import lax

from fp8jax import dot, fsdp
from fp8jax.accumulate import accumulate_gradients, accumulator_zeros, widen
from fp8jax.gemm_weights import is_gemm_weight
from fp8jax.linen import FP8_COLLECTION, WEIGHT_CAST_COLLECTION
from fp8jax.parallel.pipeline import Stages
from fp8jax.recipe import Recipe
from fp8jax.scaling import Fp8Meta

# (gradient f32 [local, whole along dim], axes, dim) -> this device's chunk of its sum
Reduce = Callable[[Any, tuple, int], Any]


@dataclasses.dataclass(frozen=True)
class Gathering:
  """How the loop gathers variables that live as shards, and reduces their gradients.

  Attributes:
    axes: the ZeRO mesh axes (manual in the enclosing ``shard_map``).
    recipe: the FP8 recipe of the model's GEMMs, or None (BF16 GEMMs). With a recipe, every
      split kernel that has FP8 state next to it (``fp8jax.linen.Fp8DotGeneral``) is cast to
      E4M3 as a shard with the tensor's scale (delayed, or the amax agreed over `axes`) and
      all-gathered as its bytes; its GEMM multiplies that cast
      (``fp8jax.linen.WEIGHT_CAST_COLLECTION``), so the weight is rounded once per step.
    matrix_dtype: the model's compute dtype: other GEMM weights (embeddings, BF16 kernels)
      are cast to it and cross in it (the model promotes them to it anyway).
    payload_dtype: the remaining floating leaves cross as this payload with a power-of-two
      scale (FP16 at O2/O3: lossless for FP16 master weights), or None: as they are.
    reduce: how a gradient is summed into its shard (``fp8jax.fsdp.Local``'s reduce, e.g.
      ``fp8jax.parallel.grad_comm.fp8_sum_into``), or None: an f32 ``lax.psum_scatter``.
  """

  axes: tuple[str, ...]
  recipe: Recipe | None = None
  matrix_dtype: Any = None
  payload_dtype: Any = None
  reduce: Reduce | None = None

  def gather(self, variables, dims):
    """(diff, const): `variables` (``{collection: tree}``, leaves as this device holds them)
    as the model uses them. `dims`: a tree like ``variables["params"]`` of the dimension each
    leaf is split along over :attr:`axes` (None: held whole).

    diff: the variables to differentiate: gathered parameters (an FP8-cast kernel is a zero
    placeholder of its full shape: its GEMM reads the cast, and its cotangent is the weight
    gradient) and the other collections as they are. const: ``{WEIGHT_CAST_COLLECTION:
    casts}`` (empty without FP8 kernels), applied with diff but never differentiated."""
    params = traverse_util.flatten_dict(variables["params"])
    flat_dims = traverse_util.flatten_dict(dims)
    casts, cast_kernels = {}, set()
    for path, meta in traverse_util.flatten_dict(variables.get(FP8_COLLECTION, {})).items():
      kernel = path[:-2] + ("kernel",)  # (.. module, GEMM module, role): the module's kernel
      if (self.recipe is None or path[-1] != "kernel" or not isinstance(meta, Fp8Meta)
          or kernel not in params or flat_dims.get(kernel) is None):
        continue
      w, dim = params[kernel], flat_dims[kernel]
      cast = dot.cast_weight(w.astype(self.matrix_dtype or w.dtype), meta, self.recipe,
                             amax_axes=self.axes)
      q = fsdp.constrain_bits(cast.q, fsdp.Local(dim, self.axes, gathered=True))
      for field, value in cast._replace(q=q)._asdict().items():
        casts[path[:-1] + (field,)] = value
      params[kernel] = jnp.zeros(q.shape, w.dtype)
      cast_kernels.add(kernel)
    for path, x in params.items():
      dim = flat_dims.get(path)
      if dim is not None and path not in cast_kernels:
        params[path] = self._gather_leaf(path, x, dim)
    diff = {**variables, "params": traverse_util.unflatten_dict(params)}
    const = {WEIGHT_CAST_COLLECTION: traverse_util.unflatten_dict(casts)} if casts else {}
    return diff, const

  def _gather_leaf(self, path, x, dim: int):
    """Leaf `x` (split along `dim`) gathered whole: GEMM weights in :attr:`matrix_dtype`,
    other floating leaves as :attr:`payload_dtype` with a power-of-two scale."""
    home = fsdp.Local(dim, self.axes)
    full = dataclasses.replace(home, gathered=True)
    if not jnp.issubdtype(x.dtype, jnp.floating):
      return fsdp.constrain_bits(x, full)
    if self.matrix_dtype is not None and is_gemm_weight([jax.tree_util.DictKey(path[-1])]):
      return fsdp.gather_value(x, home, full, dtype=self.matrix_dtype)
    return fsdp.gather_value(x, home, full, dtype=self.payload_dtype, scaled=True)

  def reduce_grads(self, grads, dims):
    """`grads` (cotangents of :meth:`gather`'s diff, summed over this group's slots in f32)
    with every parameter gradient split by `dims` summed over :attr:`axes` into this device's
    chunk (f32); the rest as they are (reduced after the loop)."""
    def one(g, dim):
      if dim is None:
        return g
      return fsdp.sum_into(g, fsdp.Local(dim, self.axes, reduce=self.reduce), jnp.float32)
    params = jax.tree.map(one, grads["params"], dims, is_leaf=lambda x: x is None)
    return {**grads, "params": params}


def zeros_of(tree):
  """Zeros shaped like `tree`'s leaves (arrays or ``jax.ShapeDtypeStruct``s)."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)


def one_layer(tree):
  """Leaves [...] -> [1, ...]: one layer as a stack of one (what ``Stages.stage`` takes)."""
  return jax.tree.map(lambda x: x[None], tree)


def layer_dims(dims):
  """The split dimensions of one layer's slice of stacked leaves (one less)."""
  return jax.tree.map(lambda d: None if d is None else d - 1, dims,
                      is_leaf=lambda x: x is None)


def layer_major_grads(fns: Stages, gathering: Gathering, stacked, shared, dims, slots, count):
  """One group's loss and gradients under the layer-major schedule (module docstring).

  Args:
    fns: the model's ``first`` / ``stage`` / ``last`` (``fp8jax.parallel.pipeline.Stages``);
      ``stage`` runs a stack of one layer here.
    gathering: how variables are gathered and gradients reduced.
    stacked: this device's stacked variables ({collection: leaves [L, ...]}; parameters as
      shards, FP8 state whole).
    shared: this device's other variables (parameters as shards).
    dims: (stacked dims, shared dims): trees like the two parameter trees of the dimension
      each leaf is split along over the ZeRO axes (None: held whole); stacked dims count the
      layer axis.
    slots: int32[S, m, T+1], this group's microbatch slots; count: int32[], how many run.
  Returns (loss sum over the group's microbatches, stacked gradients, shared gradients):
  parameter gradients summed over the group's microbatches in f32, each split leaf already
  summed over the ZeRO axes into this device's chunk (the others are this group's sums);
  FP8 state combined by max over the group's microbatches.
  """
  stacked_dims, shared_dims = dims
  one_dims = layer_dims(stacked_dims)
  ran = jnp.arange(slots.shape[0]) < count
  sh, sh_const = gathering.gather(shared, shared_dims)
  first = lambda sh, part: fns.first({**sh, **sh_const}, part)
  x_aval = jax.eval_shape(first, sh, slots[0])

  def embed(args):
    r, part = args
    return lax.cond(r, lambda: first(sh, part), lambda: zeros_of(x_aval))

  def forward(xs, layer):
    w, const = gathering.gather(layer, one_dims)
    run = lambda x: fns.stage({**one_layer(w), **one_layer(const)}, x)
    ys = lax.map(lambda a: lax.cond(a[0], lambda: run(a[1]), lambda: a[1]), (ran, xs))
    return ys, xs  # keeps each layer's input

  xs, kept = lax.scan(forward, lax.map(embed, (ran, slots)), stacked)

  def head(acc, args):
    r, y, part = args
    loss_sum, acc_sh = acc
    last = lambda sh, y: fns.last({**sh, **sh_const}, y, part).astype(jnp.float32)
    run = lambda: jax.value_and_grad(last, argnums=(0, 1))(sh, y)
    shapes = jax.eval_shape(run)
    loss, (g_sh, dy) = lax.cond(r, run, lambda: zeros_of(shapes))
    return (loss_sum + jnp.where(r, loss, 0.0), accumulate_gradients(acc_sh, g_sh, r)), dy

  zero_sh = accumulator_zeros(sh)
  (loss_sum, acc_sh), dys = lax.scan(head, (jnp.zeros((), jnp.float32), zero_sh),
                                     (ran, xs, slots))

  def backward(dys, args):
    layer, xs = args
    w, const = gathering.gather(layer, one_dims)

    def slot(acc, a):
      r, x, dy = a
      apply = lambda w, x: fns.stage({**one_layer(w), **one_layer(const)}, x)
      run = lambda: jax.vjp(apply, w, x)[1](dy)
      shapes = jax.eval_shape(run)
      g, dx = lax.cond(r, run, lambda: zeros_of(shapes))
      return accumulate_gradients(acc, jax.tree.map(widen, g), r), dx

    acc, dxs = lax.scan(slot, accumulator_zeros(w), (ran, xs, dys))
    return dxs, gathering.reduce_grads(acc, one_dims)

  dxs, g_stacked = lax.scan(backward, dys, (stacked, kept), reverse=True)

  def embed_back(acc, a):
    r, part, dx = a
    run = lambda: jax.vjp(lambda sh: first(sh, part), sh)[1](dx)[0]
    g = lax.cond(r, run, lambda: zeros_of(jax.eval_shape(run)))
    return accumulate_gradients(acc, jax.tree.map(widen, g), r), None

  acc_sh, _ = lax.scan(embed_back, acc_sh, (ran, slots, dxs))
  return loss_sum, g_stacked, gathering.reduce_grads(acc_sh, shared_dims)

