"""Training guards: non-finite step skip, FP8 divergence watchdog, heartbeat, preemption.

* :func:`skip_nonfinite_steps` wraps a train step so a step whose loss or gradients hold an
  inf/NaN leaves params, optimizer and FP8 state exactly as they were (only ``state.step``,
  the count of steps taken, advances) and reports ``metrics["skipped"]``. The FP8 scales are
  not touched by the bad step, so the next step computes them from the unchanged history.
  :class:`SkipCounter` counts skips and says when K in a row call for reloading a checkpoint.
* :class:`DivergenceWatchdog`: every N steps the Trainer evaluates the same batch with BF16
  GEMMs; a relative gap |fp8 - bf16| / |bf16| above the threshold returns the reason to
  switch the run to BF16 (O0) GEMMs.
* :class:`Heartbeat`: a daemon thread; when no :meth:`Heartbeat.beat` arrives for
  ``interval * tolerance`` seconds it logs the stall with every thread's stack and exits the
  process with :data:`STALL_EXIT_CODE` (the launcher then restarts the job).
* :class:`Preemption`: while active, SIGTERM and the first SIGINT (Ctrl-C) only set a flag;
  the Trainer finishes the step, saves, waits for the write and stops (``fp8jax train`` exits
  0 after SIGTERM, 130 after Ctrl-C). A second Ctrl-C aborts at once.
"""
from __future__ import annotations

import faulthandler
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp

from fp8jax.optim.finite import all_finite, select_tree

logger = logging.getLogger("fp8jax")

STALL_EXIT_CODE = 75  # the process stalled (heartbeat); a supervisor should restart it


def skip_nonfinite_steps(step_fn: Callable, skipped_inside: tuple[str, ...] = ()) -> Callable:
  """``step_fn(state, batch) -> (state, metrics)`` that skips non-finite steps.

  `metrics` must hold ``loss`` and ``grad_norm`` (the global gradient norm: non-finite iff
  some gradient is, or the norm overflows). Returns the same signature; ``metrics`` gains
  ``skipped`` (bool[]). A skipped step returns the input state with ``step`` + 1.
  `skipped_inside`: state fields that `step_fn` itself leaves unchanged on such a step (the
  fused optimizer does); they are taken as returned, so their old buffers need not outlive
  the update (no copy, no select pass).
  """

  def guarded(state, *batch):
    new_state, metrics = step_fn(state, *batch)
    ok = all_finite((metrics["loss"], metrics["grad_norm"]))
    kept = state._replace(step=new_state.step,
                          **{f: getattr(new_state, f) for f in skipped_inside})
    return select_tree(ok, new_state, kept), {**metrics, "skipped": jnp.logical_not(ok)}

  return guarded


class SkipCounter:
  """Counts skipped steps; :meth:`update` returns True after `limit` consecutive skips
  (then starts counting again). `limit` 0 never asks for a reload."""

  def __init__(self, limit: int, total: int = 0):
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
      raise ValueError(f"limit={limit!r} is not allowed; use an integer >= 0 (0: never reload)")
    self.limit, self.total, self.consecutive = limit, total, 0

  def update(self, skipped: bool) -> bool:
    if not skipped:
      self.consecutive = 0
      return False
    self.total += 1
    self.consecutive += 1
    if self.limit and self.consecutive >= self.limit:
      self.consecutive = 0
      return True
    return False


def loss_gap(fp8_loss: float, bf16_loss: float) -> float:
  """(FP8 loss - BF16 loss) / |BF16 loss| of the same batch and parameters: the relative
  price of FP8 GEMMs in loss (``fp8/loss_gap``; > 0: FP8 is worse)."""
  return (fp8_loss - bf16_loss) / max(abs(bf16_loss), 1e-12)


class DivergenceWatchdog:
  """Compares the FP8 loss with a BF16 evaluation of the same batch every `every` steps.

  Args:
    every: steps between checks (0 disables).
    threshold: largest allowed relative gap |fp8 - bf16| / |bf16| (seed: 0.01).
  """

  def __init__(self, every: int, threshold: float = 0.01):
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
      raise ValueError(f"every={every!r} is not allowed; use an integer >= 0 (0: never check)")
    if not (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold > 0):
      raise ValueError(f"threshold={threshold!r} is not allowed; use a finite number > 0")
    self.every, self.threshold = every, float(threshold)

  def due(self, step: int) -> bool:
    """True when optimizer step `step` (0-based) is checked."""
    return self.every > 0 and step % self.every == 0

  def check(self, step: int, fp8_loss: float, bf16_loss: float) -> str | None:
    """The reason to fall back to BF16, or None when the gap is within the threshold."""
    if not (math.isfinite(fp8_loss) and math.isfinite(bf16_loss)):
      return None  # non-finite steps are the skip guard's business
    gap = abs(loss_gap(fp8_loss, bf16_loss))
    if gap <= self.threshold:
      return None
    return (f"FP8 diverged from BF16 at step {step}: loss {fp8_loss:.6g} (FP8) vs "
            f"{bf16_loss:.6g} (BF16) on the same batch, relative gap {gap:.3%} > "
            f"{self.threshold:.3%}; switching to BF16 (O0) GEMMs")


class Heartbeat:
  """Exits the process when no progress is reported for `interval * tolerance` seconds.

  Use as a context manager; call :meth:`beat` after each completed step (and around long
  operations). The clock starts at the first beat, so compilation before it is not a stall.
  On a stall: an error log, every thread's stack (``faulthandler``) on stderr, then
  ``os._exit(exit_code)`` (a stuck collective cannot be interrupted any other way).
  """

  def __init__(self, interval: float, tolerance: int = 3, exit_code: int = STALL_EXIT_CODE,
               on_stall: Callable[[float], None] | None = None):
    if not (isinstance(interval, (int, float)) and not isinstance(interval, bool)
            and math.isfinite(interval) and interval > 0):
      raise ValueError(f"interval={interval!r} is not allowed; use a number of seconds > 0")
    if isinstance(tolerance, bool) or not isinstance(tolerance, int) or tolerance < 1:
      raise ValueError(f"tolerance={tolerance!r} is not allowed; use an integer >= 1")
    self.interval, self.tolerance, self.exit_code = float(interval), tolerance, exit_code
    self.on_stall = on_stall
    self._last: float | None = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._watch, name="fp8jax-heartbeat", daemon=True)

  @property
  def limit(self) -> float:
    """Seconds without progress that count as a stall."""
    return self.interval * self.tolerance

  def beat(self) -> None:
    self._last = time.monotonic()

  def _watch(self) -> None:
    while not self._stop.wait(min(self.interval, self.limit / 4)):
      if self._last is None:
        continue
      idle = time.monotonic() - self._last
      if idle > self.limit:
        self._stall(idle)
        return

  def _stall(self, idle: float) -> None:
    logger.error("heartbeat: no training progress for %.2f s (limit %.2f s = "
                 "heartbeat_interval %.2f s x %d) on process %d; stacks of all threads "
                 "follow, exiting with code %d", idle, self.limit, self.interval,
                 self.tolerance, jax.process_index(), self.exit_code)
    print(f"fp8jax heartbeat: stalled for {idle:.1f} s (limit {self.limit:.1f} s); "
          f"exiting with code {self.exit_code}", file=sys.stderr, flush=True)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    sys.stderr.flush()
    if self.on_stall is not None:
      self.on_stall(idle)
    else:
      os._exit(self.exit_code)

  def __enter__(self) -> "Heartbeat":
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join(timeout=5)


class NoHeartbeat:
  """A :class:`Heartbeat` that watches nothing (heartbeat off)."""

  def beat(self) -> None:
    pass

  def __enter__(self) -> "NoHeartbeat":
    return self

  def __exit__(self, *exc) -> None:
    pass


class Preemption:
  """While active (a context manager in the main thread), each of `signals` (default SIGTERM
  and SIGINT) sets :attr:`requested` instead of stopping the process, and the first one's
  name is :attr:`signal_name` ("SIGTERM", "SIGINT"). A SIGINT after the first request raises
  ``KeyboardInterrupt`` (Ctrl-C twice aborts). One line on stderr says what happens. The
  previous handlers come back on exit."""

  def __init__(self, signals=(signal.SIGTERM, signal.SIGINT)):
    self.signals, self.requested, self._old = tuple(signals), False, {}
    self.signal_name: str | None = None

  def _handle(self, signum, frame) -> None:
    name = signal.Signals(signum).name
    if self.requested and signum == signal.SIGINT:
      raise KeyboardInterrupt
    if not self.requested:
      self.signal_name = name
      again = "; press Ctrl-C again to abort" if signum == signal.SIGINT else ""
      # os.write: a handler may run while the main thread is inside a print
      os.write(2, f"fp8jax: received {name}: stopping after the current step (saving a "
                  f"checkpoint when checkpointing is on){again}\n".encode())
    self.requested = True

  def __enter__(self) -> "Preemption":
    if threading.current_thread() is threading.main_thread():
      for s in self.signals:
        self._old[s] = signal.signal(s, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for s, old in self._old.items():
      signal.signal(s, old)
    self._old = {}


__all__ = ["DivergenceWatchdog", "Heartbeat", "NoHeartbeat", "Preemption", "STALL_EXIT_CODE",
           "SkipCounter", "skip_nonfinite_steps"]
