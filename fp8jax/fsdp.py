"""Weights that live sharded between uses and are gathered where they are used (ZeRO-3, FSDP).

A :class:`WeightGather` says, for a parameter named by its key path and shape, where it lives
(its *home*: split over the ZeRO axes) and how its users see it (*gathered*: replicated over
those axes; tensor-parallel dimensions stay split). While one is active (:func:`gathering`,
entered by the train step around the loss and its gradient), parameters are gathered at use:

* every FP8 GEMM (:class:`fp8jax.linen.Fp8DotGeneral`, ``fp8_dot_general_chained(...,
  weight_shardings=...)``) casts its weight *shard* to E4M3 with the tensor's scale (the
  delayed scale of the replicated FP8 state, or the global amax: under ``jax.jit`` a max
  over a sharded array is global), all-gathers the E4M3 bytes and feeds them to the GEMM:
  one rounding of the weight per step;
* every BF16 GEMM of :class:`fp8jax.linen.DotGeneral` (:func:`gathered_dot_general`)
  all-gathers its weight as it comes (in the compute dtype the layer promoted it to);
* a model's other parameters go through :func:`gather_tree` where the model uses them (the
  reference decoder: each layer's parameters inside its layer scan): GEMM weights
  (embeddings) travel in the model's compute dtype (exact: the modules promote them to it
  anyway), the rest in the payload dtype with a power-of-two scale, or as stored.

A GEMM keeps only its weight's shard for the backward, which gathers it again, so a layer
loop never holds more than the layers in flight. Every gradient is straight-through, summed
over the devices in f32 into the home layout (a reduce-scatter) and cast to the parameter's
dtype.

Both are sharding constraints on values inside the loss, so XLA places one all-gather per
parameter where the layer runs (inside the layer loop, where the next layer's gather can
overlap this layer's compute) and a reduce-scatter per gradient in the backward. Payloads
narrower than f32 cross as their raw bits (unsigned ints of their width) between
optimization barriers: XLA may otherwise widen an FP8 all-gather or move a convert across it.

Inside ``jax.shard_map`` manual over the ZeRO axes (the per-group loop: each data-parallel
group computes its own gradient), a :class:`WeightGather` with a ``local`` table does the same
with explicit collectives: parameters arrive as this device's shard, the gather is a
``lax.all_gather`` of the raw bits and each gradient is reduce-scattered where it is made
(``lax.psum_scatter`` in f32, or the ``reduce`` function it is given, e.g. an FP8
reduce-scatter), so the loop accumulates only shards. The layouts are :class:`Local` values.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fp8jax.gemm_weights import is_gemm_weight, leaf_name
from fp8jax.optim.scaled import quantize_scaled

# (key path as jax.tree_util.keystr, shape) -> (home spec, gathered spec)
Specs = Callable[[str, tuple], tuple[P, P]]
# (gradient f32 local, axes, dim) -> its sum over `axes`, this device's chunk along `dim`
Reduce = Callable[[Any, tuple, int], Any]


@dataclasses.dataclass(frozen=True)
class Local:
  """A parameter's layout inside ``jax.shard_map`` manual over the ZeRO axes.

  Attributes:
    dim: the dimension split over the ZeRO axes (of the value as its user sees it).
    axes: the ZeRO mesh axes (manual in the enclosing ``shard_map``).
    gathered: values in this layout are whole (all-gathered); else this device's shard.
    reduce: how a gradient is summed into the shard layout (:data:`Reduce`, e.g. an FP8
      reduce-scatter; module-level functions only: the layout is hashed), or None: an f32
      ``lax.psum_scatter``.
  """

  dim: int
  axes: tuple[str, ...]
  gathered: bool = False
  reduce: Reduce | None = None



@dataclasses.dataclass(frozen=True)
class WeightGather:
  """Where sharded parameters live and how they are gathered at use.

  Attributes:
    mesh: the device mesh.
    specs: ``(path, shape) -> (home PartitionSpec, gathered PartitionSpec)`` of a parameter
      (path: ``jax.tree_util.keystr`` of its key path, possibly relative to a submodule; shape:
      the array as its user sees it, e.g. one layer's slice of a scanned stack).
    payload_dtype: dtype other floating parameters cross in with a power-of-two scale (FP16
      at O2/O3: lossless for FP16 master weights), or None: as they are.
    keep_gathered: GEMMs keep their gathered weight for their backward instead of the shard
      (which the backward gathers again): for layers under remat, whose forward runs again
      in the backward and gathers it there anyway.
  """

  mesh: Mesh
  specs: Specs
  payload_dtype: Any = None
  keep_gathered: bool = False

  def shardings(self, path: str, shape):
    """(home, gathered) NamedShardings of the parameter at `path` with `shape`; None when it
    is not split over the ZeRO axes (nothing to gather)."""
    home, full = self.specs(path, tuple(shape))
    if home == full:
      return None
    return NamedSharding(self.mesh, home), NamedSharding(self.mesh, full)


def local_table(params, specs, axes: tuple[str, ...], sizes, stacks: tuple[str, ...] = ()):
  """The local layouts of `params` (global arrays or shapes) laid out by `specs` (a tree of
  PartitionSpecs like `params`) inside ``shard_map`` manual over the mesh `axes` (sizes
  `sizes`: mesh axis name -> size); `stacks`: top-level keys of `params` that hold layer
  stacks (a scan slices their leaves along dimension 0).

  Returns (table, in_specs): table a tuple of (keystr path, (local shape, (split dim, axes)
  or None for a leaf passed in whole)); in_specs the tree of ``shard_map`` in_specs: the
  ZeRO-split dimension of each leaf that enters as its shard, P() (replicated) for the rest. A leaf of a layer
  stack split along dimension 0 (the layers) is passed in whole; so is a leaf split over
  axes outside `axes` or over more than one dimension.
  """
  table, in_specs = {}, []
  flat, treedef = jax.tree_util.tree_flatten_with_path(params)
  spec_leaves = treedef.flatten_up_to(specs)
  for (path, x), spec in zip(flat, spec_leaves):
    shape = tuple(np.shape(x))
    entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
    split = [(i, _axes_of(e)) for i, e in enumerate(entries) if e is not None]
    key = jax.tree_util.keystr(path)
    stacked = bool(path) and getattr(path[0], "key", None) in stacks
    if len(split) == 1 and not (stacked and split[0][0] == 0) and set(split[0][1]) <= set(axes):
      dim, on = split[0]
      local = list(shape)
      local[dim] //= int(np.prod([sizes[a] for a in on]))
      table[key] = (tuple(local), (dim, on))
      in_specs.append(P(*entries))
    else:
      table[key] = (shape, None)
      in_specs.append(P())
  return tuple(table.items()), jax.tree.unflatten(treedef, in_specs)


def _axes_of(entry) -> tuple[str, ...]:
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


_ACTIVE: contextvars.ContextVar[WeightGather | None] = contextvars.ContextVar(
    "fp8jax_weight_gather", default=None)


@contextlib.contextmanager
def gathering(gather: WeightGather | None) -> Iterator[WeightGather | None]:
  """Context in which models gather their parameters at use with `gather` (None: they use
  them as they come). Enter it around the *tracing* of the loss and its gradient."""
  if gather is not None and not isinstance(gather, WeightGather):
    raise TypeError(f"gathering: expected an fp8jax.fsdp.WeightGather or None, got "
                    f"{type(gather).__name__}")
  token = _ACTIVE.set(gather)
  try:
    yield gather
  finally:
    _ACTIVE.reset(token)


def active() -> WeightGather | None:
  """The :class:`WeightGather` of the innermost :func:`gathering` context, or None."""
  return _ACTIVE.get()


def key_path(names) -> str:
  """``jax.tree_util.keystr`` of the dict key path `names` (e.g. a Flax scope path)."""
  return "".join(f"[{str(n)!r}]" for n in names)


def constrain_bits(x, sharding: NamedSharding, *after):
  """`x` laid out as `sharding`, moved as its raw bits (uint of its width) between
  optimization barriers, so the collective XLA places moves exactly those bytes.

  `after`: values the move waits for (e.g. a backward's cotangent): it then cannot be merged
  with an identical earlier move, nor hoisted before them.
  `sharding` may be a :class:`Local` layout (inside ``shard_map``): the shard layout leaves
  `x` as it is, the gathered one all-gathers it along the split dimension.
  """
  if isinstance(sharding, Local) and not sharding.gathered:
    return x  # this device's shard is where it lives
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}"))
  bits = jax.lax.optimization_barrier((bits, *after))[0] if after else \
      jax.lax.optimization_barrier(bits)
  if isinstance(sharding, Local):
    bits = jax.lax.all_gather(bits, sharding.axes, axis=sharding.dim, tiled=True)
  else:
    bits = jax.lax.with_sharding_constraint(bits, sharding)
  bits = jax.lax.optimization_barrier(bits)
  return jax.lax.bitcast_convert_type(bits, x.dtype)


def sum_into(g, home, dtype):
  """Cotangent `g` summed over the devices into `home` (a NamedSharding, or a :class:`Local`
  shard layout: its ``reduce`` or an f32 ``psum_scatter``) in f32 (or wider), cast to
  `dtype`."""
  wide = jnp.promote_types(dtype, jnp.float32)
  if isinstance(home, Local):
    if home.reduce is not None:
      return home.reduce(g.astype(jnp.float32), home.axes, home.dim).astype(dtype)
    return jax.lax.psum_scatter(g.astype(wide), home.axes, scatter_dimension=home.dim,
                                tiled=True).astype(dtype)
  return jax.lax.with_sharding_constraint(g.astype(wide), home).astype(dtype)


def gather_value(x, home, full, *, dtype=None, scaled: bool = False):
  """`x` (laid out as `home`: a NamedSharding, or a :class:`Local` shard layout) moved to
  `full` as its raw bits, forwards only (no gradient rule; :func:`gather_array` adds one).

  `dtype`: None (`x` crosses as it is), or a float dtype: with `scaled` it crosses as that
  payload with a power-of-two f32 scale (one scale for every shard) and is read back in
  `x`'s dtype; without, `x` is cast to it and the result has that dtype.
  """
  move = lambda p: constrain_bits(constrain_bits(p, home), full)
  if dtype is None or np.dtype(dtype) == np.dtype(x.dtype):
    return move(x)
  if not scaled:
    return move(x.astype(dtype))
  agree = home.axes if isinstance(home, Local) else ()  # one scale for every shard
  q = quantize_scaled(x, dtype, power_of_two=True, axis_names=agree)
  return (move(q.data).astype(jnp.float32) * q.scale).astype(x.dtype)


def gather_array(x, home: NamedSharding, full: NamedSharding, *, dtype=None,
                 scaled: bool = False):
  """`x` (laid out as `home`) gathered to `full` (:func:`gather_value`), with a
  straight-through gradient reduce-scattered back to `home` in f32 (or `x`'s dtype if
  wider), then cast to `x`'s. A GEMM that multiplies the result keeps it for its backward:
  gather GEMM weights with :func:`gathered_dot_general` instead.
  """
  value = lambda x: gather_value(x, home, full, dtype=dtype, scaled=scaled)

  @jax.custom_vjp
  def gather(x):
    return value(x)

  gather.defvjp(lambda x: (value(x), None), lambda _, g: (sum_into(g, home, x.dtype),))
  return gather(x)


def gathered_dot_general(lhs, rhs, dimension_numbers, home: NamedSharding,
                         full: NamedSharding, *, precision=None, preferred_element_type=None,
                         keep_gathered: bool = False):
  """``lax.dot_general(lhs, rhs, ...)`` with `rhs` (a weight laid out as `home`) gathered to
  `full` for the GEMM as its own bits, and again in the backward from the shard it keeps (so
  a layer loop does not keep every layer's gathered weight; `keep_gathered`: it keeps the
  gathered weight instead, see :class:`WeightGather`); rhs's gradient is summed over the
  devices in f32 into `home`, then cast to rhs's dtype."""
  dot = lambda l, w: jax.lax.dot_general(l, w, dimension_numbers, precision=precision,
                                         preferred_element_type=preferred_element_type)

  def fwd(lhs, rhs):
    shard = constrain_bits(rhs, home)
    w = constrain_bits(shard, full)
    return dot(lhs, w), (lhs, w if keep_gathered else shard)

  def bwd(res, g):
    lhs, w = res
    if not keep_gathered:
      w = constrain_bits(w, full, g)
    dlhs, dw = jax.vjp(dot, lhs, w)[1](g)
    return dlhs, sum_into(dw, home, w.dtype)

  gemm = jax.custom_vjp(lambda lhs, rhs: fwd(lhs, rhs)[0])
  gemm.defvjp(fwd, bwd)
  return gemm(lhs, rhs)


def gather_tree(params, gather: WeightGather | None, *, matrix_dtype=None,
                kernels: bool = False, prefix: str = ""):
  """`params` with every leaf that `gather` splits over the ZeRO axes gathered
  (:func:`gather_array`), except leaves named "kernel" (their GEMM gathers them:
  :class:`fp8jax.linen.Fp8DotGeneral`, :class:`fp8jax.linen.DotGeneral`) unless `kernels`.
  `params` unchanged when `gather` is None.

  Args:
    params: a tree of parameters as a module (or one layer) uses them.
    gather: the active :class:`WeightGather` (:func:`active`), or None.
    matrix_dtype: the dtype the model computes its GEMMs in: GEMM weights (kernels,
      embeddings) cross and arrive in it (the model promotes them to it anyway); None: they
      cross like the other leaves.
    kernels: gather kernels here too (modules whose GEMM does not gather its weight: it
      crosses in `matrix_dtype` and its GEMM casts it).
    prefix: key path (keystr) of `params` in the whole parameter tree, for `gather.specs`.
  """
  if gather is None:
    return params

  def one(path, x):
    if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
      return x
    if leaf_name(path) == "kernel" and not kernels:
      return x  # its GEMM gathers it
    sh = gather.shardings(prefix + jax.tree_util.keystr(path), np.shape(x))
    if sh is None:
      return x
    if matrix_dtype is not None and is_gemm_weight(path):
      return gather_array(x, *sh, dtype=matrix_dtype)
    return gather_array(x, *sh, dtype=gather.payload_dtype, scaled=True)
  return jax.tree_util.tree_map_with_path(one, params)
