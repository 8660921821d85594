"""The training progress display: a rich progress bar on a terminal, log lines elsewhere.

On a terminal (and with the bar enabled) a rich progress bar shows steps, time left and the
latest log window's loss and tokens/s. Without a terminal (``nohup``, SLURM, a pipe) or with
the bar disabled, each log window prints one line instead::

  step 20/200  loss 3.4120  41,250 tok/s  ETA 0:01:32
"""
from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeRemainingColumn)


def format_eta(seconds: float | None) -> str:
  """``h:mm:ss`` of `seconds` rounded to a second; "?" when unknown (None)."""
  if seconds is None:
    return "?"
  minutes, secs = divmod(int(round(max(seconds, 0.0))), 60)
  return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"


def progress_line(step: int, total: int, window: dict, eta_s: float | None) -> str:
  """One log line: step of total, the window's mean loss and tokens/s, and the time left."""
  return (f"step {step}/{total}  loss {window['loss']:.4f}  "
          f"{window['tokens_per_s']:,.0f} tok/s  ETA {format_eta(eta_s)}")


class ProgressBar:
  """A context manager; :meth:`advance` moves it by `n` steps and, given a log window's
  metrics (``loss``, ``tokens_per_s``), shows them. A rich bar when `enabled` and `stream`
  (default stdout) is a terminal; otherwise one :func:`progress_line` per window, printed once
  the window's last step is counted. The time left is the steps left at the rate since the
  previous line (the first line: since the first counted step, so compilation is excluded
  for a run that starts at step 0)."""

  def __init__(self, total: int, enabled: bool, stream: TextIO | None = None):
    self.total, self.enabled, self.bar = total, enabled, None
    self.stream = sys.stdout if stream is None else stream
    self.done = 0
    self._window: dict | None = None
    self._mark: tuple[float, int] | None = None  # (time, steps done) of the rate's start

  def __enter__(self) -> "ProgressBar":
    if self.enabled and self.stream.isatty():
      self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                          TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
      self.bar.__enter__()
      self.task = self.bar.add_task("train", total=self.total, info="")
    return self

  def advance(self, n: int, window: dict | None = None) -> None:
    if self.bar is not None:
      info = None
      if window is not None:
        info = f"loss {window['loss']:.4f}  {window['tokens_per_s']:,.0f} tok/s"
      self.bar.update(self.task, advance=n, **({"info": info} if info else {}))
      return
    self.done += n
    if window is not None:
      self._window = dict(window)
    if n <= 0:
      return
    now = time.monotonic()
    if self._mark is None:
      self._mark = (now, self.done)
    if self._window is not None:
      start, done0 = self._mark
      eta = (self.total - self.done) * (now - start) / (self.done - done0) \
          if self.done > done0 else None
      print(progress_line(self.done, self.total, self._window, eta), file=self.stream,
            flush=True)
      self._window, self._mark = None, (now, self.done)

  def __exit__(self, *exc) -> None:
    if self.bar is not None:
      self.bar.__exit__(*exc)
