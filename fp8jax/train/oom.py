"""Out of device memory as a diagnosis: which phase of the run, how much it asked for, what the
device has, and which settings to change (:class:`OutOfMemory`, one line from the CLI)."""
from __future__ import annotations

import re

import jax

from fp8jax.hardware import GiB

# The phases of a run (``Trainer`` names the one that runs).
INIT, CALIBRATION, STEP, EVAL, PROBE, WATCHDOG, LOSS_GAP, CHECKPOINT, RESTORE = (
    "state initialisation", "FP8 calibration", "train step", "evaluation", "FP8 health probe",
    "divergence check", "FP8-BF16 loss gap", "checkpoint save", "checkpoint restore")
_UNITS = {"": 1, "b": 1, "byte": 1, "bytes": 1, "k": 2**10, "kb": 2**10, "kib": 2**10,
          "m": 2**20, "mb": 2**20, "mib": 2**20, "g": GiB, "gb": GiB, "gib": GiB,
          "t": 2**40, "tb": 2**40, "tib": 2**40}
_ALLOCATE = re.compile(r"allocat\w*\s+(?:request\s+for\s+)?([0-9]+(?:\.[0-9]+)?)\s*"
                       r"([kmgt]i?b?|bytes?|b)?\b", re.I)


class OutOfMemory(RuntimeError):
  """A phase of a run ran out of device memory; the message says which, by how much and what
  to change (the CLI prints it as one ``fp8jax: error:`` line, exit 1)."""


def is_out_of_memory(error: BaseException) -> bool:
  """Whether `error` is XLA's out-of-memory (a ``jax.errors.JaxRuntimeError`` whose message
  has RESOURCE_EXHAUSTED)."""
  return isinstance(error, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(error)


def requested_bytes(message: str) -> float | None:
  """The allocation XLA's out-of-memory `message` names ("... trying to allocate 152.31GiB",
  "... allocate 1234 bytes", "Failed to allocate request for 2.5MiB"); None when it names
  none."""
  m = _ALLOCATE.search(message)
  if m is None:
    return None
  return float(m.group(1)) * _UNITS[(m.group(2) or "").lower()]


def device_memory() -> tuple[float | None, float | None]:
  """(bytes in use, the allocator's limit) on this process's first device; None where the
  runtime does not say (CPU)."""
  try:
    stats = jax.local_devices()[0].memory_stats() or {}
  except Exception:  # noqa: BLE001 (a runtime without memory statistics)
    stats = {}
  return stats.get("bytes_in_use"), stats.get("bytes_limit")


def advice(phase: str, config) -> str:
  """What to change in `config` when `phase` does not fit."""
  t, m, p = config.train, config.model, config.parallel
  smaller = []
  if t.microbatch_size > 1:
    k = t.microbatches * 2 if t.batch_size % (t.microbatches * 2) == 0 else t.batch_size
    smaller.append(f"smaller microbatches (train.microbatches={k}: the same batch of "
                   f"{t.batch_size} sequences in microbatches of {t.batch_size // k})")
  if not m.remat:
    smaller.append("model.remat=true")
  elif m.remat_policy not in ("full", "auto"):
    smaller.append("model.remat_policy=full")
  state = []
  if config.level().name in ("O0", "O1"):
    state.append("train.opt_level=O2 (FP16 master weights and FP8/FP16 Adam state)")
  if config.zero_stage() < 3:
    state.append("parallel.zero_stage=3 over more devices")
  if not p.offload_optimizer:
    state.append("parallel.offload_optimizer=true")
  off = {EVAL: "train.eval_every=0 (no evaluation)",
         PROBE: "train.fp8_health_every=0 (no probe)",
         CALIBRATION: "fp8.calibrate=never",
         WATCHDOG: "runtime.divergence_check_every=0",
         LOSS_GAP: "train.fp8_health_every=0 (no probe, no loss gap)"}
  if phase in (INIT, RESTORE, CHECKPOINT):
    options = state or smaller
  else:
    options = (smaller or state) + ([off[phase]] if phase in off else [])
  if phase in (EVAL, PROBE, CALIBRATION, WATCHDOG, LOSS_GAP) and smaller:
    options[0] += f" (the {phase} runs the train step's microbatches)"
  return "try " + "; or ".join(options) if options else "a device with more memory"


def diagnosis(phase: str, error: BaseException, config, saved: str = "") -> str:
  """The one-line message of `error` (XLA out of memory) in `phase`: ``out of device memory
  in <phase> (needs ~X GiB, the device has Y GiB): <what to change>``, then `saved` (what
  the run kept on disk)."""
  asked = requested_bytes(str(error))
  in_use, limit = device_memory()
  if asked is None:
    needs = "needs more"
  else:
    total = asked + (in_use or 0)
    needs = f"needs ~{total / GiB:.1f} GiB" + (
        f" ({asked / GiB:.1f} GiB more than the {in_use / GiB:.1f} GiB in use)" if in_use
        else "")
  has = f"the device has {limit / GiB:.1f} GiB" if limit else "the device's limit is unknown"
  line = f"out of device memory in {phase} ({needs}, {has}): {advice(phase, config)}"
  return f"{line}. {saved}" if saved else line
