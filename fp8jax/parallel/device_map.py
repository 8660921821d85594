"""``parallel.device_map``: how fast each device kind is, for the balanced step.

Forms (YAML)::

  device_map: {H100: 1.0, A100: 0.45}                   # relative throughput
  device_map: {H100: {throughput: 1.0}, A100: {profile: profiles/a100-O2-T2048.json}}
  device_map: profiles/                                 # every *.json profile in a folder

``parallel.device_kinds`` (a rehearsal on identical devices, e.g. 8 CPU devices) declares the
kind of each device by its index in ``jax.devices()``: ``"4xA100+4xH100"`` or a list of kinds;
the balancer then reads those kinds instead of the devices' own (:func:`declared_kinds`).

A key matches a device kind exactly or as a case-insensitive substring ("A100" matches
"NVIDIA A100-SXM4-80GB"); the longest matching key wins. Relative throughput t gives 1/t
seconds per microbatch (only ratios matter); a profile (``fp8jax profile``) gives measured
seconds at the run's microbatch size. Every process reads the same map and the global device
list, so all compute the same counts.
"""
from __future__ import annotations

import glob
import math
import os
from typing import Mapping, Sequence

from fp8jax.parallel import profile as profile_lib
from fp8jax.parallel.balance import KindProfile

_ENTRY_KEYS = ("throughput", "profile")


def check(device_map) -> None:
  """Raises ValueError naming the bad part of a ``parallel.device_map`` value."""
  if device_map is None or isinstance(device_map, str):
    if isinstance(device_map, str) and not device_map:
      raise ValueError("parallel.device_map='' is not allowed; give a folder of profiles or "
                       "a mapping {device kind: throughput}")
    return
  if not isinstance(device_map, Mapping) or not device_map:
    raise ValueError(f"parallel.device_map={device_map!r} is not allowed; use a mapping "
                     "{device kind: relative throughput | {throughput: x} | {profile: path}} "
                     "or a folder of `fp8jax profile` files")
  for kind, value in device_map.items():
    where = f"parallel.device_map.{kind}"
    if not isinstance(kind, str) or not kind:
      raise ValueError(f"parallel.device_map key {kind!r} is not allowed; use a device kind "
                       "such as 'H100' or 'NVIDIA A100-SXM4-80GB'")
    if isinstance(value, Mapping):
      unknown = sorted(set(value) - set(_ENTRY_KEYS))
      if unknown or len(value) != 1:
        raise ValueError(f"{where}={dict(value)!r} is not allowed; give exactly one of "
                         f"{_ENTRY_KEYS}")
      if "profile" in value:
        if not isinstance(value["profile"], str) or not value["profile"]:
          raise ValueError(f"{where}.profile={value['profile']!r} must be a file path")
        continue
      value = value["throughput"]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
        not (value > 0 and math.isfinite(value)):
      raise ValueError(f"{where}={value!r} is not allowed; use a relative throughput > 0")


def parse_kinds(spec) -> list[str]:
  """``parallel.device_kinds`` as one kind per device: a list of kind names, or
  ``"NxKIND+MxKIND..."`` (N devices of KIND, in device order). Raises ValueError."""
  if isinstance(spec, str):
    out = []
    for part in spec.split("+"):
      count, x, kind = part.strip().partition("x")
      if not x or not count.strip().isdigit() or int(count) < 1 or not kind.strip():
        raise ValueError(f"parallel.device_kinds={spec!r}: {part.strip()!r} is not N x KIND; "
                         "use e.g. '4xA100+4xH100' or a list of kinds, one per device")
      out += [kind.strip()] * int(count)
    return out
  if (isinstance(spec, (list, tuple)) and spec
      and all(isinstance(k, str) and k for k in spec)):
    return list(spec)
  raise ValueError(f"parallel.device_kinds={spec!r} is not allowed; use 'NxKIND+MxKIND' "
                   "(e.g. '4xA100+4xH100') or a list of kinds, one per device")


def declared_kinds(spec, devices: Sequence, all_devices: Sequence) -> list[str]:
  """The kind of each of `devices`: its own ``device_kind`` (`spec` None), or the entry of
  ``parse_kinds(spec)`` at its index in `all_devices` (``jax.devices()``). Raises ValueError
  when `spec` does not name one kind per device."""
  if spec is None:
    return [d.device_kind for d in devices]
  kinds = parse_kinds(spec)
  if len(kinds) != len(all_devices):
    raise ValueError(f"parallel.device_kinds names {len(kinds)} devices but the run has "
                     f"{len(all_devices)}; give one kind per device")
  index = {d: i for i, d in enumerate(all_devices)}
  return [kinds[index[d]] for d in devices]


def _entries(device_map) -> dict[str, object]:
  """{key: float throughput | KindProfile}."""
  check(device_map)
  if isinstance(device_map, str):
    paths = sorted(glob.glob(os.path.join(device_map, "*.json")))
    if not paths:
      raise ValueError(f"parallel.device_map={device_map!r}: no *.json profiles there; run "
                       "`fp8jax profile --out <folder>/<name>.json` on each device kind")
    out = {}
    for path in paths:
      prof = profile_lib.load(path)
      out[prof.kind] = prof
    return out
  out = {}
  for kind, value in device_map.items():
    if isinstance(value, Mapping) and "profile" in value:
      out[kind] = profile_lib.load(value["profile"])
    else:
      out[kind] = float(value["throughput"] if isinstance(value, Mapping) else value)
  return out


def kinds(device_map) -> list[str]:
  """The device kinds `device_map` has an entry for (its keys; a folder's: its profiles'
  kinds), sorted."""
  return sorted(_entries(device_map))


def _match(kind: str, keys: Sequence[str]) -> str | None:
  hits = [k for k in keys if k == kind or k.lower() in kind.lower()]
  return max(hits, key=len) if hits else None


def seconds_per_microbatch(device_map, kinds: Sequence[str], microbatch_size: int) -> list[float]:
  """Seconds (or relative seconds) of one microbatch of `microbatch_size` sequences on each
  of `kinds` (one entry per data-parallel group)."""
  entries = _entries(device_map)
  out = []
  for kind in kinds:
    key = _match(kind, list(entries))
    if key is None:
      raise ValueError(f"parallel.device_map has no entry for device kind {kind!r} (keys: "
                       f"{sorted(entries)}); add it, e.g. {{{kind.split()[-1]!r}: 1.0}}")
    entry = entries[key]
    if isinstance(entry, KindProfile):
      if not entry.admits(microbatch_size):
        raise ValueError(f"the profile of {entry.kind!r} has no fitting measurement at "
                         f"microbatch {microbatch_size} (measured: "
                         f"{sorted(entry.seconds)}); profile that size or change "
                         "train.batch_size / train.microbatches")
      out.append(float(entry.seconds[microbatch_size]))
    else:
      out.append(1.0 / entry)
  return out
