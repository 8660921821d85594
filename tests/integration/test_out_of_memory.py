"""Out of device memory is a diagnosis: the phase, what it asked for, what the device has and
what to change, in one line and exit code 1; with checkpointing on, the last good state is on
disk. XLA's error is injected (a ``JaxRuntimeError`` with RESOURCE_EXHAUSTED, as XLA raises it
when an allocation fails)."""
import re

import jax
import pytest

import ft_util
from fp8jax import cli
from fp8jax.checkpoint import CheckpointManager
from fp8jax.hardware import GiB
from fp8jax.train import oom
from fp8jax.train.evaluation import EvalStep
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
