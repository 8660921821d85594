"""Timing for ``fp8jax bench``: warm-up, then the median of calls each waited for
(``jax.block_until_ready``), or calls launched back to back; what a compiled program holds
(memory, cuBLASLt FP8 GEMMs); relative errors against a higher-precision reference."""
from __future__ import annotations

import dataclasses
import re
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.hardware import GiB

FP8_GEMM = "__cublas$lt$matmul$f8"  # XLA's custom call for a cuBLASLt FP8 GEMM


@dataclasses.dataclass(frozen=True)
class Timing:
  """Milliseconds per call: `median`, `best` (the minimum) and every call's `times`."""
  median: float
  best: float
  times: tuple[float, ...]


def time_calls(fn: Callable[[], Any], iters: int, warmup: int = 2) -> Timing:
  """Runs ``fn()`` `warmup` times, then `iters` times, each call waited for with
  ``jax.block_until_ready`` on its result; returns the timed calls' milliseconds. ``fn``
  takes no arguments: a step that carries state keeps it in a closure."""
  if iters < 1:
    raise ValueError(f"iters={iters}: time at least one call")
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(1e3 * (time.perf_counter() - t0))
  return Timing(float(np.median(times)), float(np.min(times)), tuple(times))


def back_to_back_ms(fn: Callable[[], Any], iters: int, rounds: int = 3) -> float:
  """Milliseconds per call of `iters` calls launched without waiting (the host dispatches the
  next call while the device runs the previous one, as in a training loop) and waited for
  once at the end; the best of `rounds` such runs."""
  best = float("inf")
  for _ in range(rounds):
    t0 = time.perf_counter()
    out = None
    for _ in range(iters):
      out = fn()
    jax.block_until_ready(out)
    best = min(best, 1e3 * (time.perf_counter() - t0) / iters)
  return best


def memory_gib(compiled) -> dict[str, float | None]:
  """{"temp": temporaries, "total": arguments + outputs (less the donated, aliased part) +
  temporaries} of a compiled program in GiB, from XLA's memory analysis (None where the
  backend gives none)."""
  mem = compiled.memory_analysis()
  if mem is None:
    return {"temp": None, "total": None}
  size = lambda name: getattr(mem, name, 0) or 0  # noqa: E731
  total = (size("argument_size_in_bytes") + size("output_size_in_bytes")
           - size("alias_size_in_bytes") + size("temp_size_in_bytes"))
  return {"temp": size("temp_size_in_bytes") / GiB, "total": total / GiB}


def custom_calls(hlo_text: str) -> dict[str, int]:
  """{custom-call target: count} of compiled HLO text (``FP8_GEMM``: cuBLASLt FP8 GEMMs)."""
  out: dict[str, int] = {}
  for target in re.findall(r'custom_call_target="([^"]+)"', hlo_text):
    out[target] = out.get(target, 0) + 1
  return out


@jax.jit
def _square_norms(a, ref):
  a, ref = a.astype(jnp.float32), ref.astype(jnp.float32)
  return jnp.sum(jnp.square(a - ref)), jnp.sum(jnp.square(ref))


def rel_err(a, ref) -> float:
  """||a - ref|| / ||ref||, computed where the arrays are with f32 sums of squares (GPU-sized
  gradients never go through the host); NaN or inf when ref is all zero or a value is not
  finite."""
  diff, norm = (float(v) for v in _square_norms(jnp.asarray(a), jnp.asarray(ref)))
  return float(np.sqrt(diff / norm)) if norm > 0 else float("nan")
