"""Where the wait for a run's first step goes (:class:`StartupClock`).

From the Trainer's construction to the end of its first step a run sets up (devices, layout
checks, the model and optimizer), reads its data, initialises (or restores) its state,
traces, lowers and compiles its programs (or loads them from the persistent cache), runs a
calibration pass and the step. The clock times named phases of that wait and takes the
compile work (``fp8jax.train.compiles.totals``: all threads of the process) out of each
phase's seconds, so the two never count twice.
"""
from __future__ import annotations

import contextlib
import time

from fp8jax.train import compiles

# The phases a Trainer names, in the order it runs them (the summary's order).
SETUP, DATA, STATE, RESTORE, BF16_LOSS, CALIBRATION, STEP = (
    "set-up", "data", "state", "restore", "bf16 loss", "calibration", "step")
PHASES = (SETUP, DATA, STATE, RESTORE, BF16_LOSS, CALIBRATION, STEP)


class StartupClock:
  """Times the phases of a run's start, from construction to :meth:`stop`.

  ``with clock.phase(name):`` adds the span's wall seconds, less the tracing, lowering and
  compile seconds inside it, to phase `name` (spans of one name add up; spans after
  :meth:`stop` are not timed). :meth:`stop` returns :meth:`summary`.
  """

  def __init__(self):
    self.start = time.perf_counter()
    self._compiled_at_start = compiles.totals()
    self.seconds: dict[str, float] = {}
    self._summary: dict | None = None

  @contextlib.contextmanager
  def phase(self, name: str):
    """Times the body as phase `name` (nothing after :meth:`stop`)."""
    if self._summary is not None:
      yield
      return
    t, c = time.perf_counter(), compiles.totals()
    try:
      yield
    finally:
      d = compiles.totals() - c
      busy = time.perf_counter() - t - d.work_s
      self.seconds[name] = self.seconds.get(name, 0.0) + max(busy, 0.0)

  def stop(self) -> dict:
    """Ends the clock (once; later calls return the same summary): :meth:`summary`."""
    if self._summary is None:
      self._summary = self.summary()
    return self._summary

  def summary(self) -> dict:
    """Seconds since construction: ``total_s``; ``tracing_s`` (tracing and lowering) and
    ``compiling_s`` (compile requests, cache loads included) with ``programs`` (compile
    requests) and ``cache_hits``; ``<phase>_s`` per timed phase (without compile work; a
    phase's name with spaces and dashes as underscores); ``other_s``: the rest."""
    total = time.perf_counter() - self.start
    d = compiles.totals() - self._compiled_at_start
    out = {"total_s": total, "tracing_s": d.trace_s + d.lower_s, "compiling_s": d.compile_s,
           "programs": d.compiles, "cache_hits": d.cache_hits}
    for name, s in self.seconds.items():
      out[_key(name)] = s
    out["other_s"] = max(total - out["tracing_s"] - out["compiling_s"]
                         - sum(self.seconds.values()), 0.0)
    return out


def _key(phase: str) -> str:
  return phase.replace(" ", "_").replace("-", "_") + "_s"


def describe(summary: dict) -> str:
  """Where `summary`'s total (:meth:`StartupClock.summary`) went, largest first, in one line
  ("compiling 8.1 s (5 of 16 programs from the cache), tracing 3.0 s, data 1.2 s, ..."); parts
  under 0.05 s are left out."""
  parts = [(summary["compiling_s"],
            f"compiling {summary['compiling_s']:.1f} s ({summary['cache_hits']} of "
            f"{summary['programs']} programs from the cache)"),
           (summary["tracing_s"], f"tracing {summary['tracing_s']:.1f} s")]
  for name in PHASES:
    if _key(name) in summary:
      parts.append((summary[_key(name)], f"{name} {summary[_key(name)]:.1f} s"))
  parts.append((summary["other_s"], f"other {summary['other_s']:.1f} s"))
  shown = [text for s, text in sorted(parts, key=lambda p: -p[0]) if s >= 0.05]
  return ", ".join(shown)
