"""The main job: `fp8jax train` end to end on the tiny config, logs, plot, bad configs."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from fp8jax import cli
from fp8jax.config import load_config
from fp8jax.train.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")


def _run(tmp_path, level, steps, **extra):
  overrides = [f"train.opt_level={level}", f"train.steps={steps}", f"runtime.name=t_{level}",
               f"runtime.run_dir={tmp_path}/{{name}}"] + [f"{k}={v}" for k, v in extra.items()]
  return Trainer(load_config(TINY, overrides), progress=False).run(), tmp_path / f"t_{level}"


@pytest.mark.slow
def test_o1_and_o2_match_o0_validation_loss_within_one_percent(tmp_path):
  small = {"model.n_layers": 2, "train.eval_batches": 4}  # 60 steps: O1 0.1%, O2 0.3% off O0
  o0, _ = _run(tmp_path, "O0", 60, **small)
  o2, _ = _run(tmp_path, "O2", 60, **small)
  o1, run_dir = _run(tmp_path, "O1", 60, **small)
  for r in (o0, o1, o2):
    assert r["val_loss"] < 3.0  # learned (start: ln 256 = 5.5)
  assert abs(o1["val_loss"] - o0["val_loss"]) < 0.01 * o0["val_loss"]
  assert abs(o2["val_loss"] - o0["val_loss"]) < 0.01 * o0["val_loss"]
  records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  assert any("fp8/output_grad/scale_max" in r for r in records)
  health = [r for r in records if "fp8/output_grad/flushed" in r]
  assert health and all(0 <= r["fp8/input/saturated"] < 0.01 for r in health)
  assert any(name.startswith("events.out.tfevents") for name in os.listdir(run_dir))


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
