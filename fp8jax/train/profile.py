"""Throughput profile measurement: seconds per microbatch vs microbatch size on one device.

:func:`measure` times one train step of one microbatch per size and returns the profile dict
of :mod:`fp8jax.parallel.profile` (format, validation, reading and writing live there);
``fp8jax profile`` runs it. With ``fp8.calibrate`` on it times the calibrated step, its FP8
scales from the Trainer's calibration pass (one microbatch, no parameter gradients), as the
Trainer runs it: one train-step program per size.
"""
from __future__ import annotations

import time
from typing import Sequence

import jax
import numpy as np

from fp8jax.hardware import local_report
from fp8jax.parallel.profile import FORMAT, validate
from fp8jax.train.build import calibration_on, model_and_optimizer, resolve_auto
from fp8jax.train.calibration import calibrated, calibrated_scales
from fp8jax.train.evaluation import fp8_updates
from fp8jax.train.guards import skip_nonfinite_steps
from fp8jax.train.state import init_state
from fp8jax.train.step import make_train_step


def _median_seconds(fn, state, batch, steps: int):
  state, _ = jax.block_until_ready(fn(state, batch))  # warm-up
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(fn(state, batch))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), state


def _calibration_pass(model):
  """The Trainer's calibration pass on one device, jitted: ``(state, batch int32[m, T+1]) ->
  FP8 state`` whose never-observed metas take the scales `batch` gives them
  (``fp8jax.train.evaluation.fp8_updates``: the FP8 state differentiated alone, then
  ``fp8jax.train.calibration.calibrated_scales``)."""
  def fp8_probe(state, batch):
    return calibrated_scales(state.fp8, fp8_updates(model.apply, state.variables(), batch))
  return jax.jit(fp8_probe)


def _peak_bytes(compiled) -> int | None:
  try:
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)
  except Exception:  # not every backend reports it
    return None


def _is_oom(error: Exception) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text


def measure(config, sizes: Sequence[int], steps: int = 5,
            memory_limit_bytes: int | None = None, device=None) -> dict:
  """Profiles `config`'s model and level on one device: one train step of one microbatch
  per size in `sizes` (sequences); sizes above the first that does not fit are not tried.
  "auto" model settings are resolved for `device` (``fp8jax.train.build.resolve_auto``).

  Returns the profile dict (format: :mod:`fp8jax.parallel.profile`).
  """
  sizes = sorted({int(s) for s in sizes})
  if not sizes or sizes[0] < 1:
    raise ValueError(f"sizes {list(sizes)} must be integers >= 1")
  device = device or jax.local_devices()[0]
  report = local_report([device])
  limit = memory_limit_bytes or report.memory_bytes
  config = resolve_auto(config, [report._replace(memory_bytes=limit)])  # as the Trainer would
  level, t, d = config.level(), config.train, config.data
  model, _, tx = model_and_optimizer(config)
  points = []
  with jax.default_device(device):
    # Committed to the device, so the step's output (committed) matches its input: one
    # compile per size.
    state = jax.device_put(init_state(model, tx, level, sizes[0], d.seq_len, t.seed), device)
    make_step = lambda model: jax.jit(skip_nonfinite_steps(make_train_step(model.apply, tx, 1)),
                                      donate_argnums=0)
    step = make_step(model)
    rng = np.random.default_rng(0)
    if calibration_on(config):  # the calibrated step, its scales from a calibration pass
      first = rng.integers(0, config.model.vocab_size, (sizes[0], d.seq_len + 1), np.int32)
      try:
        state = state._replace(fp8=_calibration_pass(model)(state, jax.device_put(first,
                                                                                  device)))
        step = make_step(calibrated(model))
      except Exception as e:  # noqa: BLE001 - out of memory: the sweep below records it
        if not _is_oom(e):
          raise
    for m in sizes:
      batch = jax.device_put(rng.integers(0, config.model.vocab_size, (m, d.seq_len + 1),
                                          dtype=np.int32), device)
      point = {"microbatch": m, "seconds": None, "tokens_per_s": None, "peak_bytes": None,
               "fits": False}
      try:
        compiled = step.lower(state, batch).compile()
        point["peak_bytes"] = _peak_bytes(compiled)
        if limit is not None and point["peak_bytes"] is not None and \
            point["peak_bytes"] > limit:
          points.append(point)
          break
        seconds, state = _median_seconds(compiled, state, batch, steps)
      except Exception as e:  # noqa: BLE001 - only out-of-memory ends the sweep quietly
        if not _is_oom(e):
          raise
        points.append(point)
        break
      point.update(seconds=seconds, tokens_per_s=m * d.seq_len / seconds, fits=True)
      points.append(point)
  return validate({"format": FORMAT, "device_kind": report.device_kind,
                   "compute_capability": report.compute_capability,
                   "platform": report.platform, "memory_bytes": limit,
                   "level": level.name, "seq_len": d.seq_len, "points": points})
