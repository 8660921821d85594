"""FP8-LM automatic scaling of the FP8 gradient wire in training
(parallel.grad_comm_scaling=auto): the Trainer trains with it and tracks the native reduction,
its CommScaling state is checkpointed and a resumed run continues bit for bit, checkpoints
without it still restore, a saturating step halves the pre-scale inside the train step and
clean steps grow it back, and bad configs are refused. (The 2-process run:
test_grad_comm_processes.py.)"""
import json
import shutil
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from fp8jax import checkpoint as checkpoint_lib
from fp8jax.config import load_config
from fp8jax.parallel import make_mesh
from fp8jax.parallel.collectives import CommScaling, init_comm_scaling
from fp8jax.train import TrainState, guards
from fp8jax.parallel.layout import batch_sharding, layout_split, put_global
from fp8jax.parallel.grad_comm import fp8_scatter_dim, init_grad_comm_scaling
from fp8jax.train.resume import RunCheckpoints
from fp8jax.train.step import GroupLoop, build_step, make_train_step
from fp8jax.train.loop import Trainer
from hetero_model import _LM, _state
from test_hetero import _keep_gradient

GROUPS, MICROBATCHES, PER_GROUP = 8, 2, 1
SMALL = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
         "model.max_seq_len=32", "data.seq_len=32", "data.max_bytes=200000",
         "train.batch_size=8", "train.eval_every=0", "train.eval_batches=1",
         "train.log_every=1", "train.fp8_health_every=0", "train.warmup_steps=1"]


def _flat(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_trainer_auto_scaling_tracks_native_checkpoints_and_resumes(tmp_path):
  cfg = load_config(None, SMALL + [
      "train.opt_level=O2", "train.steps=4", "parallel.zero_stage=2",
      "parallel.grad_comm=fp8", "parallel.grad_comm_scaling=auto",
      "parallel.grad_comm_growth_interval=2", "checkpoint.checkpoint_every_n_steps=2",
      f"runtime.run_dir={tmp_path}/run"])
  trainer = Trainer(cfg, progress=False)
  n_leaves = len(jax.tree.leaves(trainer.state.model_params()))
  assert isinstance(trainer.state.comm, CommScaling)
  assert trainer.state.comm.amax.shape == (n_leaves,)
  start = jax.tree.map(jnp.copy, trainer.state)
  trainer.run()
  final = jax.tree.map(np.asarray, trainer.state)
  records = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  steps = [r for r in records if "loss" in r]
  loss_auto = [r["loss"] for r in steps]
  # (a) it trains, like the native reduction from the same state on the same batches
  native = build_step(trainer.model.apply, trainer.tx, trainer.plan, cfg.train.microbatches)
  data = trainer.data.batches("train", cfg.train.microbatch_size, cfg.data.seq_len,
                              seed=cfg.data.seed)
  state, loss_native = start, []  # (the native step carries comm untouched)
  for _ in range(4):
    state, m = native(state, data.next())
    loss_native.append(float(m["loss"]))
  assert len(loss_auto) == 4 and np.all(np.isfinite(loss_auto))
  assert loss_auto[-1] < loss_auto[0] - 0.1, loss_auto
  # as tests/integration/test_grad_comm.py's O2 ZeRO-2 run: one E4M3 rounding of the gradients, ~1e-3
  np.testing.assert_allclose(loss_auto, loss_native, rtol=1e-2)
  assert loss_auto[-1] != loss_native[-1]
  # the scaling state moved and is logged (step 1 casts with current scales, so nothing
  # saturates there; pre-scales are in (0, 1])
  fp8 = [i for i, x in enumerate(jax.tree.leaves(trainer.state.model_params()))
         if fp8_scatter_dim(x.shape, GROUPS) is not None]
  assert fp8 and np.all(final.comm.amax[fp8] > 0)
  assert steps[0]["comm/saturated_max"] == 0.0 and steps[0]["comm/pre_scale_min"] == 1.0
  for r in steps:
    assert 0 < r["comm/pre_scale_min"] <= 1 and 0 <= r["comm/saturated_max"] < 1
  # (b) the checkpoints hold it: step 4's comm is the final state's
  ckpt = tmp_path / "run" / "checkpoints"
  saved = ocp.PyTreeCheckpointer().restore(str(ckpt / "4" / "state"))
  for name in CommScaling._fields:
    np.testing.assert_array_equal(saved["comm"][name], getattr(final.comm, name))
  saved2 = ocp.PyTreeCheckpointer().restore(str(ckpt / "2" / "state"))
  # resume from step 2 (step 4 removed) and replay steps 3-4 with the same compiled step:
  # restored comm = saved, and the continuation reproduces the uninterrupted run exactly
  trainer.checkpoints.wait()
  shutil.rmtree(ckpt / "4")
  trainer.checkpoints = RunCheckpoints(cfg, str(tmp_path / "run"))
  trainer.state = trainer.state._replace(comm=jax.device_put(
      init_comm_scaling(n_leaves), jax.tree.map(lambda x: x.sharding, trainer.state.comm)))
  assert trainer.resume() == 2
  for name in CommScaling._fields:
    np.testing.assert_array_equal(getattr(trainer.state.comm, name), saved2["comm"][name])
  assert np.any(np.asarray(trainer.state.comm.amax) > 0)
  for step in (2, 3):
    batch = trainer.next_batch(step)
    trainer.state, m = trainer.step_fn(cfg.microbatches_at(step))(trainer.state, batch)
    assert float(m["loss"]) == loss_auto[step]
  for a, b in zip(_flat(trainer.state), _flat(final)):
    np.testing.assert_array_equal(a, b)


class _Legacy(NamedTuple):  # TrainState's fields before the comm state existed
  step: Any
  params: Any
  fp8: Any
  opt_state: Any


def test_checkpoints_without_comm_state_restore_with_the_given_one(tmp_path):
  """Checkpoints written before TrainState.comm existed, or by grad_comm_scaling=current
  runs (comm=()), restore under auto with the given (fresh) comm state; a checkpoint with
  comm state restores under current scaling without it."""
  params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
  body = (jnp.asarray(5, jnp.int32), params, {}, (jnp.full(3, 2.0),))
  fresh = init_grad_comm_scaling(params)
  used = fresh._replace(amax=jnp.array([3.0, 4.0]), pre_scale=jnp.array([0.5, 1.0]))
  with checkpoint_lib.CheckpointManager(tmp_path, async_save=False, keep=5) as m:
    m.save(1, _Legacy(*body))
    m.save(2, TrainState(*body))
    m.save(3, TrainState(*body, used))
    for step in (1, 2):
      got = m.restore(TrainState(*body, fresh), step=step).state
      assert isinstance(got, TrainState)
      for a, b in zip(_flat(got), _flat(TrainState(*body, fresh))):
        np.testing.assert_array_equal(a, b)
    got = m.restore(TrainState(*body, fresh), step=3).state
    for a, b in zip(_flat(got.comm), _flat(used)):
      np.testing.assert_array_equal(a, b)
    got = m.restore(TrainState(*body), step=3).state
    assert got.comm == ()
    for a, b in zip(_flat(got), _flat(TrainState(*body))):
      np.testing.assert_array_equal(a, b)
    assert m.restore(_Legacy(*body)).step == 3  # the newest, not set aside as damaged
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                           sharding=x.sharding),
                            TrainState(*body, fresh))
    with pytest.raises(checkpoint_lib.MissingField, match=r"has no 'comm'; pass a state"):
      m.restore(abstract, step=2)
    assert m.steps() == [1, 2, 3]


def test_saturation_halves_the_pre_scale_in_the_step_and_clean_steps_grow_it_back():
  mesh = make_mesh(data=GROUPS)
  seed = int(np.random.SeedSequence().entropy % 2**31)
  print(f"seed {seed}")
  model, tx = _LM(False), _keep_gradient()  # f32 model, frozen weights: the same gradient
  batch = np.random.default_rng(seed).integers(
      0, 256, (GROUPS * MICROBATCHES * PER_GROUP, 17), dtype=np.int32)
  state = _state(model, tx, batch, seed)
  state = state._replace(comm=init_grad_comm_scaling(state.params))
  fp8 = np.asarray([fp8_scatter_dim(np.shape(x), GROUPS) is not None
                    for x in jax.tree.leaves(state.params)])
  assert fp8.any() and not fp8.all()  # both kinds of leaves
  sharding = batch_sharding(mesh)
  args = (put_global(layout_split(batch, MICROBATCHES, GROUPS), sharding),
          put_global(np.full((GROUPS,), MICROBATCHES, np.int32), sharding))
  step = jax.jit(guards.skip_nonfinite_steps(make_train_step(
      model.apply, tx, groups=GroupLoop(mesh, grad_comm="fp8", comm_scaling="auto",
                                        growth_interval=2))))
  s1, m1 = step(state, *args)  # first step: current scaling records the amaxes
  c1 = jax.tree.map(np.asarray, s1.comm)
  assert np.all(c1.amax[fp8] > 0) and np.all(c1.amax[~fp8] == 0)
  np.testing.assert_array_equal(c1.pre_scale, 1.0)
  np.testing.assert_array_equal(c1.clean_steps, fp8.astype(np.int32))
  assert float(m1["comm_saturated_max"]) == 0.0
  grad1 = _flat(s1.opt_state)
  # inject: the recorded amax is 64x too small, as if this step's gradient had outliers 64x
  # the previous amax; far more than 0.001% saturate
  spiked = s1._replace(comm=s1.comm._replace(amax=s1.comm.amax / 64))
  s2, m2 = step(spiked, *args)
  c2 = jax.tree.map(np.asarray, s2.comm)
  assert not bool(m2["skipped"])
  np.testing.assert_array_equal(c2.pre_scale[fp8], 0.5)
  np.testing.assert_array_equal(c2.pre_scale[~fp8], 1.0)
  np.testing.assert_array_equal(c2.clean_steps[fp8], 0)
  assert np.all(c2.saturated[fp8] > 1e-5)
  assert float(m2["comm_pre_scale_min"]) == 0.5
  assert float(m2["comm_saturated_max"]) == c2.saturated.max()
  np.testing.assert_allclose(c2.amax, c1.amax, rtol=1e-6)  # the true amax is recorded again
  clipped = [np.linalg.norm(a - b) / np.linalg.norm(b)
             for a, b in zip(_flat(s2.opt_state), grad1)]
  assert all(np.isfinite(clipped)) and max(clipped) > 0.1  # saturated values were clipped
  # clean steps: 1 then 2 >= growth_interval -> doubled back to 1, counter restarts
  s3, m3 = step(s2, *args)
  c3 = jax.tree.map(np.asarray, s3.comm)
  np.testing.assert_array_equal(c3.pre_scale[fp8], 0.5)
  np.testing.assert_array_equal(c3.clean_steps[fp8], 1)
  assert float(m3["comm_saturated_max"]) == 0.0
  s4, m4 = step(s3, *args)
  c4 = jax.tree.map(np.asarray, s4.comm)
  np.testing.assert_array_equal(c4.pre_scale, 1.0)
  np.testing.assert_array_equal(c4.clean_steps[fp8], 0)
  assert float(m4["comm_pre_scale_min"]) == 1.0
  # the delayed-scale steps reduce like the current-scale step (no saturation left; scales
  # equal up to an f32 ulp, so a few ties round the other way)
  for a, b in zip(_flat(s4.opt_state), grad1):
    np.testing.assert_allclose(a, b, rtol=0.07, atol=1e-3 * np.abs(b).max())
  # a state without the comm entries is refused with what to do
  with pytest.raises(ValueError, match=r"init_grad_comm_scaling"):
    step(state._replace(comm=()), *args)


@pytest.mark.parametrize("overrides, words", [
    (["parallel.grad_comm_scaling=delayed"],
     "parallel.grad_comm_scaling='delayed' is not allowed; use one of ['current', 'auto']"),
    (["parallel.grad_comm_scaling=auto"],
     "parallel.grad_comm_scaling='auto' needs FP8 gradient communication but "
     "parallel.grad_comm='auto' (= native)"),
    (["parallel.grad_comm_scaling=auto", "parallel.grad_comm=native"],
     "parallel.grad_comm='native'"),
    (["parallel.grad_comm=fp8", "parallel.grad_comm_growth_interval=10"],
     "parallel.grad_comm_growth_interval=10 only applies to "
     "parallel.grad_comm_scaling='auto'"),
    (["parallel.grad_comm=fp8", "parallel.grad_comm_scaling=auto",
      "parallel.grad_comm_growth_interval=0"],
     "parallel.grad_comm_growth_interval=0 is not allowed"),
])
def test_bad_comm_scaling_configs_are_refused(overrides, words):
  with pytest.raises(ValueError) as e:
    load_config(None, overrides)
  assert words in str(e.value)


def test_comm_scaling_defaults_and_step_arguments():
  cfg = load_config(None)
  assert cfg.parallel.grad_comm_scaling == "current"
  assert cfg.grad_comm_growth_interval() == 1000
  cfg = load_config(None, ["parallel.grad_comm=fp8", "parallel.grad_comm_scaling=auto"])
  assert cfg.grad_comm_growth_interval() == 1000
  mesh = make_mesh(data=GROUPS)
  with pytest.raises(ValueError, match=r"comm_scaling='auto' needs grad_comm='fp8'"):
    GroupLoop(mesh, comm_scaling="auto")
  with pytest.raises(ValueError, match=r"comm_scaling='delayed' is not allowed"):
    GroupLoop(mesh, grad_comm="fp8", comm_scaling="delayed")
  with pytest.raises(ValueError, match=r"growth_interval=0 is not allowed"):
    GroupLoop(mesh, grad_comm="fp8", comm_scaling="auto", growth_interval=0)
