"""Sharded and multi-process training: the device mesh, ZeRO stages 1-3 with optimizer
offload, and ``initialize()`` for multi-host runs.

* :mod:`fp8jax.parallel.mesh`: :func:`make_mesh` (axes "data", "fsdp", "tensor", led by
  "pipe" with pipeline stages; -1 fills), :func:`mesh_from_config`, :func:`pipe_size`,
  :func:`device_kinds`, :func:`describe`.
* :mod:`fp8jax.parallel.pipeline`: pipeline parallelism (the GPipe and 1F1B schedules over
  "pipe", generic over the stage function; the stacked layers split over it).
* :mod:`fp8jax.parallel.zero`: :func:`state_shardings`, :func:`plan` -> :class:`ZeroPlan`
  (where the state lives, how weights are gathered and gradients laid out: stage 3 per use,
  ``ZeroPlan.weight_gather`` and :mod:`fp8jax.fsdp`), :func:`reduce_gradients`.
* :mod:`fp8jax.parallel.layout`: batch placement and data-parallel groups.
* :mod:`fp8jax.parallel.layout_rules`: which layouts (mesh sizes x batch x microbatches x ZeRO
  stage x model sizes) a run can take, as one-line refusals (``docs/layouts.md``).
* :mod:`fp8jax.parallel.grad_comm`: gradient sums over groups inside ``shard_map`` (f32 or
  FP8 reduce-scatter with its scaling state).
* :mod:`fp8jax.parallel.distributed`: :func:`initialize` (explicit arguments, the
  FP8JAX_* variables ``fp8jax launch`` sets, cluster auto-detection, or single process).
* :mod:`fp8jax.parallel.combine`: ``reduce_bucket_size`` -> XLA combine-threshold flags.
* :mod:`fp8jax.parallel.tensor`: tensor-parallel rules (heads and MLP width over "tensor").
* Heterogeneous meshes: :mod:`~fp8jax.parallel.capability` (FP8 native/emulated per process,
  agreed), :mod:`~fp8jax.parallel.balance` (microbatch counts per group),
  :mod:`~fp8jax.parallel.device_map` and :mod:`~fp8jax.parallel.profile` (throughputs),
  :mod:`~fp8jax.parallel.cost_model` (``fp8jax simulate``: step time of a mixed cluster).
* :mod:`fp8jax.parallel.step_memory`: bytes per GPU of a train step (the one memory model);
  :mod:`fp8jax.parallel.cost_inputs`: the model shape, modelling constants and bytes per
  parameter it and the cost model read.
* :mod:`fp8jax.parallel.sizing`: the fastest ZeRO stage x tensor x pipeline layout of N GPUs
  that fits (``fp8jax simulate --table``).
"""
from fp8jax.parallel.distributed import initialize
from fp8jax.parallel import combine
from fp8jax.parallel.layout import batch_sharding, put_global
from fp8jax.parallel.mesh import AXES, BATCH_AXES, DATA, FSDP, PIPE, TENSOR, describe, \
    device_kinds, make_mesh, mesh_from_config, mesh_shape, pipe_size
from fp8jax.parallel.zero import STAGES, ZERO_AXES, ZeroPlan, device_bytes, plan, \
    reduce_gradients, shard_spec, state_shardings, to_host

__all__ = [
    "combine", "initialize",
    "AXES", "BATCH_AXES", "DATA", "FSDP", "PIPE", "TENSOR", "describe", "device_kinds",
    "make_mesh", "mesh_from_config", "mesh_shape", "pipe_size",
    "STAGES", "ZERO_AXES", "ZeroPlan", "batch_sharding", "device_bytes",
    "plan", "put_global", "reduce_gradients", "shard_spec", "state_shardings", "to_host",
]
