"""Throughput profiles: seconds per microbatch vs microbatch size on one device of a kind.

``fp8jax profile --config C`` measures them (:func:`fp8jax.train.profile.measure`) and
writes this JSON format (:data:`FORMAT`, checked by :func:`validate`); the balancer reads them
back as :class:`~fp8jax.parallel.balance.KindProfile` (:func:`load`)::

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

from fp8jax.hardware import GiB
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
    gib = "-" if p["peak_bytes"] is None else f"{p['peak_bytes'] / GiB:.2f}"
    lines.append(f"{p['microbatch']:>10} {ms:>14} {tps:>12} {gib:>9} {p['fits']}")
  return "\n".join(lines)
