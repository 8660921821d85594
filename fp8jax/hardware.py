"""Hardware facts, each written once: GPU kinds, peak FLOP/s, memory, links, FP8 capability.

* Kinds: :func:`kind_name` reads a jax ``device_kind`` ("NVIDIA H100 80GB HBM3") or a short
  name ("H100-SXM") and returns the canonical name used by the tables below.
* :data:`PEAK_FLOPS`: dense (no sparsity) peak FLOP/s per chip, BF16 and FP8
  (:func:`peak_flops`; MFU is reported against these).
* :data:`MEMORY`: HBM bytes and bandwidth, NVLink bandwidth per GPU kind; :data:`GPU_SPECS`
  joins both tables (:func:`gpu_spec`) for the kinds whose memory is known.
* FP8 GEMMs need a GPU of compute capability >= :data:`MIN_CAPABILITY` (8.9: Ada, Hopper,
  Blackwell). :func:`local_report` describes this process's devices as a
  :class:`DeviceReport`; :func:`device_reason` says why a report's devices cannot run FP8
  GEMMs (None: they can).
* cuDNN flash attention: :func:`cudnn_attention_head_dim` (the largest head dim it takes on a
  report's devices; None: it does not run there).
* This process's FP8 GEMM decision: :func:`native_fp8_reason` (read by every FP8 GEMM at
  trace time). By default GEMMs are native only when every device of the run supports them;
  :func:`install_plan` replaces that with a :class:`CapabilityPlan` agreed by all processes
  (:func:`fp8jax.parallel.capability.agree`) or chosen by hand (tests, benchmarks).

Units: FLOP/s, bytes, bytes/s (per direction for links).
"""
from __future__ import annotations

import functools
import re
from typing import NamedTuple, Sequence

import jax

MiB, GiB = 2**20, 2**30

# ----------------------------------------------------------------------------- kinds and tables

# Dense peak FLOP/s per chip (vendor datasheets, no sparsity): (BF16, FP8). FP8 None: the chip
# has no FP8 tensor cores (fp8jax emulates FP8 GEMMs there).
PEAK_FLOPS: dict[str, tuple[float, float | None]] = {
    "A100": (312e12, None),
    "A10": (125e12, None),
    "V100": (125e12, None),
    "H100-SXM": (989e12, 1979e12),
    "H100-PCIe": (756e12, 1513e12),
    "H200": (989e12, 1979e12),
    "H800": (989e12, 1979e12),
    "GH200": (989e12, 1979e12),
    "B200": (2250e12, 4500e12),
    "L40S": (362e12, 733e12),
    "L4": (121e12, 242e12),
    "RTX 4090": (165e12, 330e12),
}

# GPU kinds whose chip in PEAK_FLOPS has another name (the memory size tells A100s apart).
_CHIP = {"A100-40GB": "A100", "A100-80GB": "A100"}

# Memory and links per GPU kind (vendor datasheets): (HBM MiB as nvidia-smi reports it, HBM
# bytes/s, intra-node bytes/s per GPU per direction). NVLink: half the bidirectional figure
# (A100 600 GB/s, H100/H200 900, H800 400, B200 1800); parts without NVLink: PCIe Gen5
# (H100-PCIe) / Gen4 (L40S) x16.
MEMORY: dict[str, tuple[int, float, float]] = {
    "A100-40GB": (40960, 1.555e12, 300e9),
    "A100-80GB": (81920, 2.039e12, 300e9),
    "H100-SXM": (81559, 3.35e12, 450e9),
    "H100-PCIe": (81559, 2.0e12, 64e9),
    "H200": (143771, 4.8e12, 450e9),
    "H800": (81559, 3.35e12, 200e9),
    "L40S": (46068, 0.864e12, 32e9),
    "B200": (183359, 8.0e12, 900e9),
}

# (name, substrings that must all occur, substrings that must not) in the upper-cased kind
# without "NVIDIA", spaces, "-" and "_"; first match wins: "NVIDIA A100-SXM4-80GB" ->
# A100-80GB, "NVIDIA H100 80GB HBM3" -> H100-SXM, "NVIDIA GH200 480GB" -> GH200.
_PATTERNS = (
    ("A100-80GB", ("A100", "80GB"), ()), ("A100-40GB", ("A100", "40GB"), ()),
    ("A100", ("A100",), ()), ("A10", ("A10",), ()), ("V100", ("V100",), ()),
    ("H100-PCIe", ("H100", "PCIE"), ()), ("H100-SXM", ("H100",), ()),
    ("GH200", ("GH200",), ()), ("H200", ("H200",), ()), ("H800", ("H800",), ()),
    ("B200", ("B200",), ()), ("L40S", ("L40S",), ()), ("L4", ("L4",), ("L40",)),
    ("RTX 4090", ("RTX4090",), ()),
)


class GpuSpec(NamedTuple):
  """One GPU kind. FLOP/s dense (no sparsity); bandwidths bytes/s per direction."""

  name: str
  bf16_flops: float
  fp8_flops: float | None  # None: no FP8 tensor cores, FP8 GEMMs are emulated
  hbm_bytes: int           # total memory as nvidia-smi reports it
  hbm_bw: float            # HBM bytes/s
  nvlink_bw: float         # intra-node bytes/s per GPU per direction (PCIe where no NVLink)


@functools.lru_cache(maxsize=256)
def kind_name(device_kind: str) -> str | None:
  """The canonical name (a key of :data:`PEAK_FLOPS` or :data:`MEMORY`) of `device_kind`, a
  jax ``device_kind`` or a canonical name in any case; None when it is not a known GPU."""
  flat = re.sub(r"[\s_\-]", "", str(device_kind).upper()).replace("NVIDIA", "")
  for name, parts, excluded in _PATTERNS:
    if all(p in flat for p in parts) and not any(x in flat for x in excluded):
      return name
  return None


def _chip(name: str) -> tuple[float, float | None]:
  return PEAK_FLOPS[_CHIP.get(name, name)]


GPU_SPECS: dict[str, GpuSpec] = {
    name: GpuSpec(name, *_chip(name), hbm_mib * MiB, hbm_bw, link_bw)
    for name, (hbm_mib, hbm_bw, link_bw) in MEMORY.items()}


def peak_flops(device_kind: str, fp8: bool) -> float | None:
  """Peak dense FLOP/s of one device of `device_kind`: FP8's if `fp8` and the chip has FP8
  tensor cores, else BF16's; None for an unknown kind (e.g. a CPU)."""
  name = kind_name(device_kind)
  if name is None:
    return None
  bf16, f8 = _chip(name)
  return (f8 or bf16) if fp8 else bf16


def gpu_spec(kind: str) -> GpuSpec:
  """The :class:`GpuSpec` of `kind` (a :data:`GPU_SPECS` name or a jax device_kind).

  Raises ValueError for a kind without memory and link facts, naming the known kinds.
  """
  if not isinstance(kind, str) or not kind.strip():
    raise ValueError(f"GPU kind {kind!r} is not allowed; use one of {sorted(GPU_SPECS)}")
  name = kind_name(kind)
  if name in GPU_SPECS:
    return GPU_SPECS[name]
  hint = " (A100 needs its memory size: A100-40GB or A100-80GB)" if name == "A100" else \
      " (peak FLOP/s known, memory and links not)" if name is not None else ""
  raise ValueError(f"unknown GPU kind {kind!r}{hint}; known kinds: {sorted(GPU_SPECS)}")


def fp8_native(kind: str) -> bool:
  """Whether GPU `kind` (any name :func:`kind_name` reads) has FP8 tensor cores."""
  name = kind_name(kind)
  if name is None:
    raise ValueError(f"unknown GPU kind {kind!r}; known kinds: {sorted(PEAK_FLOPS)}")
  return _chip(name)[1] is not None


# ----------------------------------------------------------------------------- cuDNN attention

# cuDNN flash attention (jax.nn.dot_product_attention(implementation="cudnn"), bf16/fp16):
# CUDA compute capability >= 8.0, head dim at most 128, 256 from 9.0 (a multiple of 8).
CUDNN_ATTENTION_HEAD_DIM = ((8, 0), 128), ((9, 0), 256)


def cuda_capability(report: "DeviceReport") -> tuple[int, int] | None:
  """(major, minor) of a CUDA GPU's compute capability ("9.0" -> (9, 0)); None for other
  devices (CPUs, or GPUs reporting none or another format)."""
  match = re.fullmatch(r"\s*(\d+)\.(\d+)\s*", str(report.compute_capability or ""))
  if report.platform != "gpu" or match is None:
    return None
  return int(match.group(1)), int(match.group(2))


def cudnn_attention_head_dim(report: "DeviceReport") -> int | None:
  """The largest head dim cuDNN flash attention takes on `report`'s devices; None where it
  does not run (not a CUDA GPU, or compute capability < 8.0)."""
  cc = cuda_capability(report)
  best = None
  for min_cc, head_dim in CUDNN_ATTENTION_HEAD_DIM:
    if cc is not None and cc >= min_cc:
      best = head_dim
  return best


# ----------------------------------------------------------------------------- FP8 capability

MIN_CAPABILITY = (8, 9)  # first compute capability with FP8 tensor cores (Ada)


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


class CapabilityPlan(NamedTuple):
  """The run's FP8 GEMM decision, identical on every process: native or emulated per process
  (index = process index), with the reason where emulated."""

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


_ACTIVE: CapabilityPlan | None = None


def active_plan() -> CapabilityPlan | None:
  """The plan installed by :func:`install_plan` (None: decided from all devices)."""
  return _ACTIVE


def install_plan(plan: CapabilityPlan | None) -> None:
  """Makes `plan` the one FP8 GEMMs follow in this process (None: back to the default,
  native only when every device of the run supports it). Functions traced afterwards see
  the new decision; compiled ones keep theirs."""
  global _ACTIVE
  _ACTIVE = plan
  native_fp8_reason.cache_clear()


@functools.lru_cache(maxsize=None)
def native_fp8_reason() -> str | None:
  """None when this process runs FP8 GEMMs natively, else why not.

  With a plan installed (:func:`install_plan`), the plan decides for this process.
  Otherwise FP8 GEMMs are native only when every device of the run (the global
  ``jax.devices()``, the same list on every process) supports them.
  """
  plan = active_plan()
  if plan is not None:
    return plan.reason_on(jax.process_index())
  for d in jax.devices():
    cc = getattr(d, "compute_capability", None)
    why = device_reason(DeviceReport(d.process_index, d.platform, d.device_kind,
                                     None if cc is None else str(cc), 1))
    if why:
      return f"device {why}"
  return None
