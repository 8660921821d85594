"""FP8 capability agreement: which processes run FP8 GEMMs natively, decided once for the run.

Each process reports its device kind and compute capability (:func:`local_report`); the
reports are all-gathered (:func:`gather_reports`) and every process computes the same
:class:`CapabilityPlan` from the same list (:func:`decide`). FP8 GEMMs need a GPU of compute
capability >= 8.9 (Ada, Hopper, Blackwell). Elsewhere (A100, V100, CPU) the identical quantized
math runs emulated: FP8 values are upcast exactly (to BF16 on GPUs, F32 on CPUs) and multiplied
with f32 accumulation, so FP8 storage, FP8 activations and FP8 communication, with their
memory and bandwidth savings, are kept.

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
from typing import NamedTuple, Sequence

import jax
import numpy as np

logger = logging.getLogger("fp8jax")

MIN_CAPABILITY = (8, 9)  # first compute capability with FP8 tensor cores (Ada)
POLICIES = ("per_kind", "uniform")
_REPORT_BYTES = 1024  # fixed width of one encoded report in the all-gather


class MixedDevicesError(ValueError):
  """One process sees devices of different kinds."""


class DeviceReport(NamedTuple):
  """What one process runs on."""

  process_index: int
  platform: str  # "gpu", "cpu", "tpu"
  device_kind: str  # as jax reports it, e.g. "NVIDIA H100 80GB HBM3"
  compute_capability: str | None  # "9.0" on CUDA GPUs, else None
  device_count: int  # local devices
  memory_bytes: int | None = None  # per device, when the runtime says


class CapabilityPlan(NamedTuple):
  """The run's decision, identical on every process: FP8 GEMMs native or emulated per
  process (index = process index), with the reason where emulated."""

  reports: tuple[DeviceReport, ...]
  native: tuple[bool, ...]
  reasons: tuple[str | None, ...]
  policy: str

  def native_on(self, process_index: int) -> bool:
    return self.native[process_index]

  def reason_on(self, process_index: int) -> str | None:
    """Why process `process_index` emulates FP8 GEMMs (None: native)."""
    return self.reasons[process_index]

  def lines(self) -> list[str]:
    """One line per process for the start-of-run log."""
    out = []
    for r, native, why in zip(self.reports, self.native, self.reasons):
      cc = f", sm {r.compute_capability}" if r.compute_capability else ""
      mode = "native FP8 GEMMs" if native else f"FP8 GEMMs emulated ({why})"
      out.append(f"process {r.process_index}: {r.device_count} x {r.device_kind} "
                 f"({r.platform}{cc}): {mode}")
    return out


def _capability(compute_capability: str | None) -> tuple[int, int] | None:
  if not compute_capability:
    return None
  major, _, minor = str(compute_capability).partition(".")
  return int(major), int(minor or 0)


def device_reason(report: DeviceReport) -> str | None:
  """None when `report`'s devices run FP8 GEMMs, else why not."""
  if report.platform != "gpu":
    return f"{report.device_kind!r} ({report.platform}) has no FP8 GEMMs"
  cc = _capability(report.compute_capability)
  if cc is None:
    return f"{report.device_kind!r} reports no compute capability"
  if cc < MIN_CAPABILITY:
    return f"{report.device_kind!r} has compute capability {cc[0]}.{cc[1]} < 8.9"
  return None


def local_report(devices: Sequence | None = None) -> DeviceReport:
  """This process's :class:`DeviceReport` (default devices: ``jax.local_devices()``).

  Raises MixedDevicesError when the devices are of more than one kind.
  """
  devices = list(jax.local_devices() if devices is None else devices)
  if not devices:
    raise ValueError("local_report: no devices")
  kinds = sorted({(d.platform, d.device_kind) for d in devices})
  if len(kinds) > 1:
    raise MixedDevicesError(
        f"process {jax.process_index()} sees devices of {len(kinds)} kinds "
        f"({', '.join(k for _, k in kinds)}); fp8jax drives one device kind per process. "
        "Launch one process per kind, each seeing only its own devices, e.g. "
        "`CUDA_VISIBLE_DEVICES=0,1 ...` for the first kind and `CUDA_VISIBLE_DEVICES=2,3 ...` "
        "for the second, joined by jax.distributed (fp8jax launch, or your cluster's launcher)")
  d = devices[0]
  cc = getattr(d, "compute_capability", None)
  memory = None
  try:
    stats = d.memory_stats() or {}
    memory = int(stats["bytes_limit"]) if "bytes_limit" in stats else None
  except Exception:  # CPU devices and some runtimes have no memory stats
    memory = None
  return DeviceReport(jax.process_index(), d.platform, d.device_kind,
                      None if cc is None else str(cc), len(devices), memory)


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


_ACTIVE: CapabilityPlan | None = None


def active_plan() -> CapabilityPlan | None:
  """The plan installed by :func:`agree` (None: FP8 GEMMs decided from all devices)."""
  return _ACTIVE


def install(plan: CapabilityPlan | None) -> None:
  """Makes `plan` the one FP8 dots follow in this process (None: back to the default,
  native only when every device of the run supports it)."""
  global _ACTIVE
  _ACTIVE = plan
  from fp8jax import dot
  dot.native_fp8_reason.cache_clear()


def agree(policy: str = "per_kind", local: DeviceReport | None = None) -> CapabilityPlan:
  """Gathers every process's report, decides, installs and logs the plan; returns it."""
  plan = decide(gather_reports(local), policy)
  install(plan)
  for line in plan.lines():
    logger.info("fp8jax capability: %s", line)
  return plan
