"""FP8 against BF16 validation loss over a whole training run: the convergence study.

  python benchmarks/train/convergence.py --config configs/gpt_125m.yaml --tokens 150e6 \
      --out runs/convergence [--run O0=O0 --run O1=O1 ... --run "O0-seed1=O0,train.seed=1"] \
      [--set key=value ...] [--report-only]

Each ``--run LABEL=LEVEL[,key=value...]`` is one ``fp8jax train`` run of ``--config`` for
``--tokens`` tokens (``train.steps`` rounded up to whole batches; the warm-up and learning-rate
schedule follow ``train.steps``), written to ``OUT/LABEL`` with its log ``OUT/LABEL.log``. The
default runs are O0, O1, O2, O3 and O0 with ``train.seed=1``. The first run is the reference;
runs at the reference's level with other overrides are the noise floor (another
initialisation and data order). A run whose ``metrics.jsonl`` already holds its last step's
validation loss is not run again, so the study can be spread over several calls.

Writes ``OUT/convergence.md`` (validation loss at every evaluation and the relative gap of each
run to the reference, in %; the final gaps against the noise floor; median tokens/s),
``OUT/convergence.json`` and ``OUT/convergence.png`` (validation loss and relative gap against
step), and prints the Markdown.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

DEFAULT_RUNS = ("O0=O0", "O1=O1", "O2=O2", "O3=O3", "O0-seed1=O0,train.seed=1")
TARGET_GAP = 0.005  # the bound on the final relative validation-loss gap


def parse_run(text: str) -> tuple[str, str, list[str]]:
  """'LABEL=LEVEL[,key=value...]' -> (label, level, overrides)."""
  label, sep, rest = text.partition("=")
  if not sep or not rest or not label.replace("-", "").replace("_", "").isalnum():
    raise SystemExit(f"--run {text!r}: use LABEL=LEVEL[,key=value...], LABEL of letters, "
                     "digits, '-' and '_'")
  level, *overrides = rest.split(",")
  return label, level, overrides


def steps_for(config: str, sets: list[str], tokens: float) -> tuple[int, int]:
  """(train.steps covering `tokens`, tokens per step) for `config` with `sets` applied."""
  from fp8jax.config import load_config
  cfg = load_config(config, sets)
  per_step = cfg.train.batch_size * cfg.data.seq_len
  return math.ceil(tokens / per_step), per_step


def read_records(run_dir: str) -> list[dict]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  from fp8jax.train.metrics import read_jsonl
  return read_jsonl(path)


def val_losses(records: list[dict]) -> dict[int, float]:
  """{step: validation loss}; a resumed run's later record of a step wins."""
  return {r["step"]: r["val_loss"] for r in records if "val_loss" in r}


def finished(run_dir: str, steps: int) -> bool:
  return steps in val_losses(read_records(run_dir))


def train(config: str, level: str, sets: list[str], steps: int, run_dir: str) -> int:
  """One ``fp8jax train`` run into `run_dir` (log beside it); its exit code."""
  cmd = [sys.executable, "-m", "fp8jax.cli", "train", "--config", config, "--no-progress",
         "--overwrite", "--set", f"train.opt_level={level}", "--set", f"train.steps={steps}",
         "--set", f"runtime.run_dir={run_dir}"]
  for s in sets:
    cmd += ["--set", s]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
  with open(run_dir + ".log", "w") as log:
    print(f"{os.path.basename(run_dir)}: {' '.join(cmd[1:])}", flush=True)
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode


def relative_gap(loss: float, reference: float) -> float:
  return (loss - reference) / reference


def summarise(curves: dict[str, dict[int, float]], levels: dict[str, str],
              speeds: dict[str, float | None]) -> dict:
  """The study's numbers: per run, its gap to the first run at every shared evaluation step
  and at the last; the noise floor is the largest |final gap| of the runs at the reference's
  level."""
  labels = list(curves)
  ref = labels[0]
  steps = sorted(set.intersection(*(set(c) for c in curves.values()))) if curves else []
  gaps = {l: {s: relative_gap(curves[l][s], curves[ref][s]) for s in steps} for l in labels}
  last = steps[-1] if steps else None
  noise_runs = [l for l in labels[1:] if levels[l] == levels[ref]]
  noise = max((abs(gaps[l][last]) for l in noise_runs), default=None) if last else None
  final = {}
  for l in labels[1:]:
    if last is None:
      continue
    g = gaps[l][last]
    final[l] = {"level": levels[l], "val_loss": curves[l][last], "gap": g,
                "within_target": abs(g) <= TARGET_GAP,
                "within_noise": None if noise is None or l in noise_runs else abs(g) <= noise}
  return {"reference": ref, "steps": steps, "last_step": last, "val_loss": curves,
          "gaps": gaps, "noise": noise, "noise_runs": noise_runs, "final": final,
          "tokens_per_s": speeds, "levels": levels}


def markdown(study: dict, tokens_per_step: int) -> str:
  labels = list(study["val_loss"])
  ref = study["reference"]
  head = ["step", "tokens (M)"] + [f"{l} val" for l in labels] + [f"{l} gap %" for l in labels[1:]]
  rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for s in study["steps"]:
    cells = [str(s), f"{s * tokens_per_step / 1e6:.1f}"]
    cells += [f"{study['val_loss'][l][s]:.4f}" for l in labels]
    cells += [f"{100 * study['gaps'][l][s]:+.2f}" for l in labels[1:]]
    rows.append("| " + " | ".join(cells) + " |")
  out = ["\n".join(rows), ""]
  noise = study["noise"]
  if study["last_step"] is not None:
    out.append(f"Final gaps to {ref} at step {study['last_step']} (target |gap| <= "
               f"{100 * TARGET_GAP:.1f}%; seed noise "
               + (f"{100 * noise:.2f}% from {', '.join(study['noise_runs'])})" if noise is not None
                  else "not measured)") + ":")
    for l, f in study["final"].items():
      verdict = "noise floor" if f["within_noise"] is None else (
          "inside the seed noise" if f["within_noise"] else "outside the seed noise")
      out.append(f"- {l} ({f['level']}): {f['val_loss']:.4f}, {100 * f['gap']:+.2f}% "
                 f"({'within' if f['within_target'] else 'over'} the target; {verdict})")
  out.append("")
  out.append("Median tokens/s: " + ", ".join(
      f"{l} {v:,.0f}" if v else f"{l} n/a" for l, v in study["tokens_per_s"].items()))
  return "\n".join(out)


def plot(study: dict, path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(13, 4.5))
  for l, curve in study["val_loss"].items():
    steps = sorted(curve)
    line, = ax_loss.plot(steps, [curve[s] for s in steps], marker="o", markersize=2, label=l)
    if l != study["reference"]:
      ax_gap.plot(study["steps"], [100 * study["gaps"][l][s] for s in study["steps"]],
                  marker="o", markersize=2, color=line.get_color(), label=l)
  ax_gap.axhline(0.0, color="gray", linewidth=0.5)
  for sign in (-1, 1):
    ax_gap.axhline(sign * 100 * TARGET_GAP, color="gray", linestyle=":", linewidth=0.8)
  ax_loss.set(xlabel="step", ylabel="validation loss (nats/token)", title="validation loss")
  ax_loss.set_yscale("log")
  ax_gap.set(xlabel="step", ylabel=f"(run - {study['reference']}) / {study['reference']}, %",
             title="relative validation-loss gap (dotted: target)")
  ax_loss.legend(fontsize=8)
  ax_gap.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def median_speed(records: list[dict]) -> float | None:
  values = [r["tokens_per_s"] for r in records if "tokens_per_s" in r][1:]  # not the compile window
  return statistics.median(values) if values else None


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--config", default="configs/gpt_125m.yaml")
  p.add_argument("--tokens", type=float, default=150e6, help="training tokens per run")
  p.add_argument("--out", default="runs/convergence")
  p.add_argument("--run", action="append", default=[])
  p.add_argument("--set", action="append", default=[], help="override for every run")
  p.add_argument("--report-only", action="store_true", help="tabulate the runs already in OUT")
  a = p.parse_args()
  runs = [parse_run(r) for r in (a.run or DEFAULT_RUNS)]
  steps, per_step = steps_for(a.config, a.set, a.tokens)
  os.makedirs(a.out, exist_ok=True)
  print(f"{len(runs)} runs of {a.config}: {steps} steps x {per_step} tokens = "
        f"{steps * per_step / 1e6:.1f}M tokens each", flush=True)
  failed = []
  for label, level, overrides in runs:
    run_dir = os.path.join(a.out, label)
    if a.report_only or finished(run_dir, steps):
      continue
    code = train(a.config, level, a.set + overrides, steps, run_dir)
    if code != 0:
      failed.append(label)
      print(f"{label}: exit {code}; the end of {run_dir}.log:", flush=True)
      with open(run_dir + ".log") as f:
        print(f.read()[-3000:], flush=True)
  done = [(l, lv) for l, lv, _ in runs if finished(os.path.join(a.out, l), steps)]
  if not done or done[0][0] != runs[0][0]:
    raise SystemExit(f"the reference run {runs[0][0]} has not finished; nothing to compare")
  records = {l: read_records(os.path.join(a.out, l)) for l, _ in done}
  study = summarise({l: val_losses(r) for l, r in records.items()}, dict(done),
                    {l: median_speed(r) for l, r in records.items()})
  study.update(config=a.config, sets=a.set, steps_per_run=steps, tokens_per_step=per_step,
               missing=[l for l, _, _ in runs if l not in records])
  text = markdown(study, per_step)
  with open(os.path.join(a.out, "convergence.md"), "w") as f:
    f.write(text + "\n")
  with open(os.path.join(a.out, "convergence.json"), "w") as f:
    json.dump(study, f, indent=1)
  plot(study, os.path.join(a.out, "convergence.png"))
  print(text)
  if study["missing"]:
    print(f"not finished: {', '.join(study['missing'])}")
  if failed:
    raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
  main()
