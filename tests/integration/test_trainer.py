"""The main job: `fp8jax train` end to end on the tiny config, logs, plot, bad configs."""
import json
import os
import subprocess
import sys

import numpy as np

from fp8jax import cli
from fp8jax.config import load_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


# O1 and O2 against O0 over 60 steps: the fp8_vs_bf16 notebook's runs (test_notebooks.py).


def test_cli_train_writes_logs_and_plot(tmp_path, capsys):
  args = ["train", "--config", TINY, "--no-progress", "--set", "train.steps=4",
          "--set", "train.warmup_steps=1",
          "--set", "train.log_every=2", "--set", "train.eval_every=0", "--set",
          "train.eval_batches=1", "--set", "model.n_layers=1", "--set",
          f"runtime.run_dir={tmp_path}/{{name}}"]
  assert cli.main(args) == 0
  out = capsys.readouterr().out
  run_dir = tmp_path / "tiny"
  assert str(run_dir) in out
  records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  steps = [r["step"] for r in records if "loss" in r]
  assert steps == [2, 4] and all(np.isfinite(r["loss"]) for r in records if "loss" in r)
  assert (run_dir / "config.yaml").exists()
  # the "auto" model settings, resolved for this CPU, said at the start and saved as run
  assert ("fp8jax train: auto settings: model.attention_impl=xla (no cuDNN on cpu); "
          "model.remat_policy=full (on cpu); model.scan_layers=True (on cpu)") in out
  saved = load_config(str(run_dir / "config.yaml")).model
  assert (saved.attention_impl, saved.remat_policy, saved.scan_layers) == ("xla", "full", True)
  png = tmp_path / "runs.png"
  assert cli.main(["plot", str(run_dir), "-o", str(png)]) == 0
  assert png.stat().st_size > 10_000


def test_cli_train_refuses_a_bad_config_with_a_clear_message(tmp_path):
  result = subprocess.run([sys.executable, "-m", "fp8jax.cli", "train", "--config", TINY,
                           "--set", "model.dropout_rate=0.1"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
  assert result.returncode != 0
  assert "model.dropout_rate=0.1" in result.stderr
  assert "not supported yet" in result.stderr
