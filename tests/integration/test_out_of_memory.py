"""Out of device memory is a diagnosis: the phase, what it asked for, what the device has and
what to change, in one line and exit code 1; with checkpointing on, the last good state is on
disk. XLA's error is injected (a ``JaxRuntimeError`` with RESOURCE_EXHAUSTED, as XLA raises it
when an allocation fails)."""
import json
import re
import shutil

import jax
import pytest

import ft_util
from fp8jax import cli
from fp8jax.checkpoint import CheckpointManager
from fp8jax.hardware import GiB
from fp8jax.config import load_config
from fp8jax.train import guards, loop, oom
from fp8jax.train.evaluation import EvalStep, Probe
from fp8jax.train.fallback import Bf16Loss
from fp8jax.train.loop import Trainer
from fp8jax.train.step import TrainStep

XLA_OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 152.31GiB.: "
           "executable_name='jit_eval_step'")


def _run(tmp_path, capsys, **train):
  config = ft_util.tiny_config(tmp_path / "c.yaml", tmp_path / "run",
                               train={"steps": 3, **train},
                               checkpoint={"checkpoint_every_n_steps": 2, "auto_resume": False})
  code = cli.main(["train", "--config", config, "--no-progress"])
  err = capsys.readouterr().err.strip().splitlines()
  return code, err, CheckpointManager(tmp_path / "run" / "checkpoints").latest_step()


def test_evaluation_out_of_memory_names_the_phase_and_saves_the_state(tmp_path, capsys,
                                                                      monkeypatch):
  def fail(self, state, microbatches):
    raise jax.errors.JaxRuntimeError(XLA_OOM)
  monkeypatch.setattr(EvalStep, "__call__", fail)
  monkeypatch.setattr(oom, "device_memory", lambda: (80 * GiB, 139.8 * GiB))
  code, err, saved = _run(tmp_path, capsys)  # the one evaluation: after the last step
  assert code == 1 and len(err) == 1, err  # one line, no traceback
  assert err[0].startswith(
      "fp8jax: error: out of device memory in evaluation (needs ~232.3 GiB (152.3 GiB more "
      "than the 80.0 GiB in use), the device has 139.8 GiB): try "), err[0]
  assert "train.eval_every=0" in err[0]
  assert saved == 3 and "newest checkpoint is step 3" in err[0]  # saved after the error


def test_train_step_out_of_memory_keeps_the_previous_checkpoint(tmp_path, capsys,
                                                                monkeypatch):
  real = TrainStep.__call__

  def fail_third(self, state, batch):
    if int(state.step) == 2:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 12345678 bytes.")
    return real(self, state, batch)
  monkeypatch.setattr(TrainStep, "__call__", fail_third)
  code, err, saved = _run(tmp_path, capsys, batch_size=4, microbatches=2)
  assert code == 1 and len(err) == 1, err
  assert re.match(r"fp8jax: error: out of device memory in train step \(needs ~0\.0 GiB, the "
                  r"device's limit is unknown\): try smaller microbatches \(train\.microbatches=4: "
                  r"the same batch of 4 sequences in microbatches of 1\)", err[0]), err[0]
  assert saved == 2 and "newest checkpoint is step 2" in err[0]


def test_other_runtime_errors_keep_their_traceback(tmp_path, capsys, monkeypatch):
  def fail(self, state, microbatches):
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")
  monkeypatch.setattr(EvalStep, "__call__", fail)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    _run(tmp_path, capsys)


@pytest.mark.parametrize("message,want", [
    ("Out of memory while trying to allocate 152.31GiB.", 152.31 * GiB),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 2.5MiB", 2.5 * 2**20),
    ("Out of memory while trying to allocate 1234 bytes", 1234),
    ("RESOURCE_EXHAUSTED: nothing to read", None)])
def test_requested_bytes(message, want):
  assert oom.requested_bytes(message) == pytest.approx(want) if want else \
      oom.requested_bytes(message) is None


def test_the_default_monitors_step_aside_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
  """The FP8 cast-health probe and the FP8-BF16 loss gap (on by default) warn once, switch
  off and leave the run to finish; the divergence watchdog (a guard asked for) is fatal."""
  calls = {"probe": 0, "bf16": 0}

  def fail(name):
    def call(self, state, batch):
      calls[name] += 1
      raise jax.errors.JaxRuntimeError(XLA_OOM)
    return call
  monkeypatch.setattr(Probe, "__call__", fail("probe"))
  monkeypatch.setattr(Bf16Loss, "__call__", fail("bf16"))
  monkeypatch.setattr(oom, "device_memory", lambda: (80 * GiB, 139.8 * GiB))
  code, err, saved = _run(tmp_path, capsys, steps=4, opt_level="O1", fp8_health_every=1)
  assert code == 0 and saved == 4, err
  assert calls == {"probe": 1, "bf16": 1}  # once each, then off
  warned = [line for line in err if "out of device memory" in line]  # stderr, one line each
  assert len(warned) == 2 and all(w.startswith("fp8jax: out of device memory") for w in warned), \
      warned
  for phase, switch in ((oom.LOSS_GAP, "no loss gap"), (oom.PROBE, "no probe")):
    line = next(w for w in warned if f"in {phase} (needs ~232.3 GiB" in w)
    assert switch in line and line.endswith(
        f"The {phase} is off for the rest of the run; training goes on"), line
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f if line.strip()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4]
  assert not any(k.startswith("fp8/") and k.endswith(("saturated", "flushed", "loss_gap"))
                 for r in records for k in r)

  monkeypatch.setattr(guards.DivergenceWatchdog, "due", lambda self, step: True)
  shutil.rmtree(tmp_path / "run")
  code, err, _ = _run(tmp_path, capsys, steps=4, opt_level="O1")
  assert code == 1 and len(err) == 1 and "in divergence check (needs" in err[0], err


def test_the_loss_gap_stays_fatal_in_a_run_of_several_processes(tmp_path, monkeypatch):
  """With several processes the others would wait for this one in the BF16 loss program's
  collectives: out of memory there ends the run (one process is enough to show the rule)."""
  config = ft_util.tiny_config(tmp_path / "c.yaml", tmp_path / "run",
                               train={"steps": 2, "opt_level": "O1", "fp8_health_every": 1})
  trainer = Trainer(load_config(config), progress=False)

  def fail(self, state, batch):
    raise jax.errors.JaxRuntimeError(XLA_OOM)
  monkeypatch.setattr(Bf16Loss, "__call__", fail)
  batch, window = trainer.next_batch(0), loop._LogWindow()
  with monkeypatch.context() as m:
    m.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(jax.errors.JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
      trainer._watchdog_loss(1, batch, window)
  assert trainer._loss_gap_due(1)
  assert trainer._watchdog_loss(1, batch, window) is None  # one process: switched off
  assert not trainer._loss_gap_due(1)
