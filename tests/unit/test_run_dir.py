"""A run folder holding an earlier run: refused with the ways out, replaced on request, left
to a resumed run; what a stopped run says."""
import json
import os

import pytest

from fp8jax.config import load_config
from fp8jax.train.resume import (RunDirInUse, claim_run_dir, earlier_run, stopped_line)


def _config(tmp_path, *extra):
  return load_config(None, [f"runtime.run_dir={tmp_path}/{{name}}", "runtime.name=exp",
                            *extra])


def _earlier_run(run_dir, steps=(10, 20), checkpoints=()):
  os.makedirs(run_dir / "checkpoints", exist_ok=True)
  with open(run_dir / "metrics.jsonl", "w") as f:
    for s in steps:
      f.write(json.dumps({"step": s, "loss": 5.0 - s / 100}) + "\n")
    f.write('{"step": 3')  # a line cut short by a kill
  for name in ("events.jsonl", "config.yaml", "events.out.tfevents.123.host", "notes.txt"):
    (run_dir / name).write_text("x")
  for name in checkpoints:
    (run_dir / "checkpoints" / name).mkdir()


class _Checkpoints:
  reloads = 0

  def reload(self):
    self.reloads += 1


def test_a_fresh_folder_is_claimed(tmp_path):
  cfg = _config(tmp_path)
  claim_run_dir(cfg, cfg.runtime.run_path)  # does not exist yet
  os.makedirs(cfg.runtime.run_path)
  (tmp_path / "exp" / "metrics.jsonl").write_text("")  # opened, nothing logged yet
  claim_run_dir(cfg, cfg.runtime.run_path)
  assert earlier_run(cfg, cfg.runtime.run_path) is None


def test_an_earlier_run_is_refused_with_the_ways_out(tmp_path):
  cfg = _config(tmp_path)
  _earlier_run(tmp_path / "exp")
  (tmp_path / "exp-2").mkdir()  # taken: the hint skips it
  with pytest.raises(RunDirInUse) as e:
    claim_run_dir(cfg, cfg.runtime.run_path)
  assert str(e.value) == (
      f"{tmp_path}/exp already holds a run (metrics.jsonl logs steps 10-20); a new run would "
      "mix with it: start another (--set runtime.name=exp-3) or replace it (--overwrite)")
  _earlier_run(tmp_path / "exp", checkpoints=("5", "20", "25.orbax-checkpoint-tmp-9"))
  message = str(pytest.raises(RunDirInUse, claim_run_dir, cfg, cfg.runtime.run_path).value)
  assert "(metrics.jsonl logs steps 10-20; checkpoints of steps 5, 20)" in message
  assert "continue it (--set checkpoint.auto_resume=true)" in message
  fixed = _config(tmp_path, f"runtime.run_dir={tmp_path}/fixed")
  _earlier_run(tmp_path / "fixed")
  message = str(pytest.raises(RunDirInUse, claim_run_dir, fixed, fixed.runtime.run_path).value)
  assert "start another (--set runtime.run_dir=<another folder>)" in message


def test_a_resumed_run_continues_and_overwrite_replaces(tmp_path):
  run_dir = tmp_path / "exp"
  _earlier_run(run_dir, checkpoints=("20", "25.orbax-checkpoint-tmp-9", "damaged-10-1"))
  before = sorted(os.listdir(run_dir))
  claim_run_dir(_config(tmp_path, "checkpoint.auto_resume=true"), str(run_dir))
  assert sorted(os.listdir(run_dir)) == before  # resuming: untouched
  checkpoints = _Checkpoints()
  claim_run_dir(_config(tmp_path), str(run_dir), overwrite=True, checkpoints=checkpoints)
  assert sorted(os.listdir(run_dir)) == ["checkpoints", "notes.txt"]  # not ours: kept
  assert os.listdir(run_dir / "checkpoints") == [] and checkpoints.reloads == 1
  claim_run_dir(_config(tmp_path), str(run_dir))  # now free


def test_stopped_line_says_how_to_resume(tmp_path):
  class Saved:
    directory = "/ckpt"
  cfg = _config(tmp_path)
  assert stopped_line(7, "SIGINT", cfg, Saved()) == (
      "interrupted: stopped after step 7, checkpoint saved in /ckpt; resume with the same "
      "command and --set checkpoint.auto_resume=true")
  assert stopped_line(7, "SIGTERM", _config(tmp_path, "checkpoint.auto_resume=true"),
                      Saved()).endswith("; run the same command again to resume")
  assert stopped_line(7, "SIGINT", cfg, None) == (
      "interrupted: stopped after step 7 (checkpointing is off: nothing saved; set "
      "checkpoint.checkpoint_every_n_steps to keep the work of a stopped run)")
