"""The evaluation step: the train step's microbatches, summed in one program per call, give
the mean loss of the evaluation microbatches (a last, shorter call included)."""
import jax
import numpy as np

from fp8jax.config import load_config
from fp8jax.train.loop import Trainer
from fp8jax.train import batch_loss

TINY = "configs/tiny.yaml"


def test_evaluate_is_the_mean_loss_of_its_microbatches(tmp_path):
  # 5 microbatches in calls of 2: 2 + 2 + 1 (the last call's empty slot must not count)
  cfg = load_config(TINY, ["train.opt_level=O1", "train.batch_size=4", "train.microbatches=2",
                           "train.eval_batches=5", "model.n_layers=2", "model.d_model=64",
                           "model.d_ff=128", "checkpoint.checkpoint_every_n_steps=0",
                           f"runtime.run_dir={tmp_path}"])
  trainer = Trainer(cfg, progress=False)
  trainer.state, _ = trainer.step_fn(2)(trainer.state, trainer.next_batch(0))  # FP8 scales
  got = trainer.evaluate()
  t, d = cfg.train, cfg.data
  val = trainer.data.batches("val", t.microbatch_size, d.seq_len, seed=d.seed)
  variables = trainer.state.variables()
  apply = jax.jit(lambda part: batch_loss(trainer.model.apply, variables, part))
  losses = np.array([float(apply(val.next())) for _ in range(5)], np.float64)
  assert np.ptp(losses) > 1e-3, losses  # one microbatch alone, or 6 of them, would differ
  np.testing.assert_allclose(got, losses.mean(), rtol=2e-5)
  assert trainer.evaluate() == got  # the same microbatches every time
