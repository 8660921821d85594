"""Which parallel layouts a run can take: every divisibility and sharding rule in one place.

A run's layout is a handful of numbers (:class:`Layout`): the devices, the mesh sizes
(pipe x data x fsdp x tensor, one of data and fsdp may be -1: the devices left), the batch
and its microbatches, the ZeRO stage, the gradient communication, and the model sizes that
are split (layers over pipeline stages, heads and MLP width over "tensor"). :func:`check`
returns the first rule the numbers break as one line naming them, or None. The rules:

1. ``train.microbatches`` divides ``train.batch_size`` (a microbatch is a whole number of
   sequences, the same in every microbatch).
2. Pipeline stages: at least one microbatch per stage in a full step (``train.microbatches``;
   a batch ramp's smaller steps leave the rest as bubbles), and every stage holds the same
   number of consecutive layers (stages divide ``model.n_layers``).
3. Tensor parallelism: each size the model splits over "tensor" (the reference families:
   attention heads, key/value heads for LLaMA, and the MLP width ``d_ff``) divides by it.
   Nothing else is split over "tensor" (vocabulary and ``d_model`` stay whole; ZeRO shards a
   dimension only where it divides, and replicates the rest).
4. The mesh fits the devices (:func:`fp8jax.parallel.mesh.mesh_shape`: stages divide the
   devices, the fixed sizes multiply to the devices of a stage or divide them for a -1 size).
5. FP8 gradient communication (``parallel.grad_comm: fp8``) has at least 2 data-parallel
   ranks to reduce over.
6. Pipeline stages with tensor parallelism and ZeRO stage 2 or 3 over 2 or more data-parallel
   ranks are refused: XLA's SPMD partitioner cannot lay out that step (stage 2: the
   pipeline's stage-to-stage sends deadlock until a rendezvous timeout aborts the process;
   stage 3: a check failure aborts the compile). Any two of the three work.
7. Unless microbatches are balanced per group (``parallel.device_map``): a microbatch splits
   evenly over the data-parallel ranks (data x fsdp). Each rank runs the same share of every
   microbatch, the evaluation batch (one microbatch) is split the same way, and the pipeline
   schedule sends each rank's share between stages; with a share that does not divide, the
   batch cannot be placed (``IndivisibleError``) and the pipeline's stage-to-stage sends of
   an FP8 model deadlock in XLA (a rendezvous timeout that aborts the process).

The rules are pure (no devices, no JAX arrays): the config checks the ones its numbers
decide (rules 1-3, and 5-7 when the data-parallel size does not depend on the device count:
no -1 size), and the run checks them all once it knows its devices, before anything is
compiled (``fp8jax.train.build.check_layout``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from fp8jax.parallel.mesh import FILL, mesh_shape


class Layout(NamedTuple):
  """A run's layout numbers (config keys in parentheses).

  Attributes:
    devices: devices the run's mesh spans (every process's); None: not known yet.
    data, fsdp: data-parallel and ZeRO/FSDP mesh sizes (``parallel.data_parallel_size``,
      ``parallel.fsdp_size``; -1: the devices left).
    tensor, pipe: tensor-parallel size and pipeline stages (``parallel.tensor_parallel_size``,
      ``parallel.pipeline_parallel_size``).
    batch_size: sequences per optimizer step (``train.batch_size``).
    microbatches: microbatches per step (``train.microbatches``).
    zero_stage: the ZeRO stage the run uses (``Config.zero_stage()``).
    grad_comm: "native" or "fp8" (``Config.grad_comm()``).
    balanced: microbatches are counted per data-parallel group (``parallel.device_map``):
      each group runs whole microbatches, so a microbatch need not split over the groups.
    n_layers: the model's layers (None: not known, e.g. a builder's model).
    tensor_splits: ((config key, size), ...) of the model sizes split over "tensor".
  """

  devices: int | None = None
  data: int = FILL
  fsdp: int = 1
  tensor: int = 1
  pipe: int = 1
  batch_size: int = 1
  microbatches: int = 1
  zero_stage: int = 0
  grad_comm: str = "native"
  balanced: bool = False
  n_layers: int | None = None
  tensor_splits: tuple[tuple[str, int], ...] = ()


def data_ranks(layout: Layout) -> int | None:
  """Data-parallel ranks (data x fsdp: the groups that split the batch), or None when they
  depend on a device count that is not known (a -1 size without `devices`) or do not fit."""
  if FILL not in (layout.data, layout.fsdp):
    return layout.data * layout.fsdp
  if layout.devices is None:
    return None
  try:
    data, fsdp, _ = mesh_shape(layout.devices, layout.data, layout.fsdp, layout.tensor,
                               layout.pipe)
  except ValueError:
    return None
  return data * fsdp


def _mesh_words(layout: Layout) -> str:
  """The layout's devices and axis sizes, e.g. "8 devices: pipe=2 x data=4 x fsdp=1 x
  tensor=1"."""
  if layout.devices is None:
    return (f"parallel.data_parallel_size={layout.data} x parallel.fsdp_size={layout.fsdp}")
  data, fsdp = ((layout.data, layout.fsdp) if FILL not in (layout.data, layout.fsdp)
                else mesh_shape(layout.devices, layout.data, layout.fsdp, layout.tensor,
                                layout.pipe)[:2])
  return (f"{layout.devices} devices: pipe={layout.pipe} x data={data} x fsdp={fsdp} x "
          f"tensor={layout.tensor}")


def tensor_message(splits, tensor: int) -> str | None:
  """Rule 3: the first (key, size) of `splits` that `tensor` does not divide, in words;
  None when all divide."""
  for name, value in splits:
    if value % tensor:
      return (f"{name}={value} does not split over parallel.tensor_parallel_size={tensor}; "
              f"use a tensor size that divides {name}")
  return None


def check(layout: Layout) -> str | None:
  """The first rule (module docstring) that `layout` breaks, as one line naming the numbers
  and a way out; None when the layout can run (as far as the numbers known decide)."""
  b, k, pipe = layout.batch_size, layout.microbatches, layout.pipe
  if b % k:
    divisors = [d for d in range(1, b + 1) if b % d == 0]
    return (f"train.microbatches={k} does not divide train.batch_size={b}; use one of "
            f"{divisors[:16]}")
  if pipe > 1:
    where = f"parallel.pipeline_parallel_size={pipe}"
    if layout.n_layers is not None and layout.n_layers % pipe:
      return (f"{where} does not divide model.n_layers={layout.n_layers}: every stage holds "
              f"n_layers / pipeline_parallel_size consecutive layers; use a pipeline size "
              f"that divides {layout.n_layers}")
    if k < pipe:
      return (f"{where} needs train.microbatches >= {pipe} (one per stage at least; more "
              f"shrink the pipeline bubble (P-1)/(k+P-1)), got train.microbatches={k}")
  if layout.tensor > 1:
    message = tensor_message(layout.tensor_splits, layout.tensor)
    if message:
      return message
  if layout.devices is not None:
    try:
      mesh_shape(layout.devices, layout.data, layout.fsdp, layout.tensor, pipe)
    except ValueError as e:
      return (f"parallel: {e} (parallel.pipeline_parallel_size={pipe}, "
              f"data_parallel_size={layout.data}, fsdp_size={layout.fsdp}, "
              f"tensor_parallel_size={layout.tensor})")
  ranks = data_ranks(layout)
  if ranks is None:
    return None
  if layout.grad_comm == "fp8" and ranks < 2:
    return (f"parallel.grad_comm='fp8' needs at least 2 data-parallel ranks; this run has "
            f"{ranks} ({_mesh_words(layout)}); use parallel.grad_comm 'native' / "
            f"'auto' or more data-parallel ranks")
  if pipe > 1 and layout.tensor > 1 and layout.zero_stage >= 2 and ranks >= 2:
    return (f"parallel.zero_stage={layout.zero_stage} with parallel.pipeline_parallel_size="
            f"{pipe} and parallel.tensor_parallel_size={layout.tensor} over {ranks} "
            f"data-parallel ranks ({_mesh_words(layout)}) is not supported: XLA's "
            f"partitioner cannot lay out its gradients (stage 2: the pipeline's sends "
            f"deadlock; stage 3: it aborts while compiling); use zero_stage 0 or 1, or drop "
            f"pipeline or tensor parallelism")
  m = b // k
  if not layout.balanced and m % ranks:
    fit = k * ranks * math.ceil(m / ranks)
    return (f"train.batch_size={b} / train.microbatches={k} = {m} sequences per microbatch "
            f"do not split over the {ranks} data-parallel ranks ({_mesh_words(layout)}); "
            f"every rank runs an equal share of each microbatch: use a microbatch size that "
            f"is a multiple of {ranks} (e.g. train.batch_size={fit}) or fewer data-parallel "
            f"ranks")
  return None


def refuse(layout: Layout) -> None:
  """Raises ValueError with :func:`check`'s message when `layout` breaks a rule."""
  message = check(layout)
  if message is not None:
    raise ValueError(message)
