"""The FP8 calibration pass (``fp8.calibrate=always``, ``Trainer.calibrate``) under
jax.distributed: 2 local processes on 127.0.0.1, 1 CPU device each (data parallel over the
processes, gloo collectives), give every FP8 state the scales a one-process run of the same
global batch computes, identically on both processes."""
import os
import time

import jax
import numpy as np
import pytest

import ft_util
from fp8jax.config import load_config
from fp8jax.scaling import Fp8Meta
from fp8jax.train.calibration import any_unobserved
from fp8jax.train.loop import Trainer

TINY = os.path.join(ft_util.ROOT, "configs", "tiny.yaml")
# tiny.yaml shrunk to one 32-wide layer; 8 sequences of 16 tokens: 4 per process (2 processes)
# and 1 per device of the one-process reference (8 CPU devices, tests/conftest.py)
OVERRIDES = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.d_ff=64",
             "model.max_seq_len=16", "data.seq_len=16", "data.max_bytes=200000",
             "train.batch_size=8", "train.opt_level=O1", "fp8.calibrate=always",
             "train.fp8_health_every=0", "train.eval_every=0",
             "checkpoint.checkpoint_every_n_steps=0"]
PHASES = ("fresh", "calibrated", "stepped")  # before the pass, after it, after the first step


def _metas(fp8) -> list:
  return jax.tree.leaves(fp8, is_leaf=lambda x: isinstance(x, Fp8Meta))


def _worker_state(path) -> dict:
  """{phase: [(scale, amax history) per Fp8Meta]} and the step's loss, as a worker saved
  them (calibration_worker.py)."""
  with np.load(path) as f:
    n = sum(k.startswith("fresh_scale_") for k in f)
    out = {p: [(f[f"{p}_scale_{i}"], f[f"{p}_history_{i}"]) for i in range(n)] for p in PHASES}
    out["loss"] = f["loss"]
  return out


def _one_process(run_dir) -> dict:
  """The same as the workers, in this process: 8 CPU devices, data parallel."""
  trainer = Trainer(load_config(TINY, OVERRIDES + [f"runtime.run_dir={run_dir}"]),
                    progress=False)
  host = lambda fp8: [(np.asarray(m.scale), np.asarray(m.amax_history)) for m in _metas(fp8)]
  batch = trainer.next_batch(0)
  out = {"fresh": host(trainer.state.fp8)}
  calibrated = trainer.calibrate(trainer.state, batch)
  out["calibrated"] = host(calibrated.fp8)
  state, metrics = trainer.step_fn(1)(calibrated, batch)
  assert trainer.calibration.passes == 1 and not any_unobserved(state.fp8)
  out.update(stepped=host(state.fp8), loss=np.asarray(metrics["loss"]))
  return out


@pytest.mark.slow
def test_two_process_calibration_pass_gives_the_one_process_scales(tmp_path):
  """Each worker asserts that the pass ran once, that the step after it left no FP8 state
  unobserved and that it was the calibrated model's (the only step compiled). Here: the pass
  gave every state a new finite scale and kept its (empty) history; both processes hold
  bit-identical FP8 state after the pass and after the step; and so does a one-process run of
  the same global batch: a scale comes from the max of |x| over the microbatch's rows, each
  row computed alike whichever device holds it, so the split over processes changes no bit."""
  t0 = time.monotonic()
  logs = ft_util.run_workers(
      "calibration_worker.py",
      [tmp_path, TINY, *OVERRIDES, f"runtime.run_dir={tmp_path / 'two'}"], 2, timeout=180)
  t1 = time.monotonic()
  assert "process 0 of 2: mesh data=2" in logs[0], logs[0][-2000:]
  got = [_worker_state(tmp_path / f"fp8_{i}.npz") for i in range(2)]
  ref = _one_process(tmp_path / "one")
  print(f"2 processes: {t1 - t0:.1f} s, one-process reference: {time.monotonic() - t1:.1f} s")
  assert len(ref["fresh"]) > 1 and all(len(g[p]) == len(ref[p]) for g in got for p in PHASES)
  for (s0, h0), (s1, h1) in zip(got[0]["fresh"], got[0]["calibrated"]):
    assert not np.any(h0) and np.array_equal(h1, h0)  # never observed; the pass keeps it so
    assert np.all(np.isfinite(s1)) and np.all(s1 > 0) and np.all(s1 != s0), (s0, s1)
  for p in ("calibrated", "stepped"):
    for i, ((s, h), (s1, h1), (s_ref, h_ref)) in enumerate(zip(got[0][p], got[1][p], ref[p])):
      observed = np.max(h, axis=-1) > 0  # (per layer where stacked)
      assert np.all(observed) if p == "stepped" else not np.any(observed), (p, i, h)
      for a, b, what in ((s, s1, "scale"), (h, h1, "history")):  # process 0 == process 1
        np.testing.assert_array_equal(a, b, err_msg=f"{p} {what} {i}: process 0 vs 1")
      for a, b, what in ((s, s_ref, "scale"), (h, h_ref, "history")):  # == one process
        np.testing.assert_array_equal(a, b, err_msg=f"{p} {what} {i}: vs one process")
  np.testing.assert_array_equal(got[0]["loss"], got[1]["loss"])
  np.testing.assert_allclose(got[0]["loss"], ref["loss"], rtol=1e-6)
