"""A run compiles its train step once (the FP8 calibration is a probe pass, not a second
step program; with pipeline stages too), its first programs (the calibration pass, the step)
in the compile thread while the next is traced, its health probe at its first use, and a
second run of the same config loads its programs from the persistent compilation cache
(``runtime.compile_cache``) and its traced programs from beside it
(``fp8jax.train.program_cache``), never those of another config."""
import os
import time

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from fp8jax.config import load_config
from fp8jax.train import compiles, program_cache
from fp8jax.train.compiles import CompileLog
from fp8jax.train.loop import Trainer

TINY = "configs/tiny.yaml"


@pytest.fixture
def session_cache():
  """Puts back the session's compilation cache folder after the test."""
  before = jax.config.jax_compilation_cache_dir
  yield
  jax.config.update("jax_compilation_cache_dir", before)
  compilation_cache.reset_cache()


def _run(cfg) -> CompileLog:
  t0 = time.perf_counter()
  with CompileLog() as log:
    final = Trainer(cfg, progress=False, overwrite=True).run()
  # the wait for the first step is reported, and it is part of the run
  assert 0 < final["first_step_s"] < time.perf_counter() - t0
  return log


SMALL = ["train.steps=2", "train.log_every=1", "train.batch_size=4", "model.n_layers=1",
         "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "data.seq_len=32",
         "model.max_seq_len=32", "data.max_bytes=200000",
         "checkpoint.checkpoint_every_n_steps=0"]


# Pipeline stages (8 CPU devices: 2 stages x data 4): the calibration pass and the cast-health
# probe run through the stages; 1F1B and a batch ramp whose first step runs fewer
# microbatches than the stages (one dynamic step program).
PIPELINE = ["parallel.pipeline_parallel_size=2", "parallel.pipeline_schedule=1f1b",
            "parallel.zero_stage=1", "model.n_layers=2", "train.batch_size=16",
            "train.microbatches=2",
            "train.batch_ramp={start_tokens: 256, end_tokens: 512, ramp_steps: 1}"]


@pytest.mark.parametrize("stages", [1, 2])
def test_one_train_step_compile_per_run_and_a_second_run_hits_the_cache(tmp_path,
                                                                         session_cache,
                                                                         stages, capsys):
  cache = tmp_path / "cache"
  cfg = load_config(TINY, SMALL + [
      "train.opt_level=O1", "fp8.calibrate=always", "train.eval_every=1",
      "train.eval_batches=2", "train.fp8_health_every=1", f"runtime.run_dir={tmp_path / 'run'}",
      f"runtime.compile_cache={cache}", *(PIPELINE if stages > 1 else [])])
  first = _run(cfg)
  assert "first step done" in capsys.readouterr().out
  assert jax.config.jax_compilation_cache_dir == str(cache)
  names = ("train_step", "fp8_calibration", "fp8_probe", "eval_step")
  for name in names:
    assert len(first.of(name)) == 1, (name, first.compiles)
  assert not any(c.cached for c in first.of("train_step"))
  for name in ("train_step", "fp8_calibration"):  # compiled ahead, while the next was traced
    assert first.of(name)[0].thread.startswith(compiles.COMPILE_THREAD), first.compiles
  # the health probe runs after the first step: it compiles at its first use
  assert not first.of("fp8_probe")[0].thread.startswith(compiles.COMPILE_THREAD)
  second = _run(cfg)
  for name in names:
    assert [c.cached for c in second.of(name)] == [True], (name, second.compiles)


def test_cache_dir_setting(monkeypatch, tmp_path, session_cache):
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
  jax.config.update("jax_compilation_cache_dir", None)
  assert compiles.cache_dir("auto") == compiles.DEFAULT_CACHE_DIR
  assert compiles.cache_dir(True) == compiles.DEFAULT_CACHE_DIR
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "given"))
  assert compiles.cache_dir("auto") == str(tmp_path / "given")
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert compiles.cache_dir("auto") == str(tmp_path / "env")
  assert compiles.cache_dir(False) is None and compiles.cache_dir("off") is None
  assert compiles.cache_dir(str(tmp_path / "mine")) == str(tmp_path / "mine")
  assert compiles.use_compile_cache(False) is None
  assert jax.config.jax_compilation_cache_dir is None
  (tmp_path / "a_file").write_text("")
  assert compiles.use_compile_cache(str(tmp_path / "a_file" / "cache")) is None  # warned, off


def test_a_second_run_loads_its_traced_programs_and_another_config_traces_its_own(
    tmp_path, session_cache, monkeypatch):
  """Two runs of one config (but their names and folders) sharing a compilation cache
  folder: the second exports no program (it loads each one traced by the first) and trains
  to the same losses; a run with another learning rate traces its own programs and trains
  differently."""

  def run(name: str, *extra: str):
    cfg = load_config(TINY, SMALL + [
        "train.opt_level=O2", "train.eval_every=2", "train.eval_batches=1",
        f"runtime.compile_cache={tmp_path / 'cache'}", f"runtime.name={name}",
        f"runtime.run_dir={tmp_path / name}", *extra])
    final = Trainer(cfg, progress=False).run()
    return final["loss"], final["val_loss"]

  first = run("a")
  assert os.listdir(tmp_path / "cache" / program_cache.FOLDER)
  exports = []
  real = program_cache.SavedJit._export
  monkeypatch.setattr(program_cache.SavedJit, "_export",
                      lambda self, *a: exports.append(self.key) or real(self, *a))
  assert run("b") == first and exports == []
  other = run("c", "train.learning_rate=0.003")
  assert exports and other != first
