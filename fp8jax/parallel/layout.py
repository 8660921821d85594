"""Where a global batch lives on the mesh: data-parallel groups, placement, per-group layouts.

The batch axes are the mesh axes that split sequences (:data:`BATCH_AXES`: ``("data",
"fsdp")``, every data-parallel rank, as DeepSpeed's ZeRO). A *group* is one position along
those axes (the devices that share one slice of the batch; other axes replicate within it).

Layouts of a global batch int32[B, T+1] (the same on every process):

* uniform: ``[B, T+1]`` with its first dimension sharded over the batch axes
  (:func:`batch_sharding`);
* per group: ``[G, n, m, T+1]`` sharded over the groups, where group g runs its own number of
  microbatches of m sequences (:func:`layout_counts`, the rest of its n slots is padding) or
  every group runs all n microbatches on its 1/G of each (:func:`layout_split`).
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fp8jax.parallel.mesh import BATCH_AXES


def group_axes(mesh: Mesh, axes: Sequence[str] = BATCH_AXES) -> tuple[str, ...]:
  """The mesh axes that split the batch (those of `axes` present in `mesh`)."""
  out = tuple(a for a in axes if a in mesh.shape)
  if not out:
    raise ValueError(f"mesh axes {tuple(mesh.shape)} contain none of {tuple(axes)}")
  return out


def group_count(mesh: Mesh, axes: Sequence[str] = BATCH_AXES) -> int:
  """Number of data-parallel groups G."""
  return int(np.prod([mesh.shape[a] for a in group_axes(mesh, axes)]))


def group_devices(mesh: Mesh, axes: Sequence[str] = BATCH_AXES) -> list:
  """The first device of each group, in group order (for its kind)."""
  names = list(mesh.axis_names)
  keep = group_axes(mesh, axes)
  devices = np.moveaxis(mesh.devices, [names.index(a) for a in keep], list(range(len(keep))))
  return list(devices.reshape(group_count(mesh, axes), -1)[:, 0])


def microbatches_sharding(mesh: Mesh, rows: int,
                          axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
  """Where microbatches [k, `rows`, ...] live: their sequences split over the longest prefix
  of the batch axes (:func:`group_axes`) whose ranks they fill evenly, whole on every rank
  when none does (a balanced run's microbatch of fewer sequences than ranks). An uneven
  split would pad, and the partitioner's resharding of the padding moves data between ranks
  inside the pipeline's per-stage branches, which not every rank takes."""
  keep, size = [], 1
  for a in group_axes(mesh, axes):
    if rows % (size * mesh.shape[a]):
      break
    keep.append(a)
    size *= mesh.shape[a]
  return NamedSharding(mesh, P(None, tuple(keep)) if keep else P())


def batch_sharding(mesh: Mesh, axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
  """First dimension (sequences, or groups of a per-group layout) over the batch axes."""
  return NamedSharding(mesh, P(group_axes(mesh, axes)))


def replicated(mesh: Mesh) -> NamedSharding:
  """The same value on every device of `mesh`."""
  return NamedSharding(mesh, P())


def put_global(x, sharding: NamedSharding) -> jax.Array:
  """A host array that every process holds in full, placed with `sharding`."""
  x = np.asarray(x)
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def layout_counts(batch: np.ndarray, counts: Sequence[int], microbatch_size: int) -> np.ndarray:
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
  `microbatches` microbatches, each on its 1/G of the microbatch's sequences (the split the
  uniform layout gives)."""
  b = batch.shape[0]
  if b % (microbatches * groups):
    raise ValueError(f"batch of {b} sequences does not split into {microbatches} microbatches "
                     f"x {groups} data-parallel groups")
  parts = batch.reshape(microbatches, groups, b // (microbatches * groups), *batch.shape[1:])
  return np.ascontiguousarray(np.swapaxes(parts, 0, 1))
