"""Result tables of ``fp8jax bench``: rows of measured values, printed as a rich table on a
terminal or as Markdown (the form of ``benchmarks/RESULTS.md``) otherwise, and written as JSON.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table as RichTable


class Skipped(Exception):
  """A subject cannot run here (e.g. a collective on one device); the message says why."""


@dataclasses.dataclass(frozen=True)
class Column:
  """One column: `key` of :attr:`Row.values`, its `header`, and `fmt`, the format spec of a
  float value (ints print with thousands separators, None as "-")."""
  key: str
  header: str
  fmt: str = ".2f"


@dataclasses.dataclass
class Row:
  """One measured variant: its `label`, whether it is a `baseline` the ratios divide by, and
  its `values` by column key (float, int, str, bool or None for "not measured")."""
  label: str
  values: dict[str, Any]
  baseline: bool = False


@dataclasses.dataclass
class Table:
  """A subject's table: `title` (the setting measured), `columns` after the label column,
  `rows` in measurement order and `notes` printed below it."""
  subject: str
  title: str
  columns: Sequence[Column]
  rows: list[Row] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)

  def row(self, label: str) -> Row | None:
    """The row labelled `label` (None if there is none)."""
    return next((r for r in self.rows if r.label == label), None)

  def to_dict(self) -> dict:
    """The JSON form: title, columns, rows (label, baseline, values) and notes."""
    return {"subject": self.subject, "title": self.title,
            "columns": [{"key": c.key, "header": c.header} for c in self.columns],
            "rows": [{"label": r.label, "baseline": r.baseline, **{k: _plain(v) for k, v in
                                                                  r.values.items()}}
                     for r in self.rows],
            "notes": list(self.notes)}


def ratio(value: float | None, base: float | None) -> float | None:
  """value / base, or None when either is missing or base is 0."""
  if value is None or base is None or base == 0:
    return None
  return value / base


def cell(value: Any, fmt: str = ".2f") -> str:
  """The text of one value: None (not measured) as "-", floats (numpy's too) by `fmt` (NaN
  as "nan"), ints with separators."""
  if hasattr(value, "item") and not isinstance(value, (str, bytes)):
    value = value.item()
  if value is None:
    return "-"
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, int):
    return f"{value:,}"
  if isinstance(value, float):
    return format(value, fmt)
  return str(value)


def markdown(table: Table) -> str:
  """The table as Markdown: a title line, a header row, one row per variant (baselines
  marked "(baseline)"), then the notes."""
  headers = ["variant"] + [c.header for c in table.columns]
  lines = [f"{table.title}", "", "| " + " | ".join(headers) + " |",
           "|" + "|".join("---" for _ in headers) + "|"]
  for r in table.rows:
    label = f"{r.label} (baseline)" if r.baseline else r.label
    cells = [label] + [cell(r.values.get(c.key), c.fmt) for c in table.columns]
    lines.append("| " + " | ".join(cells) + " |")
  lines += [f"- {n}" for n in table.notes]
  return "\n".join(lines)


def show(table: Table, plain: bool = False, file=None) -> None:
  """Prints `table`: a rich table when `file` (default stdout) is a terminal and not
  `plain`, else :func:`markdown`."""
  file = file or sys.stdout
  if plain or not getattr(file, "isatty", lambda: False)():
    print(markdown(table) + "\n", file=file, flush=True)
    return
  out = RichTable(title=escape(table.title), title_justify="left")
  out.add_column("variant")
  for c in table.columns:
    out.add_column(c.header, justify="right")
  for r in table.rows:
    label = escape(r.label)
    out.add_row(f"[bold]{label}[/bold] (baseline)" if r.baseline else label,
                *(escape(cell(r.values.get(c.key), c.fmt)) for c in table.columns))
  console = Console(file=file)
  console.print(out)
  for n in table.notes:
    console.print(f"- {escape(n)}", highlight=False)
  console.print()


def _plain(value: Any) -> Any:
  """A JSON-safe scalar: numpy scalars as Python ones, NaN and inf as the strings "nan",
  "inf", "-inf" (strict JSON has no such numbers)."""
  if hasattr(value, "item") and not isinstance(value, (str, bytes)):
    value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return str(value)
  return value


def write_json(path: str, document: dict) -> None:
  """Writes `document` to `path` (its folder created) through a temporary file, so a reader
  never sees half a file."""
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  tmp = f"{path}.tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(document, f, indent=1, allow_nan=False)
    f.write("\n")
  os.replace(tmp, path)
