"""Training metrics: MFU against device peaks, device memory, FP8 health, and the writers
(JSONL and TensorBoard event files, no TensorFlow needed)."""
from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np

from fp8jax.gemm_weights import leaf_name
from fp8jax.hardware import GiB, peak_flops
from fp8jax.scaling import Fp8Meta, fp8_max


def mfu(flops_per_token: float, tokens_per_s: float, fp8: bool) -> float | None:
  """Model FLOPs utilisation of all devices against their peaks
  (:func:`fp8jax.hardware.peak_flops`; None where a device's peak is unknown)."""
  peaks = [peak_flops(d.device_kind, fp8) for d in jax.devices()]
  if any(p is None for p in peaks):
    return None
  return flops_per_token * tokens_per_s / sum(peaks)


def memory_in_use() -> dict[str, float]:
  """GiB in use and peak on local device 0 (empty where the backend does not report it)."""
  stats = jax.local_devices()[0].memory_stats() or {}
  out = {}
  for key, name in (("bytes_in_use", "mem_gib"), ("peak_bytes_in_use", "peak_mem_gib")):
    if key in stats:
      out[name] = stats[key] / GiB
  return out


def absent_metrics(fp8: bool) -> dict[str, str]:
  """{metric: why this run cannot log it} for the metrics that :func:`mfu` and
  :func:`memory_in_use` leave out on these devices (e.g. on CPUs: no peak FLOP/s is known and
  the device reports no memory statistics); empty when every one is logged."""
  out = {}
  unknown = sorted({d.device_kind for d in jax.devices()
                    if peak_flops(d.device_kind, fp8) is None})
  if unknown:
    out["mfu"] = f"no peak FLOP/s known for device kind {', '.join(map(repr, unknown))}"
  device = jax.local_devices()[0]
  if "bytes_in_use" not in (device.memory_stats() or {}):
    out["mem_gib"] = out["peak_mem_gib"] = \
        f"device kind {device.device_kind!r} reports no memory statistics"
  return out


def describe_absent(absent: dict[str, str]) -> str:
  """One line for :func:`absent_metrics`' result: "not logged: mfu (why); mem_gib, ..."."""
  by_reason: dict[str, list[str]] = {}
  for name, why in absent.items():
    by_reason.setdefault(why, []).append(name)
  return "not logged: " + "; ".join(f"{', '.join(names)} ({why})"
                                    for why, names in by_reason.items())


def fp8_health(fp8_state, recipe) -> dict[str, float]:
  """Per tensor role over all FP8 GEMMs: newest amax (max), scale (min/max) and headroom.

  headroom = log2(fp8_max * scale / amax): 0 means the newest tensor filled the FP8 range
  exactly (margin included); < 0 means it saturated; large means values sit low in the range.
  """
  by_role: dict[str, list] = {}

  def visit(path, meta):
    role = leaf_name(path)
    by_role.setdefault(role, []).append(meta)

  jax.tree_util.tree_map_with_path(visit, fp8_state, is_leaf=lambda x: isinstance(x, Fp8Meta))
  out = {}
  for role, metas in by_role.items():
    fmt = recipe.bwd_format if role == "output_grad" else recipe.fwd_format
    amax = np.concatenate([np.asarray(m.amax_history[..., 0]).ravel() for m in metas])
    scale = np.concatenate([np.asarray(m.scale).ravel() for m in metas])
    with np.errstate(divide="ignore", invalid="ignore"):
      headroom = np.log2(fp8_max(fmt) * scale / amax)
    finite = headroom[np.isfinite(headroom)]
    out[f"fp8/{role}/amax_max"] = float(amax.max())
    out[f"fp8/{role}/scale_min"] = float(scale.min())
    out[f"fp8/{role}/scale_max"] = float(scale.max())
    if finite.size:
      out[f"fp8/{role}/headroom_min_log2"] = float(finite.min())
  return out


def comm_scaling(window) -> dict[str, float]:
  """FP8 gradient-comm automatic scaling over a log window of steps' (smallest pre-scale,
  largest saturated fraction) pairs: ``comm/pre_scale_min`` (the window's smallest; < 1 means
  a recent backoff) and ``comm/saturated_max`` (the window's largest, threshold 1e-5)."""
  if not window:
    return {}
  pre, sat = np.asarray([[float(p), float(s)] for p, s in window]).T
  return {"comm/pre_scale_min": float(pre.min()), "comm/saturated_max": float(sat.max())}


class MetricWriter:
  """Writes scalars to `run_dir/metrics.jsonl` and TensorBoard event files in `run_dir`."""

  def __init__(self, run_dir: str):
    os.makedirs(run_dir, exist_ok=True)
    self.run_dir = run_dir
    self._jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
    try:
      from tensorboardX import SummaryWriter
      self._tb = SummaryWriter(run_dir)
    except ImportError:  # optional: JSONL is always written
      self._tb = None

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    clean = {k: float(v) for k, v in scalars.items() if v is not None}
    self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")
    if self._tb is not None:
      for k, v in clean.items():
        self._tb.add_scalar(k, v, int(step))

  def note_absent(self, step: int, absent: dict[str, str]) -> None:
    """Records once why each metric of `absent` ({name: reason}) is not logged: a TensorBoard
    text ``absent/<name>`` and an ``events.jsonl`` line ``{"event": "metric_absent"}``."""
    if not absent:
      return
    with open(os.path.join(self.run_dir, "events.jsonl"), "a") as f:
      for name, reason in absent.items():
        f.write(json.dumps({"step": int(step), "event": "metric_absent", "metric": name,
                            "reason": reason}) + "\n")
    if self._tb is not None:
      for name, reason in absent.items():
        self._tb.add_text(f"absent/{name}", reason, int(step))

  def close(self) -> None:
    self._jsonl.close()
    if self._tb is not None:
      self._tb.close()


class NullWriter:
  """A :class:`MetricWriter` that writes nothing (processes other than the first)."""

  def write(self, step: int, scalars: dict[str, Any]) -> None:
    del step, scalars

  def note_absent(self, step: int, absent: dict[str, str]) -> None:
    del step, absent

  def close(self) -> None:
    pass


def read_jsonl(path: str) -> list[dict]:
  """The records of a metrics.jsonl file."""
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def drop_records_after(path: str, step: int) -> None:
  """Rewrites a metrics.jsonl file without its records of steps > `step` (a resumed run
  writes them again), so the file holds each step once."""
  if not os.path.exists(path):
    return
  kept = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:  # a line cut short when the process was killed
        continue
      if record.get("step", 0) <= step:
        kept.append(record)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    for r in kept:
      f.write(json.dumps(r) + "\n")
  os.replace(tmp, path)
