"""fp8jax.train.guards: non-finite skip and reload, FP8 divergence fallback, heartbeat."""
import json
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.config import load_config
from fp8jax.train.guards import (STALL_EXIT_CODE, DivergenceWatchdog, Heartbeat, SkipCounter,
                                 loss_gap)
from fp8jax.train.loop import Trainer

import ft_util


def _bits(tree):
  return [np.asarray(x).reshape(-1).view(np.uint8).copy() for x in jax.tree.leaves(tree)]


def _poison(batch, vocab):
  """Token ids outside the vocabulary: the embedding lookup fills them with NaN."""
  bad = batch.copy()
  bad[0, :4] = vocab
  return bad


def test_trainer_skips_nan_steps_reloads_after_k_and_falls_back_to_bf16(tmp_path, key,
                                                                         caplog):
  seed = int(jax.random.randint(key, (), 0, 2**30))
  cfg = load_config(ft_util.tiny_config(
      tmp_path / "c.yaml", tmp_path / "run", train={"steps": 10, "seed": seed},
      checkpoint={"checkpoint_every_n_steps": 2, "auto_resume": False},
      runtime={"max_consecutive_skips": 2, "divergence_check_every": 2,
               "divergence_threshold": 0.03}))
  trainer = Trainer(cfg, progress=False)
  vocab = cfg.model.vocab_size

  # one NaN step, directly: params, optimizer and FP8 state unchanged, step advanced
  state = jax.tree.map(lambda x: x.copy(), trainer.state)
  before = _bits((state.params, state.opt_state, state.fp8))
  batch = trainer.next_batch(0)
  after, m = trainer.step_fn(1)(state, _poison(batch, vocab))
  assert not np.isfinite(float(m["loss"])) and bool(m["skipped"])
  assert all(np.array_equal(a, b) for a, b in
             zip(before, _bits((after.params, after.opt_state, after.fp8))))
  assert int(after.step) == 1
  good, m = trainer.step_fn(1)(after, batch)  # good steps update (lr is 0 at count 0)
  good, m = trainer.step_fn(1)(good, batch)
  assert not bool(m["skipped"]) and np.isfinite(float(m["loss"]))
  assert not all(np.array_equal(a, b) for a, b in zip(before, _bits(good.params)))

  # the loop: steps 2 and 3 poisoned -> two skips in a row -> reload checkpoint 2;
  # the divergence check at step 6 sees a BF16 loss 10% away -> BF16 fallback (threshold 3%:
  # the tiny model's real FP8 vs BF16 gap at its first step is ~1%, at some seeds just above)
  trainer.train_batches.restore({**trainer.train_batches.state(), "position": 0})
  plain_next, plain_bf16 = trainer.next_batch, trainer._bf16_loss
  checks = []

  def next_batch(step):
    b = plain_next(step)
    return _poison(b, vocab) if step in (2, 3) else b

  def bf16_loss(state, batch):  # called before the step: the state holds the steps done
    step = int(state.step)
    checks.append(step)
    return plain_bf16(state, batch) * (1.10 if step >= 6 else 1.0)

  trainer.next_batch, trainer._bf16_loss = next_batch, bf16_loss
  with caplog.at_level("WARNING", logger="fp8jax"):
    final = trainer.run()
  assert np.isfinite(final["loss"])
  assert "step 2 skipped" in caplog.text and "step 3 skipped" in caplog.text
  assert "2 consecutive non-finite steps: reloaded checkpoint step 2" in caplog.text
  records = ft_util.losses(tmp_path / "run")
  assert [s for s, _ in records] == list(range(1, 11))
  skips = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl"))
           if "skipped_steps" in r]
  assert [(r["step"], r["skipped_steps"]) for r in skips] == [(3, 1), (4, 2)]
  assert checks == [0, 2, 4, 6]  # no false alarm at 0 and 4 (real FP8 vs BF16 gap < 3%)
  events = [json.loads(line) for line in open(tmp_path / "run" / "events.jsonl")]
  events = [e for e in events if e["event"] != "metric_absent"]  # CPU: no MFU, no memory
  assert [e["event"] for e in events] == ["bf16_fallback"] and events[0]["step"] == 7
  assert "relative gap" in events[0]["reason"] and "> 3.000%" in events[0]["reason"]
  assert trainer.model.recipe is None and trainer.state.fp8 == {}
  assert trainer.fallback_reason == events[0]["reason"]

  # a resumed run continues with BF16 GEMMs
  resumed = Trainer(load_config(ft_util.tiny_config(
      tmp_path / "c2.yaml", tmp_path / "run", train={"steps": 10, "seed": seed},
      checkpoint={"checkpoint_every_n_steps": 2, "auto_resume": True})), progress=False)
  assert resumed.resume() == 10
  assert resumed.model.recipe is None and resumed.fallback_reason == events[0]["reason"]
  assert resumed.skips.total == 2


def test_bf16_loss_is_the_mean_over_the_batchs_microbatches(tmp_path):
  """The watchdog's BF16 loss of a batch of 3 microbatches (the BF16 model's evaluation step
  on the train step's plan, 8 devices) is the whole batch's mean loss of the model with BF16
  GEMMs (f32 here): not one microbatch's, nor their sum, nor the FP8 model's."""
  cfg = load_config("configs/tiny.yaml", [
      "train.opt_level=O1", "model.dtype=float32", "model.n_layers=1", "model.d_model=32",
      "model.n_heads=2", "model.d_ff=64", "data.seq_len=16", "model.max_seq_len=16",
      "train.batch_size=24", "train.microbatches=3", f"runtime.run_dir={tmp_path}"])
  trainer = Trainer(cfg, progress=False)
  batch = trainer.next_batch(0)
  got = float(trainer._bf16_loss(trainer.state, batch))
  model, params = trainer.run_model.for_recipe(None), trainer.state.model_params()
  logits = model.apply({"params": params}, jnp.asarray(batch[:, :-1]))
  per_seq = -jax.vmap(lambda lg, t: jnp.mean(jnp.take_along_axis(
      jax.nn.log_softmax(lg), t[:, None], axis=-1)))(logits, jnp.asarray(batch[:, 1:]))
  parts = np.asarray(per_seq, np.float64).reshape(3, 8).mean(axis=1)
  # f32 throughout: only summation order differs from the float64 mean (~1e-7 relative)
  assert abs(got - parts.mean()) < 1e-5 * parts.mean(), (got, parts)
  assert np.ptp(parts) > 1e-3, parts  # one microbatch alone or their sum would fail
  fp8 = trainer.calibration.model.apply(trainer.state.variables(), jnp.asarray(batch[:, :-1]))
  assert np.abs(np.asarray(fp8) - np.asarray(logits)).max() > 1e-3  # the FP8 model differs


def test_skip_counter_asks_for_a_reload_after_k_in_a_row():
  c = SkipCounter(3)
  assert [c.update(s) for s in (True, True, False, True, True, True, True)] == [
      False, False, False, False, False, True, False]
  assert c.total == 6
  assert not any(SkipCounter(0).update(True) for _ in range(10))


def test_divergence_watchdog_threshold(key):
  w = DivergenceWatchdog(every=5, threshold=0.01)
  assert [w.due(s) for s in (0, 3, 5, 10)] == [True, False, True, True]
  bf16 = float(jax.random.uniform(key, (), minval=2.0, maxval=6.0))
  assert w.check(5, bf16 * 1.009, bf16) is None
  reason = w.check(5, bf16 * 1.011, bf16)
  assert reason is not None and "step 5" in reason and "BF16 (O0)" in reason
  assert w.check(5, float("nan"), bf16) is None  # the skip guard's business
  assert not DivergenceWatchdog(0).due(0)
  # the watchdog reads the logged number, fp8/loss_gap (signed: FP8 worse is > 0)
  assert loss_gap(bf16 * 1.011, bf16) == pytest.approx(0.011)
  assert loss_gap(bf16 * 0.989, bf16) == pytest.approx(-0.011)
  assert f"{abs(loss_gap(bf16 * 0.989, bf16)):.3%}" in w.check(5, bf16 * 0.989, bf16)


def test_the_fp8_bf16_loss_gap_is_logged_every_health_probe(tmp_path):
  """``fp8/loss_gap`` (FP8 step loss minus the BF16 loss of the same batch and parameters,
  relative) in metrics.jsonl every ``train.fp8_health_every`` steps by default: FP8 ran (not
  zero) and it is within FP8's bound."""
  from fp8jax.config import load_config
  from fp8jax.train.loop import Trainer
  from fp8jax.train.metrics import read_jsonl
  cfg = load_config("configs/tiny.yaml", [
      "train.steps=4", "train.fp8_health_every=2", "train.opt_level=O1", "train.eval_every=0",
      "model.n_layers=1", f"runtime.run_dir={tmp_path}"])
  Trainer(cfg, progress=False).run()
  gaps = {r["step"]: r["fp8/loss_gap"] for r in read_jsonl(str(tmp_path / "metrics.jsonl"))
          if "fp8/loss_gap" in r}
  assert sorted(gaps) == [2, 4], gaps  # with the probes (after steps 2 and 4), not at step 1
  assert all(0 < abs(g) < 0.05 for g in gaps.values()), gaps


@pytest.mark.parametrize("make,message", [
    (lambda: SkipCounter(-1), "limit=-1 is not allowed; use an integer >= 0"),
    (lambda: DivergenceWatchdog(-1), "every=-1 is not allowed; use an integer >= 0"),
    (lambda: DivergenceWatchdog(1, 0.0), "threshold=0.0 is not allowed; use a finite number > 0"),
    (lambda: DivergenceWatchdog(1, float("nan")), "threshold=nan is not allowed"),
    (lambda: Heartbeat(0), "interval=0 is not allowed; use a number of seconds > 0"),
    (lambda: Heartbeat(1.0, tolerance=0), "tolerance=0 is not allowed; use an integer >= 1"),
])
def test_guards_refuse_bad_arguments(make, message):
  with pytest.raises(ValueError) as e:
    make()
  assert message in str(e.value)


def test_heartbeat_detects_a_stall_but_not_steady_progress():
  stalls = []
  with Heartbeat(0.25, tolerance=4, on_stall=stalls.append) as hb:
    for _ in range(150):  # 1.5 s of beats every 10 ms: no stall
      hb.beat()
      time.sleep(0.01)
    assert stalls == []
    t0 = time.monotonic()
    while not stalls and time.monotonic() - t0 < 10:
      time.sleep(0.01)
  assert stalls and 1.0 <= stalls[0] < 3.0
  assert 0.9 <= time.monotonic() - t0 < 3.0


_STALLER = textwrap.dedent("""
    import threading, time
    from fp8jax.train.guards import Heartbeat
    def stuck_in_a_collective():
      time.sleep(60)
    with Heartbeat(0.2, tolerance=2) as hb:
      hb.beat()
      stuck_in_a_collective()
""")


@pytest.mark.slow
def test_heartbeat_stall_dumps_stacks_and_exits_nonzero():
  t0 = time.monotonic()
  result = ft_util.run([sys.executable, "-c", _STALLER], 60, env=ft_util.env())
  took = time.monotonic() - t0
  assert result.returncode == STALL_EXIT_CODE, result.stderr[-2000:]
  assert "heartbeat" in result.stderr and "stalled" in result.stderr
  assert "stuck_in_a_collective" in result.stderr  # the main thread's stack
  assert took < 30
