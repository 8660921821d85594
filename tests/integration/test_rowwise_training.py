"""Row-wise FP8 scaling (fp8.granularity: rowwise) through the Trainer: a tiny GPT trains at
O1..O3 (loss finite and falling, FP8 state recorded; at O1 with the FP8 health probe), and a run
resumed from a checkpoint continues bit for bit as the uninterrupted run, FP8 state and all."""
import os
import shutil

import jax
import numpy as np
import pytest

import ft_util
from fp8jax.config import config_from_dict
from fp8jax.train.loop import Trainer
from fp8jax.train.metrics import read_jsonl


def _config(level: str, run_dir, steps: int, ckpt_dir=None, health: int = 0):
  return config_from_dict({
      "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
                "max_seq_len": 16},
      "data": {"seq_len": 16, "max_bytes": 100_000},
      "train": {"steps": steps, "batch_size": 16, "microbatches": 2, "warmup_steps": 1,
                "learning_rate": 3e-3, "eval_every": 0, "eval_batches": 1, "log_every": 1,
                "fp8_health_every": health, "opt_level": level},
      "fp8": {"granularity": "rowwise", "scaling": "current"},
      "checkpoint": ({} if ckpt_dir is None else
                     {"dir": str(ckpt_dir), "checkpoint_every_n_steps": 2, "async_save": False,
                      "auto_resume": True}),
      "runtime": {"run_dir": str(run_dir)}})


def _losses(run_dir) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
          if "loss" in r}


def _fp8_histories(trainer) -> list[np.ndarray]:
  return [np.asarray(m) for m in jax.tree.leaves(trainer.state.fp8)]


@pytest.mark.parametrize("level", ["O1", "O3"])
def test_a_tiny_gpt_trains_row_wise(tmp_path, level):
  trainer = Trainer(_config(level, tmp_path / level, 4, health=2 if level == "O1" else 0),
                    progress=False)
  assert trainer.level.recipe.rowwise
  trainer.run()
  losses = list(_losses(tmp_path / level).values())
  assert len(losses) == 4 and np.all(np.isfinite(losses)), losses
  assert losses[-1] < losses[0] - 0.3, losses
  histories = _fp8_histories(trainer)
  assert histories and all(np.all(np.isfinite(h)) for h in histories)
  assert any(np.any(h > 0) for h in histories)  # tensor amaxes recorded
  if level == "O1":  # the probe's cast fractions (of tensor-scaled casts: an upper bound)
    records = read_jsonl(os.path.join(tmp_path / level, "metrics.jsonl"))
    assert any(0 <= r.get("fp8/output_grad/flushed", -1) < 0.5 for r in records)


def test_resume_from_a_checkpoint_continues_bit_for_bit(tmp_path):
  """O2 (FP16 master weights, FP8 moments): 4 steps saving at 2 and 4; a second run resumed
  from step 2 reproduces steps 3 and 4 and saves the same state at step 4."""
  ckpts = tmp_path / "ckpt"
  Trainer(_config("O2", tmp_path / "a", 4, ckpts), progress=False).run()
  ref = _losses(tmp_path / "a")
  assert sorted(ref) == [1, 2, 3, 4] and ref[4] < ref[1], ref
  ref_state = ft_util.saved_state(ckpts, 4)
  shutil.rmtree(ckpts / "4")
  resumed = Trainer(_config("O2", tmp_path / "b", 4, ckpts), progress=False)
  resumed.run()
  got = _losses(tmp_path / "b")
  assert sorted(got) == [3, 4] and [got[3], got[4]] == [ref[3], ref[4]], (got, ref)
  state = ft_util.saved_state(ckpts, 4)
  assert len(state) == len(ref_state) > 10
  for a, b in zip(ref_state, state):
    assert a.dtype == b.dtype and np.array_equal(a.reshape(-1).view(np.uint8),
                                                 b.reshape(-1).view(np.uint8))
