"""train.batch_ramp: the batch grows in whole microbatches by step or by tokens seen; the
microbatch count is data, so the whole ramp runs one compiled train step, and each of its
steps equals the step compiled for that batch size alone."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.config import load_config
from fp8jax.train.build import model_and_optimizer
from fp8jax.train.loop import Trainer
from fp8jax.train.step import GroupLoop, build_step

SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
         "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000",
         "train.warmup_steps=1", "train.eval_every=0", "train.fp8_health_every=0"]


def _config(level="O0", *overrides, steps=8):
  # 6 microbatches of 2 sequences x 16 tokens (32 tokens) per full step unless overridden.
  return load_config("configs/tiny.yaml", SMALL + [
      f"train.opt_level={level}", f"train.steps={steps}", "train.batch_size=12",
      "train.microbatches=6", *overrides])


def test_ramp_by_steps_and_by_tokens_rounds_down_to_whole_microbatches():
  """Tokens per step grow linearly (start + (end - start) * progress), floored to
  whole microbatches of 32 tokens: by steps (progress = step / 5), by tokens seen
  (progress = seen / 600); the full batch after the ramp and after the run's last step."""
  by_steps = _config("O0", "train.batch_ramp={start_tokens: 32, end_tokens: 192, "
                            "ramp_steps: 5}", steps=8)
  # 32 + 160 * s // 5 = 32, 64, 96, 128, 160, 192 tokens
  assert [by_steps.microbatches_at(s) for s in range(9)] == [1, 2, 3, 4, 5, 6, 6, 6, 6]
  assert [by_steps.tokens_seen(s) for s in range(4)] == [0, 32, 96, 192]
  assert by_steps.tokens_seen(9) == 32 * (1 + 2 + 3 + 4 + 5 + 6 * 3) + 192
  by_tokens = _config("O0", "train.batch_ramp={start_tokens: 32, end_tokens: 192, "
                             "ramp_tokens: 600}", steps=8)
  # seen 0, 32, 64, 96, 128, 192, 256, 352 -> 32 + 160 * min(seen, 600) // 600 tokens
  # = 32, 40, 49, 57, 66, 83, 100, 125
  assert [by_tokens.microbatches_at(s) for s in range(9)] == [1, 1, 1, 1, 2, 2, 3, 3, 6]
  assert by_steps.batch_size_at(2) == 6
  with pytest.raises(ValueError, match="exactly one of ramp_steps"):
    _config("O0", "train.batch_ramp={start_tokens: 32, end_tokens: 192}")
  with pytest.raises(ValueError, match="exactly one of ramp_steps"):
    _config("O0", "train.batch_ramp={start_tokens: 32, end_tokens: 192, ramp_steps: 2, "
                  "ramp_tokens: 64}")


def test_learning_rate_can_follow_tokens_seen():
  """lr_follows: tokens reads the warmup-cosine schedule at tokens seen / tokens of a full
  step: warmup over one full step's tokens, the decay ending with the run (min_lr_ratio)."""
  cfg = _config("O0", "train.batch_ramp={start_tokens: 32, end_tokens: 192, ramp_steps: 5, "
                      "lr_follows: tokens}", steps=8)
  _, schedule, _ = model_and_optimizer(cfg)
  t = cfg.train
  seen = [cfg.tokens_seen(s) / 192 for s in range(9)]
  lr = [float(schedule(s)) for s in range(9)]
  total = seen[8]
  assert seen[3] == 1.0 and total > 2  # warmup ends at step 3 (32 + 64 + 96 tokens)
  for s in range(9):  # linear warmup to one full step's tokens, then cosine over [1, total]
    frac = (seen[s] - 1) / (total - 1)
    want = t.learning_rate * (seen[s] if seen[s] < 1 else t.min_lr_ratio + (
        1 - t.min_lr_ratio) * 0.5 * (1 + np.cos(np.pi * frac)))
    assert lr[s] == pytest.approx(want, rel=1e-4, abs=1e-12), s
  assert lr[8] == pytest.approx(t.learning_rate * t.min_lr_ratio, rel=1e-4)
  by_step = model_and_optimizer(_config("O0", "train.batch_ramp={start_tokens: 32, "
                                              "end_tokens: 192, ramp_steps: 5}"))[1]
  assert float(by_step(3)) != pytest.approx(lr[3], rel=1e-3)  # the clocks differ mid-ramp


def _copy(tree):
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


@pytest.mark.parametrize("level,compared", [("O0", (0, 2, 4)), ("O1", (0, 4))])
def test_a_ramp_compiles_one_step_equal_to_each_fixed_size_step(level, compared, caplog):
  """A ramp over 5 distinct microbatch counts (1..5) compiles the train step once (jax's
  compile log), and a ramp step gives the loss and updated parameters of the step compiled
  for its count alone, from the same state and batch: equal up to f32 summation order (1e-6;
  at O1 the same FP8 casts). Compared at counts 1, 3 and 5 (O0) or 1 and 5 (O1) to save
  compiles: a loop that ran a wrong number of parts would be off at every count but one."""
  cfg = _config(level, "train.batch_ramp={start_tokens: 32, end_tokens: 160, ramp_steps: 4}",
                "train.batch_size=10", "train.microbatches=5", steps=5)
  trainer = Trainer(cfg, progress=False)
  counts = [cfg.microbatches_at(s) for s in range(cfg.train.steps)]
  assert counts == [1, 2, 3, 4, 5]
  caplog.set_level(logging.WARNING)
  for step in range(cfg.train.steps):
    batch = trainer.next_batch(step)
    k = counts[step]
    assert batch.shape[0] == k * cfg.train.microbatch_size
    if step in compared:
      fixed = build_step(trainer.model.apply, trainer.tx, trainer.plan, k)
      want_state, want = fixed(_copy(trainer.state), batch)
    with jax.log_compiles():
      trainer.state, got = trainer.step_fn(k)(trainer.state, batch)
    if step in compared:
      assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-6)
      for a, b in zip(jax.tree.leaves(trainer.state.params),
                      jax.tree.leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                   rtol=1e-6, atol=1e-7)
  compiled = [m for m in (r.getMessage() for r in caplog.records)
              if m.startswith("Compiling") and "train_step" in m.split(" with ")[0]]
  assert len(compiled) == 1, compiled
  assert len(trainer.steps.built()) == 1


def test_a_balanced_ramp_runs_one_per_group_step(caplog):
  """With parallel.device_map the per-group step takes each step's counts as data: the ramp
  (1, 3, 5 microbatches over 8 groups, some idle) compiles once and its last step equals the
  per-group step compiled for 5 microbatches alone."""
  cfg = _config("O0", "train.batch_ramp={start_tokens: 32, end_tokens: 160, ramp_steps: 2}",
                "train.batch_size=10", "train.microbatches=5", "parallel.device_map={cpu: 1.0}",
                steps=3)
  trainer = Trainer(cfg, progress=False)
  assert [cfg.microbatches_at(s) for s in range(3)] == [1, 3, 5]
  caplog.set_level(logging.WARNING)
  for step in range(3):
    batch, k = trainer.next_batch(step), cfg.microbatches_at(step)
    if step == 2:
      fixed = build_step(trainer.model.apply, trainer.tx, trainer.plan, k,
                         GroupLoop(trainer.plan.mesh, counts=trainer.balanced_counts,
                                   microbatch_size=2))
      want_state, want = fixed(_copy(trainer.state), batch)
    with jax.log_compiles():
      trainer.state, got = trainer.step_fn(k)(trainer.state, batch)
  assert float(got["loss"]) == pytest.approx(float(want["loss"]), rel=1e-6)
  for a, b in zip(jax.tree.leaves(trainer.state.params), jax.tree.leaves(want_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
  compiled = [m for m in (r.getMessage() for r in caplog.records)
              if m.startswith("Compiling") and "train_step" in m.split(" with ")[0]]
  assert len(compiled) == 1, compiled
