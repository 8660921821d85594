"""A jitted train step and the placement of its host batch: microbatch counts, padding."""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from fp8jax.parallel import layout
from fp8jax.parallel.zero import ZeroPlan


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

  def lower(self, state, batch):
    """The step's program for these arguments, lowered (``jax.stages.Lowered``): compiling
    it compiles what :meth:`__call__` runs on arguments of the same shapes."""
    return self.jitted.lower(state, *self.place(batch))


def microbatch_count(batch, microbatches: int, microbatch_size: int | None,
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


def batch_placement(plan: ZeroPlan, dynamic: bool, microbatches: int,
                     microbatch_size: int | None):
  """(place, batch shardings) of a step taking ``batch int32[B, T+1]`` sharded over the
  plan's batch axes, and with `dynamic` the batch padded to `microbatches` microbatches plus
  its count k (an int32 scalar, replicated)."""
  sharding = plan.batch  # the batch axes (not the ZeRO axes, which may be fewer)
  if not dynamic:
    return (lambda batch: (layout.put_global(batch, sharding),)), (sharding,)
  rows, scalar = microbatches * microbatch_size, layout.replicated(plan.mesh)
  place = lambda batch: (
      layout.put_global(pad_to(batch, 0, rows), sharding),
      layout.put_global(np.int32(microbatch_count(batch, microbatches, microbatch_size,
                                                   True)), scalar))
  return place, (sharding, scalar)


def checked_counts(counts: Sequence[int], k: int, groups: int) -> tuple[int, ...]:
  """`counts` as a tuple of ints; ValueError unless one count >= 0 per group summing to k."""
  counts = tuple(int(c) for c in counts)
  if len(counts) != groups or sum(counts) != k or min(counts) < 0:
    raise ValueError(f"counts {counts} must give each of the {groups} data-parallel groups a "
                     f"count >= 0, summing to the step's {k} microbatches")
  return counts


def pad_to(x: np.ndarray, axis: int, size: int) -> np.ndarray:
  """`x` zero-padded at the end of `axis` to `size` (the slots no loop reads)."""
  if x.shape[axis] == size:
    return x
  width = [(0, 0)] * x.ndim
  width[axis] = (0, size - x.shape[axis])
  return np.pad(x, width)

