"""FP8 capability agreement: which processes run FP8 GEMMs natively, decided once for the run.

Each process reports its devices (:func:`fp8jax.hardware.local_report`); the reports are
all-gathered (:func:`gather_reports`) and every process computes the same
:class:`~fp8jax.hardware.CapabilityPlan` from the same list (:func:`decide`), which
:func:`agree` installs (:func:`fp8jax.hardware.install_plan`): every FP8 GEMM traced
afterwards follows it. Where FP8 GEMMs cannot run natively (compute capability < 8.9: A100,
V100, CPU) the identical quantized math runs emulated: FP8 values are upcast exactly (to BF16
on GPUs, F32 on CPUs) and multiplied with f32 accumulation, so FP8 storage, FP8 activations
and FP8 communication, with their memory and bandwidth savings, are kept.

Policies:
  * ``per_kind`` (default): native on the processes whose devices support it, emulated on the
    others. The processes' programs then differ only inside their local GEMMs; every
    collective is the same.
  * ``uniform``: if any process lacks FP8 GEMMs, every process emulates (one program for all).

One process drives one homogeneous set of devices: a process that sees mixed kinds is refused
(XLA compiles one executable per process, for one device model).
"""
from __future__ import annotations

import json
import logging
from typing import Sequence

import jax
import numpy as np

from fp8jax.hardware import CapabilityPlan, DeviceReport, device_reason, install_plan, \
    local_report

logger = logging.getLogger("fp8jax")

POLICIES = ("per_kind", "uniform")
_REPORT_BYTES = 1024  # fixed width of one encoded report in the all-gather


def _encode(report: DeviceReport) -> np.ndarray:
  raw = json.dumps(report._asdict()).encode()
  if len(raw) > _REPORT_BYTES:
    raise ValueError(f"device report of {len(raw)} bytes exceeds {_REPORT_BYTES}: {raw!r}")
  out = np.zeros(_REPORT_BYTES, np.uint8)
  out[:len(raw)] = np.frombuffer(raw, np.uint8)
  return out


def _decode(row: np.ndarray) -> DeviceReport:
  raw = bytes(np.asarray(row, np.uint8)).rstrip(b"\0")
  return DeviceReport(**json.loads(raw))


def gather_reports(local: DeviceReport | None = None) -> tuple[DeviceReport, ...]:
  """Every process's report, ordered by process index (a collective: all processes call it).

  `local` replaces this process's own report (tests use it to play other device kinds).
  """
  local = local_report() if local is None else local
  if jax.process_count() == 1:
    return (local,)
  from jax.experimental import multihost_utils
  rows = np.asarray(multihost_utils.process_allgather(_encode(local)))
  reports = sorted((_decode(r) for r in rows.reshape(jax.process_count(), -1)),
                   key=lambda r: r.process_index)
  return tuple(reports)


def decide(reports: Sequence[DeviceReport], policy: str = "per_kind") -> CapabilityPlan:
  """The plan for `reports` (a pure function: the same reports give the same plan)."""
  if policy not in POLICIES:
    raise ValueError(f"FP8 capability policy {policy!r} is not allowed; use one of {POLICIES}")
  reports = tuple(sorted(reports, key=lambda r: r.process_index))
  if [r.process_index for r in reports] != list(range(len(reports))):
    raise ValueError(f"reports cover processes {[r.process_index for r in reports]}; need "
                     f"each of 0..{len(reports) - 1} once")
  reasons = [device_reason(r) for r in reports]
  if policy == "uniform" and any(reasons):
    first = next(i for i, why in enumerate(reasons) if why)
    shared = f"process {first}: {reasons[first]}"
    reasons = [why or f"uniform policy, {shared}" for why in reasons]
  return CapabilityPlan(reports, tuple(why is None for why in reasons), tuple(reasons), policy)


def agree(policy: str = "per_kind", local: DeviceReport | None = None) -> CapabilityPlan:
  """Gathers every process's report, decides, installs and logs the plan; returns it."""
  plan = decide(gather_reports(local), policy)
  install_plan(plan)
  for line in plan.lines():
    logger.info("fp8jax capability: %s", line)
  return plan
