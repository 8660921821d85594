"""The training loop reads device values only at log, evaluation, checkpoint and watchdog
steps: on every other step the host dispatches the next step without waiting for this one."""
import numpy as np

from fp8jax.config import load_config
from fp8jax.train.loop import Trainer

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
         "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000", "train.batch_size=4",
         "train.warmup_steps=1", "train.steps=7", "train.log_every=3", "train.eval_every=0",
         "train.fp8_health_every=0", "train.eval_batches=1"]


class _Watched:
  """A metric value that records the loop step during which the host reads it."""

  def __init__(self, value, reads: list, now: list):
    self.value, self.reads, self.now = value, reads, now

  def _read(self):
    self.reads.append(self.now[0])
    return np.asarray(self.value)

  def __float__(self):
    return float(self._read())

  def __bool__(self):
    return bool(self._read())

  def __int__(self):
    return int(self._read())

  def __array__(self, dtype=None, copy=None):
    a = self._read()
    return a if dtype is None else a.astype(dtype)


def test_metrics_are_read_only_at_log_steps(tmp_path):
  """Steps 0..6 with logs after steps 2, 5 and 6 (the last): every metric the loop reads is
  read during one of those steps, and all steps' skip flags are read (none is lost)."""
  cfg = load_config("configs/tiny.yaml", SMALL + ["train.opt_level=O0",
                                                  f"runtime.run_dir={tmp_path}"])
  trainer = Trainer(cfg, progress=False)
  reads, now = [], [None]
  next_batch, step_fn = trainer.next_batch, trainer.step_fn

  def batch_at(step):
    now[0] = step
    return next_batch(step)

  def watched_step(microbatches):
    run = step_fn(microbatches)

    def step(state, batch):
      state, metrics = run(state, batch)
      return state, {k: _Watched(v, reads, now) for k, v in metrics.items()}
    return step

  trainer.next_batch, trainer.step_fn = batch_at, watched_step
  final = trainer.run()
  assert np.isfinite(final["loss"])
  assert reads and set(reads) == {2, 5, 6}, reads
  assert trainer.skips.total == 0 and trainer._unchecked_metrics == []
