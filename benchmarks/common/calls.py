"""Milliseconds per call of a jitted function, calls launched back to back (kernel scripts)."""
from __future__ import annotations

import time

import jax
import numpy as np


def ms_per_call(fn, args, calls: int = 50, repeats: int = 5) -> float:
  """Median over `repeats` of (time for `calls` back-to-back async calls of ``fn(*args)``) /
  calls, in ms; one call first (compile and warm-up)."""
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
    ts.append((time.perf_counter() - t0) / calls)
  return 1e3 * float(np.median(ts))
