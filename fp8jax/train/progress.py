"""The training progress display: a rich progress bar with loss and tokens/s."""
from __future__ import annotations

from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeRemainingColumn)


class ProgressBar:
  """A context manager; :meth:`advance` moves it by `n` steps and shows a log window's loss
  and tokens/s. Disabled (`enabled` False) it does nothing."""

  def __init__(self, total: int, enabled: bool):
    self.total, self.enabled, self.bar = total, enabled, None

  def __enter__(self) -> "ProgressBar":
    if self.enabled:
      self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                          TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
      self.bar.__enter__()
      self.task = self.bar.add_task("train", total=self.total, info="")
    return self

  def advance(self, n: int, window: dict | None = None) -> None:
    if self.bar is None:
      return
    info = None
    if window is not None:
      info = f"loss {window['loss']:.4f}  {window['tokens_per_s']:,.0f} tok/s"
    self.bar.update(self.task, advance=n, **({"info": info} if info else {}))

  def __exit__(self, *exc) -> None:
    if self.bar is not None:
      self.bar.__exit__(*exc)
