"""ZeRO stages 1/2/3 as shardings of the train state, for a ``jax.jit`` step over a mesh.

A :class:`ZeroPlan` says where every array of the state lives and how the step gathers
weights and reduces gradients; the step itself is built by ``fp8jax.train.step``.

What each stage shards over the ZeRO axes (default ``("data", "fsdp")``: every data-parallel
rank, as DeepSpeed does; pass ``axes=("fsdp",)`` to shard within the fsdp axis only and
replicate across "data", i.e. hybrid sharding):

* stage 0: nothing; plain data parallelism (batch sharded, gradients all-reduced).
* stage 1: optimizer state. Gradients are all-reduced, each rank updates its slice, the
  updated parameters are all-gathered.
* stage 2: also gradients: each microbatch's gradients are constrained to the sharded layout,
  so XLA reduce-scatters instead of all-reducing and the accumulators are 1/N.
* stage 3: also the (master) parameters, which stay sharded between uses: the step runs the
  loss under the plan's :meth:`ZeroPlan.weight_gather` (:mod:`fp8jax.fsdp`), so each
  parameter is gathered where the model uses it (per layer, inside the layer scan) and its
  gradient reduce-scattered there. Kernels of FP8 GEMMs (levels O1..O3) are cast to E4M3 as
  shards with the tensor's scale and all-gathered as those bytes (1 per parameter), which the
  GEMM multiplies directly: one rounding per step, as on one device. Other parameters cross
  in the model's compute dtype (GEMM weights) or the master payload dtype (FP16 with a
  power-of-two scale at O2/O3, lossless) or as stored (f32 at O0/O1).
  The per-group loop (``shard_map``) does the same with explicit collectives
  (``fp8jax.train.step.GroupLoop``).

Rule per array: shard the largest dimension divisible by the product of the ZeRO axes' sizes
(the first such on ties); replicate arrays where none divides, scalars, and the FP8 meta.
With a "tensor" axis, arrays a tensor-parallel rule names (:mod:`fp8jax.parallel.tensor`)
also split one dimension over it, in every stage; the ZeRO rule then picks another dimension.
With a "pipe" axis (pipeline stages), every array of the stacked layers (parameters, their
optimizer state and master weights, and the FP8 state) splits its leading layer axis over it
(:func:`fp8jax.parallel.pipeline.pipe_dim`: stage s holds layers [s L/P, (s+1) L/P)); the
ZeRO and tensor rules use the other dimensions.
The batch's first dimension is sharded over ("data", "fsdp")
(:func:`fp8jax.parallel.layout.batch_sharding`).

Optimizer offload keeps the optimizer state in host memory (``pinned_host``) between steps;
the step moves it to the device, updates it and moves it back.

The state is any NamedTuple with fields ``step``, ``params``, ``fp8``, ``opt_state``,
``comm`` (``fp8jax.train.state.TrainState``).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fp8jax.fsdp import WeightGather
from fp8jax.parallel.combine import combine_options
from fp8jax.parallel.layout import batch_sharding, put_global
from fp8jax.parallel.mesh import BATCH_AXES, PIPE, TENSOR
from fp8jax.parallel.pipeline import pipe_dim
from fp8jax.parallel.tensor import GPT_RULES, tensor_dim

STAGES = (0, 1, 2, 3)
ZERO_AXES = BATCH_AXES
HOST_MEMORY = "pinned_host"


def check_stage(stage) -> int:
  if isinstance(stage, bool) or stage not in STAGES:
    raise ValueError(f"ZeRO stage {stage!r} is not allowed; use one of {list(STAGES)}")
  return int(stage)


def _check_axes(mesh: Mesh, axes: Sequence[str]) -> tuple[str, ...]:
  axes = tuple(axes)
  missing = [a for a in axes if a not in mesh.shape]
  if not axes or missing:
    raise ValueError(f"ZeRO axes {list(axes)} are not allowed on a mesh with axes "
                     f"{list(mesh.axis_names)}; use a non-empty subset of them")
  return axes


def shard_spec(shape: Sequence[int], mesh: Mesh, axes: Sequence[str] = ZERO_AXES,
               tensor: int | None = None, pipe: int | None = None) -> P:
  """PartitionSpec sharding the largest dimension of `shape` divisible by the ZeRO axes' size
  over `axes` (not dimension `tensor`, which goes to the "tensor" axis when given, nor
  dimension `pipe`, which goes to the "pipe" axis); P() (replicated) when nothing is split."""
  n = math.prod(mesh.shape[a] for a in axes)
  spec: list[Any] = [None] * len(shape)
  if tensor is not None:
    spec[tensor] = TENSOR
  if pipe is not None:
    spec[pipe] = PIPE
  dims = [i for i, d in enumerate(shape) if d % n == 0 and d > 0 and i not in (tensor, pipe)]
  if n > 1 and dims:
    spec[max(dims, key=lambda i: (shape[i], -i))] = tuple(axes)
  return P(*spec) if any(a is not None for a in spec) else P()


def leaf_spec(path, shape: Sequence[int], mesh: Mesh, axes: Sequence[str], zero: bool,
              rules: Sequence = GPT_RULES) -> P:
  """The spec of the state array at `path`: its layer axis over "pipe" (stacked layers, with
  pipeline stages), its tensor-parallel dimension (if a rule names it) over "tensor", and,
  when `zero`, the ZeRO rule of :func:`shard_spec` over `axes`."""
  key = jax.tree_util.keystr(tuple(path))
  tensor = tensor_dim(key, shape, mesh, rules)
  return shard_spec(shape, mesh, axes if zero else (), tensor, pipe_dim(key, shape, mesh))


def sharded(tree, mesh: Mesh, axes: Sequence[str] = ZERO_AXES, memory_kind: str | None = None,
            rules: Sequence = GPT_RULES):
  """NamedShardings, one per array leaf of `tree`: ZeRO-sharded by :func:`shard_spec`, plus
  tensor-parallel dimensions (:mod:`fp8jax.parallel.tensor`) when the mesh has them."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, leaf_spec(path, np.shape(x), mesh, axes, True, rules),
                                    memory_kind=memory_kind), tree)


def replicated(tree, mesh: Mesh, rules: Sequence = GPT_RULES):
  """A NamedSharding per leaf of `tree`, replicated over the ZeRO axes (tensor-parallel
  dimensions still split over "tensor", stacked layers over "pipe")."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: NamedSharding(mesh, leaf_spec(path, np.shape(x), mesh, (), False, rules)),
      tree)


def state_shardings(state, mesh: Mesh, stage: int, *,
                    axes: Sequence[str] = ZERO_AXES, offload: bool = False,
                    rules: Sequence = GPT_RULES):
  """`state` (arrays or shapes) with a NamedSharding in place of every leaf, for ZeRO
  `stage` (see the module docstring).

  `offload` puts the optimizer state in host memory (needs stage >= 1).
  """
  stage, axes = check_stage(stage), _check_axes(mesh, axes)
  if offload and stage == 0:
    raise ValueError("offload_optimizer=True is not allowed with ZeRO stage 0; use stage 1, 2 "
                     "or 3 (the offloaded optimizer state is the sharded one)")
  params = (sharded(state.params, mesh, axes, rules=rules) if stage >= 3
            else replicated(state.params, mesh, rules))
  opt = (sharded(state.opt_state, mesh, axes, HOST_MEMORY if offload else None, rules)
         if stage >= 1 else replicated(state.opt_state, mesh, rules))
  fp8 = jax.tree_util.tree_map_with_path(  # scalars, histories: whole (by layer over "pipe")
      lambda path, x: NamedSharding(mesh, shard_spec(
          np.shape(x), mesh, (), None, pipe_dim(jax.tree_util.keystr(path), np.shape(x), mesh))),
      state.fp8)
  comm = jax.tree.map(lambda _: NamedSharding(mesh, P()), state.comm)  # grad-comm scaling
  return state._replace(step=NamedSharding(mesh, P()), params=params, fp8=fp8, opt_state=opt,
                        comm=comm)


def _constrain(tree, mesh: Mesh, axes, shard: bool, rules: Sequence = GPT_RULES):
  def one(path, x):
    spec = leaf_spec(path, x.shape, mesh, axes, shard, rules)
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
  return jax.tree_util.tree_map_with_path(one, tree)


def reduce_gradients(grads, mesh: Mesh, stage: int, axes: Sequence[str] = ZERO_AXES,
                     rules: Sequence = GPT_RULES):
  """Parameter gradients summed over the data-parallel ranks: all-reduced (stage <= 1) or
  reduce-scattered to the ZeRO layout (stage >= 2), by constraining their sharding.

  Hook: this is where FP8 gradient collectives (``fp8jax.parallel.collectives``) plug in;
  here XLA chooses the collective and reduces in the gradients' own dtype.
  """
  return _constrain(grads, mesh, axes, stage >= 2, rules)


@dataclasses.dataclass(frozen=True)
class LeafSpecs:
  """``(path, shape) -> (home, gathered)`` PartitionSpecs of a parameter as
  :func:`leaf_spec` lays it out, sharded over `axes` and not (``fp8jax.fsdp.Specs``).
  `in_stage`: paths and shapes are as a pipeline stage's code sees them (inside
  ``jax.shard_map`` manual over "pipe", one layer of the stack at a time): no dimension goes
  to "pipe"."""

  mesh: Mesh
  axes: tuple[str, ...]
  rules: tuple = GPT_RULES
  in_stage: bool = False

  def __call__(self, path: str, shape) -> tuple[P, P]:
    tensor = tensor_dim(path, shape, self.mesh, self.rules)
    pipe = None if self.in_stage else pipe_dim(path, shape, self.mesh)
    return (shard_spec(shape, self.mesh, self.axes, tensor, pipe),
            shard_spec(shape, self.mesh, (), tensor, pipe))


@dataclasses.dataclass(frozen=True)
class ZeroPlan:
  """How one train state is laid out and stepped over a mesh.

  Attributes:
    mesh: the device mesh.
    stage: ZeRO stage 0..3.
    state: the train state's NamedShardings (see :func:`state_shardings`).
    batch: NamedSharding of a batch int32[B, T+1].
    axes: mesh axes the ZeRO state is sharded over.
    offload: optimizer state kept in host memory between steps.
    payload_dtype: dtype other stage-3 parameters are gathered in (None: as stored).
    compiler_options: XLA compile options of the step (``combine.combine_options``).
  """

  mesh: Mesh
  stage: int
  state: Any
  batch: NamedSharding
  axes: tuple[str, ...] = ZERO_AXES
  offload: bool = False
  payload_dtype: Any = None
  compiler_options: dict | None = None
  rules: tuple = GPT_RULES

  def shard_state(self, state):
    """`state` (same value on every process) placed on the mesh."""
    return jax.tree.map(put_global, state, self.state)

  def shard_batch(self, batch) -> jax.Array:
    """A global batch int32[B, T+1] (same on every process) placed on the mesh."""
    return put_global(batch, self.batch)

  def weight_gather(self, in_stage: bool = False) -> WeightGather | None:
    """Stage 3: how the step gathers each parameter where it is used
    (:mod:`fp8jax.fsdp`: kernels inside their GEMM, as E4M3 bytes for FP8 GEMMs; other
    parameters in this plan's payload dtype); None below. `in_stage`: for the code of a
    pipeline stage (:class:`LeafSpecs`)."""
    if self.stage < 3:
      return None
    return WeightGather(self.mesh, LeafSpecs(self.mesh, self.axes, self.rules, in_stage),
                        payload_dtype=self.payload_dtype)

  def reduce_fn(self) -> Callable | None:
    """Stages 1-3: ``grads -> grads`` laying parameter gradients out as
    :func:`reduce_gradients` does (all-reduced, or reduce-scattered from stage 2); None at
    stage 0 (XLA all-reduces them where the replicated update needs them)."""
    if self.stage < 1:
      return None
    return lambda g: reduce_gradients(g, self.mesh, self.stage, self.axes, self.rules)

  def to_device(self, state):
    """`state` with an offloaded optimizer state moved to device memory (inside a step)."""
    if not self.offload:
      return state
    dev = jax.tree.map(lambda s: s.with_memory_kind("device"), self.state.opt_state)
    return state._replace(opt_state=jax.device_put(state.opt_state, dev))

  def to_home(self, state):
    """`state` with its optimizer state moved back where it lives between steps."""
    if not self.offload:
      return state
    return state._replace(opt_state=jax.device_put(state.opt_state, self.state.opt_state))


def plan(state, mesh: Mesh, stage: int, *, level=None, offload: bool = False,
         axes: Sequence[str] = ZERO_AXES, reduce_bucket_size: int | None = None,
         allgather_bucket_size: int | None = None,
         tensor_rules: Sequence = GPT_RULES) -> ZeroPlan:
  """The :class:`ZeroPlan` of `state` (arrays or ``jax.ShapeDtypeStruct``s) for ZeRO `stage`
  on `mesh`.

  `level` (an ``fp8jax.OptLevel``) decides how stage 3 gathers parameters other than GEMM
  kernels: in its master dtype when that is narrower than f32 (kernels of FP8 GEMMs are
  gathered as E4M3 by their GEMM whatever the level). The bucket
  sizes (bytes) become XLA combine thresholds (:mod:`fp8jax.parallel.combine`).
  `tensor_rules` split parameters over the mesh's "tensor" axis (:mod:`fp8jax.parallel.tensor`;
  the default suits the reference model).
  """
  options = combine_options(reduce_bucket_size, allgather_bucket_size)
  axes = _check_axes(mesh, axes)
  rules = tuple(tensor_rules)
  shardings = state_shardings(state, mesh, stage, axes=axes, offload=offload, rules=rules)
  payload = None
  if level is not None and level.scaled_master:
    payload = np.dtype(level.master_dtype)
  return ZeroPlan(mesh, check_stage(stage), shardings, batch_sharding(mesh), axes, offload,
                  payload, options, rules)


def device_bytes(tree) -> dict:
  """{device: bytes of `tree`'s shards it holds} over this process's devices."""
  out: dict = {}
  for leaf in jax.tree.leaves(tree):
    for shard in leaf.addressable_shards:
      out[shard.device] = out.get(shard.device, 0) + shard.data.nbytes
  return out


def to_host(tree):
  """Global numpy values of a tree of (possibly multi-process) arrays."""
  from jax.experimental import multihost_utils

  def one(x):
    if getattr(x, "is_fully_addressable", True):
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(one, tree)
