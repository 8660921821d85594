"""Throughput profiles: seconds per microbatch vs microbatch size on one device of a kind.

``fp8jax profile --config C`` measures them (:func:`measure`) and writes JSON (``SCHEMA``); the
balancer reads them back as :class:`~fp8jax.parallel.balance.KindProfile` (:func:`load`)::

  {"format": "fp8jax-profile/1", "device_kind": "NVIDIA H100 80GB HBM3",
   "compute_capability": "9.0", "platform": "gpu", "memory_bytes": 85899345920,
   "level": "O2", "seq_len": 2048,
   "points": [{"microbatch": 1, "seconds": 0.21, "tokens_per_s": 9752.0,
               "peak_bytes": 40000000000, "fits": true}, ...]}

`seconds` is the median wall time of one train step of one microbatch on one device
(forward, backward and the optimizer update); `peak_bytes` is XLA's compiled estimate
(arguments + outputs + temporaries), `fits` says it compiled, ran and stayed under the limit.
"""
from __future__ import annotations

import json
import os
import time
from typing import Sequence

import numpy as np

from fp8jax.parallel.balance import KindProfile

FORMAT = "fp8jax-profile/1"


def _fail(path: str, what: str):
  raise ValueError(f"profile {path}: {what}")


def validate(data: dict, path: str = "<dict>") -> dict:
  """Checks a profile dict against the format above; returns it."""
  if not isinstance(data, dict) or data.get("format") != FORMAT:
    _fail(path, f"format must be {FORMAT!r}, got "
          f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}")
  if not isinstance(data.get("device_kind"), str) or not data["device_kind"]:
    _fail(path, "device_kind must be a non-empty string")
  if str(data.get("level", "")).upper() not in ("O0", "O1", "O2", "O3"):
    _fail(path, f"level={data.get('level')!r}; use one of O0, O1, O2, O3")
  points = data.get("points")
  if not isinstance(points, list) or not points:
    _fail(path, "points must be a non-empty list")
  for p in points:
    if not isinstance(p, dict):
      _fail(path, f"point {p!r} must be an object")
    m, s, fits = p.get("microbatch"), p.get("seconds"), p.get("fits", True)
    if isinstance(m, bool) or not isinstance(m, int) or m < 1:
      _fail(path, f"point {p}: microbatch={m!r} must be an integer >= 1")
    if not isinstance(fits, bool):
      _fail(path, f"point {p}: fits={fits!r} must be true or false")
    if fits and (isinstance(s, bool) or not isinstance(s, (int, float)) or
                 not 0 < s < float("inf")):
      _fail(path, f"point {p}: seconds={s!r} must be > 0 for a size that fits")
  return data


def read(path: str) -> dict:
  """The validated profile dict in `path`."""
  try:
    with open(path) as f:
      data = json.load(f)
  except OSError as e:
    _fail(path, f"cannot be read ({e.strerror}); run `fp8jax profile` to write it")
  except ValueError as e:
    _fail(path, f"is not JSON ({e})")
  return validate(data, path)


def to_kind_profile(data: dict) -> KindProfile:
  """A profile dict as the balancer's :class:`KindProfile`."""
  seconds = {int(p["microbatch"]): float(p["seconds"]) for p in data["points"]
             if p.get("fits", True)}
  fits = {int(p["microbatch"]): bool(p.get("fits", True)) for p in data["points"]}
  return KindProfile(data["device_kind"], seconds, fits)


def load(path: str) -> KindProfile:
  """The profile in `path` as a :class:`KindProfile`."""
  return to_kind_profile(read(path))


def _median_seconds(fn, state, batch, steps: int):
  import jax
  state, _ = jax.block_until_ready(fn(state, batch))  # warm-up
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, metrics = jax.block_until_ready(fn(state, batch))
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), state


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

  Returns the profile dict (module docstring).
  """
  import jax

  from fp8jax.parallel.capability import local_report
  from fp8jax.train.build import calibrated, calibration_on, model_and_optimizer
  from fp8jax.train.guards import skip_nonfinite_steps
  from fp8jax.train.state import init_state
  from fp8jax.train.step import make_train_step

  sizes = sorted({int(s) for s in sizes})
  if not sizes or sizes[0] < 1:
    raise ValueError(f"sizes {list(sizes)} must be integers >= 1")
  device = device or jax.local_devices()[0]
  report = local_report([device])
  limit = memory_limit_bytes or report.memory_bytes
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
    if calibration_on(config):  # as the Trainer: one uncalibrated step, then calibrated casts
      first = rng.integers(0, config.model.vocab_size, (sizes[0], d.seq_len + 1), np.int32)
      try:
        state, _ = step(state, jax.device_put(first, device))
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


def default_path(data: dict) -> str:
  """profiles/<kind>-<level>-T<seq_len>.json with the kind made file-safe."""
  kind = "".join(c if c.isalnum() else "-" for c in data["device_kind"]).strip("-").lower()
  return os.path.join("profiles", f"{kind}-{data['level']}-T{data['seq_len']}.json")


def write(data: dict, path: str) -> str:
  """Writes the validated profile to `path` (directories made); returns the path."""
  validate(data, path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(data, f, indent=1)
  return path


def table(data: dict) -> str:
  """A short text table of a profile's points."""
  lines = [f"{data['device_kind']} ({data['platform']}), level {data['level']}, "
           f"T={data['seq_len']}",
           f"{'microbatch':>10} {'ms/microbatch':>14} {'tokens/s':>12} {'peak GiB':>9} fits"]
  for p in data["points"]:
    ms = "-" if p["seconds"] is None else f"{1e3 * p['seconds']:.1f}"
    tps = "-" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:,.0f}"
    gib = "-" if p["peak_bytes"] is None else f"{p['peak_bytes'] / 2**30:.2f}"
    lines.append(f"{p['microbatch']:>10} {ms:>14} {tps:>12} {gib:>9} {p['fits']}")
  return "\n".join(lines)
