"""Throughput-balanced microbatch counts for data-parallel groups of unequal speed.

SPMD needs equal shard shapes, so every data-parallel group (one device, or one ZeRO/FSDP
group) runs microbatches of the same size; a faster group runs *more* of them per step.
Given the seconds one microbatch takes on each group, :func:`balance_counts` assigns the
step's microbatches so the slowest group finishes first (minimum makespan). For identical
jobs on machines of different speeds, assigning each job to the machine that would finish it
earliest is optimal, so the greedy below is exact (the tests check it against brute force).

:func:`plan_microbatches` also picks the microbatch size from throughput profiles: the sizes
every group's memory admits, each balanced, the fastest kept.
"""
from __future__ import annotations

import heapq
import math
from typing import Mapping, NamedTuple, Sequence


class KindProfile(NamedTuple):
  """Measured (or assumed) speed of one device kind.

  seconds: {microbatch size (sequences): seconds per microbatch on one group}.
  fits: {microbatch size: whether it fits in memory}; sizes missing from it (or None) fit.
  """

  kind: str
  seconds: Mapping[int, float]
  fits: Mapping[int, bool] | None = None

  def admits(self, size: int) -> bool:
    """Whether microbatches of `size` sequences fit on this kind (and were measured)."""
    return size in self.seconds and (self.fits is None or self.fits.get(size, True))


class BalancePlan(NamedTuple):
  """The chosen split: microbatch size, count per group, predicted compute seconds."""

  microbatch_size: int
  counts: tuple[int, ...]
  seconds: float  # makespan: max over groups of count x seconds per microbatch
  uniform_counts: tuple[int, ...] | None  # the equal split, when the microbatches divide
  uniform_seconds: float | None


def _check_seconds(seconds: Sequence[float]) -> list[float]:
  out = [float(s) for s in seconds]
  if not out:
    raise ValueError("seconds_per_microbatch is empty; give one value per data-parallel group")
  bad = [s for s in out if not (s > 0 and math.isfinite(s))]
  if bad:
    raise ValueError(f"seconds per microbatch must be finite and > 0, got {bad[0]!r} in "
                     f"{out}")
  return out


def makespan(counts: Sequence[int], seconds_per_microbatch: Sequence[float]) -> float:
  """Seconds until the slowest group finishes: max_i counts[i] * seconds[i]."""
  return max(c * s for c, s in zip(counts, seconds_per_microbatch))


def balance_counts(seconds_per_microbatch: Sequence[float], total_microbatches: int,
                   max_counts: Sequence[int | None] | None = None) -> tuple[int, ...]:
  """Microbatch count per group (sum = `total_microbatches`) with the least makespan.

  Args:
    seconds_per_microbatch: one microbatch's seconds on each group (> 0).
    total_microbatches: microbatches in the step (>= 1).
    max_counts: optional cap per group (None: no cap), e.g. from a memory limit.
  Ties go to the lower group index, so the answer is deterministic (every process agrees).
  """
  seconds = _check_seconds(seconds_per_microbatch)
  if isinstance(total_microbatches, bool) or not isinstance(total_microbatches, int) or \
      total_microbatches < 1:
    raise ValueError(f"total_microbatches={total_microbatches!r} is not allowed; use an "
                     "integer >= 1")
  caps = list(max_counts) if max_counts is not None else [None] * len(seconds)
  if len(caps) != len(seconds):
    raise ValueError(f"max_counts has {len(caps)} entries for {len(seconds)} groups")
  room = sum(math.inf if c is None else c for c in caps)
  if room < total_microbatches:
    raise ValueError(f"{total_microbatches} microbatches do not fit: the groups' caps "
                     f"{caps} allow {room}; use a smaller batch or more devices")
  counts = [0] * len(seconds)
  heap = [(s, i) for i, s in enumerate(seconds) if caps[i] is None or caps[i] > 0]
  heapq.heapify(heap)  # (finish time of the group's next microbatch, group)
  for _ in range(total_microbatches):
    _, i = heapq.heappop(heap)
    counts[i] += 1
    if caps[i] is None or counts[i] < caps[i]:
      heapq.heappush(heap, ((counts[i] + 1) * seconds[i], i))
  return tuple(counts)


def uniform_counts(groups: int, total_microbatches: int) -> tuple[int, ...] | None:
  """The equal split, or None when `total_microbatches` does not divide by `groups`."""
  if total_microbatches % groups:
    return None
  return (total_microbatches // groups,) * groups


def plan_microbatches(group_kinds: Sequence[str], profiles: Mapping[str, KindProfile],
                      global_batch: int, sizes: Sequence[int] | None = None,
                      max_counts: Sequence[int | None] | None = None) -> BalancePlan:
  """The fastest balanced split of `global_batch` sequences over the groups.

  Args:
    group_kinds: the device kind of each data-parallel group, in mesh order.
    profiles: {kind: KindProfile} covering every kind in `group_kinds`.
    global_batch: sequences per optimizer step.
    sizes: candidate microbatch sizes (default: every size measured for all kinds).
  A size is a candidate when it divides `global_batch` and every kind admits it.
  """
  missing = sorted({k for k in group_kinds if k not in profiles})
  if missing:
    raise ValueError(f"no throughput profile for device kind(s) {missing}; known: "
                     f"{sorted(profiles)}. Run `fp8jax profile` on those devices or add them "
                     "to parallel.device_map")
  kinds = sorted(set(group_kinds))
  if sizes is None:
    sizes = sorted(set.intersection(*(set(profiles[k].seconds) for k in kinds)))
  candidates = [m for m in sizes if global_batch % m == 0 and
                all(profiles[k].admits(m) for k in kinds)]
  if not candidates:
    raise ValueError(f"no microbatch size in {list(sizes)} divides the global batch of "
                     f"{global_batch} sequences and fits every device kind "
                     f"({ {k: sorted(m for m in profiles[k].seconds if profiles[k].admits(m)) for k in kinds} }"
                     " admitted); measure smaller sizes or change the batch")
  best = None
  for m in candidates:
    seconds = [profiles[k].seconds[m] for k in group_kinds]
    total = global_batch // m
    try:
      counts = balance_counts(seconds, total, max_counts)
    except ValueError:
      continue
    uni = uniform_counts(len(group_kinds), total)
    plan = BalancePlan(m, counts, makespan(counts, seconds), uni,
                       None if uni is None else makespan(uni, seconds))
    if best is None or plan.seconds < best.seconds - 1e-12:
      best = plan
  if best is None:
    raise ValueError(f"the caps {list(max_counts or [])} leave no room for {global_batch} "
                     f"sequences at any microbatch size in {candidates}")
  return best
