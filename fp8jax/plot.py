"""Loss curves and FP8 health of one or more runs, overlaid, as a PNG (`fp8jax plot`)."""
from __future__ import annotations

import os
from typing import Sequence

from fp8jax.train.metrics import read_jsonl

ROLES = ("input", "kernel", "output_grad")


def _series(records: list[dict], key: str) -> tuple[list, list]:
  pts = [(r["step"], r[key]) for r in records if key in r]
  return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(run_dirs: Sequence[str], out_path: str) -> str:
  """Draws train/val loss, per-role FP8 scales, FP8 cast health and the FP8-BF16 loss gap
  (``fp8/loss_gap``) of `run_dirs` into `out_path` (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  runs = {}
  for d in run_dirs:
    path = os.path.join(d, "metrics.jsonl")
    if not os.path.exists(path):
      raise FileNotFoundError(f"{d!r} has no metrics.jsonl; pass run directories written by "
                              "`fp8jax train`")
    runs[os.path.basename(os.path.normpath(d))] = read_jsonl(path)
  fig, (ax_loss, ax_fp8, ax_health, ax_gap) = plt.subplots(1, 4, figsize=(22, 4.5))
  for name, records in runs.items():
    line, = ax_loss.plot(*_series(records, "loss"), label=f"{name} train")
    ax_loss.plot(*_series(records, "val_loss"), "--", color=line.get_color(),
                 label=f"{name} val")
    steps, values = _series(records, "fp8/loss_gap")
    if steps:
      ax_gap.plot(steps, [100 * v for v in values], marker="o", markersize=3,
                  color=line.get_color(), label=name)
    for role, style in zip(ROLES, ("-", ":", "-.")):
      steps, values = _series(records, f"fp8/{role}/scale_max")
      if steps:
        ax_fp8.semilogy(steps, values, style, color=line.get_color(), label=f"{name} {role}")
      for kind, marker in (("saturated", "^"), ("flushed", "v")):
        steps, values = _series(records, f"fp8/{role}/{kind}")
        if steps:
          ax_health.plot(steps, [100 * v for v in values], style, marker=marker, markersize=3,
                         color=line.get_color(), label=f"{name} {role} {kind}")
  ax_loss.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
  ax_fp8.set(xlabel="step", ylabel="largest scale (amax / fp8 max)", title="FP8 scales")
  ax_health.set(xlabel="step", ylabel="% of elements (worst GEMM)",
                title="FP8 casts: saturated (^) / flushed to zero (v)")
  ax_gap.axhline(0.0, color="gray", linewidth=0.5)
  ax_gap.set(xlabel="step", ylabel="(FP8 - BF16) / BF16 loss, %", title="FP8 loss gap")
  ax_loss.legend(fontsize=8)
  if ax_gap.lines[1:]:
    ax_gap.legend(fontsize=8)
  if ax_health.lines:
    ax_health.legend(fontsize=6)
  if ax_fp8.lines:
    ax_fp8.legend(fontsize=7)
  else:
    ax_fp8.text(0.5, 0.5, "no FP8 state (O0 runs)", ha="center", transform=ax_fp8.transAxes)
  fig.tight_layout()
  fig.savefig(out_path, dpi=110)
  plt.close(fig)
  return out_path
