"""The bytes the collectives of compiled (optimized) HLO text move (custom calls:
``fp8jax.bench.timing.custom_calls``)."""
from __future__ import annotations

import re

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2)\[([\d,]*)\]")
_BITS = {"pred": 8, "bf16": 16, "f8e4m3fn": 8, "f8e5m2": 8}


def _bytes(dtype: str, dims: str) -> int:
  bits = _BITS.get(dtype) or int(re.sub(r"\D", "", dtype))
  n = 1
  for d in filter(None, dims.split(",")):
    n *= int(d)
  return n * bits // 8


def collective_bytes(hlo: str) -> dict[str, int]:
  """{"<kind> <dtype>": bytes per step and device} of the collectives in optimized HLO text."""
  comps, name = {}, None
  for line in hlo.splitlines():
    m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line.strip())
    if m and not line.startswith(" "):
      name = m.group(1)
      comps[name] = []
    elif name is not None:
      comps[name].append(line)
  mult = {n: 1 for n in comps}

  def visit(comp, factor, depth=0):
    for line in comps.get(comp, ()):
      w = re.search(r"while\(.*body=%?([\w.\-]+)", line)
      if w and depth < 8:
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
        body = w.group(1)
        mult[body] = factor * (int(trip.group(1)) if trip else 1)
        visit(body, mult[body], depth + 1)
  entry = next((n for n in comps if n.startswith("main")), None)
  for line in hlo.splitlines():
    if line.startswith("ENTRY"):
      entry = re.match(r"ENTRY %?([\w.\-]+)", line).group(1)
  if entry:
    visit(entry, 1)
  out: dict[str, int] = {}
  for comp, lines in comps.items():
    for line in lines:
      m = re.search(r"= (.*?) (" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
      if not m:
        continue
      shapes = _SHAPE.findall(m.group(1))
      if not shapes:
        continue
      key = f"{m.group(2)} {shapes[-1][0]}"
      if m.group(2) == "all-to-all" and not m.group(3):  # a tuple of n received pieces
        size = sum(_bytes(dtype, dims) for dtype, dims in shapes)
      else:  # the result (for async starts: the last tuple element)
        size = _bytes(*shapes[-1])
      out[key] = out.get(key, 0) + size * mult.get(comp, 1)
  return out
