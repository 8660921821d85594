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

from fp8jax.optim.scaled import quantize_scaled
from fp8jax.params import is_gemm_weight, leaf_name

# (key path as jax.tree_util.keystr, shape) -> (home spec, gathered spec)
Specs = Callable[[str, tuple], tuple[P, P]]


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

  def shardings(self, path: str, shape) -> tuple[NamedSharding, NamedSharding] | None:
    """(home, gathered) NamedShardings of the parameter at `path` with `shape`; None when it
    is not split over the ZeRO axes (nothing to gather)."""
    home, full = self.specs(path, tuple(shape))
    if home == full:
      return None
    return NamedSharding(self.mesh, home), NamedSharding(self.mesh, full)


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
  """
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}"))
  bits = jax.lax.optimization_barrier((bits, *after))[0] if after else \
      jax.lax.optimization_barrier(bits)
  bits = jax.lax.optimization_barrier(jax.lax.with_sharding_constraint(bits, sharding))
  return jax.lax.bitcast_convert_type(bits, x.dtype)


def _sum_into(g, home: NamedSharding, dtype):
  """Cotangent `g` summed over the devices into `home` in f32 (or wider), cast to `dtype`."""
  wide = jnp.promote_types(dtype, jnp.float32)
  return jax.lax.with_sharding_constraint(g.astype(wide), home).astype(dtype)


def gather_array(x, home: NamedSharding, full: NamedSharding, *, dtype=None,
                 scaled: bool = False):
  """`x` (laid out as `home`) gathered to `full`, with a straight-through gradient
  reduce-scattered back to `home` in f32 (or `x`'s dtype if wider), then cast to `x`'s.

  `dtype`: None (`x` crosses as it is), or a float dtype: with `scaled` it crosses as that
  payload with a power-of-two f32 scale and is read back in `x`'s dtype; without, `x` is cast
  to it and the result has that dtype. A GEMM that multiplies the result keeps it for its
  backward: gather GEMM weights with :func:`gathered_dot_general` instead.
  """
  move = lambda p: constrain_bits(constrain_bits(p, home), full)

  def value(x):
    if dtype is None or np.dtype(dtype) == np.dtype(x.dtype):
      return move(x)
    if not scaled:
      return move(x.astype(dtype))
    q = quantize_scaled(x, dtype, power_of_two=True)
    return (move(q.data).astype(jnp.float32) * q.scale).astype(x.dtype)

  @jax.custom_vjp
  def gather(x):
    return value(x)

  gather.defvjp(lambda x: (value(x), None), lambda _, g: (_sum_into(g, home, x.dtype),))
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
    return dlhs, _sum_into(dw, home, w.dtype)

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
    kernels: gather kernels here too (modules whose GEMM does not gather its weight).
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
