"""fp8jax.checkpoint: native-dtype round trips, torn and damaged checkpoints, resharding."""
import functools
import logging
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from fp8jax.checkpoint import CheckpointManager, ShapeMismatch
from fp8jax.config import load_config
from fp8jax import optim as fp8_optim
from fp8jax.dot import init_dot_meta
from fp8jax.train.state import TrainState
import flax.linen as nn
import optax

import fp8jax
from fp8jax.linen import FP8_COLLECTION
from fp8jax.linen import Fp8DotGeneral
from fp8jax.train.step import make_train_step

import ft_util


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def _assert_bitwise_equal(a, b):
  la, lb = _leaves(a), _leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape
    assert np.array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def _o2_state(key):
  """An O2-style TrainState after two updates: FP16 master weights, E4M3/FP16 Adam moments,
  FP8 meta with a non-trivial amax history."""
  kw, kb, kg = jax.random.split(key, 3)
  params = {"w": jax.random.normal(kw, (64, 32)), "b": jax.random.normal(kb, (32,))}
  tx = fp8_optim.adamw(1e-2)
  opt_state = tx.init(params)
  master = fp8_optim.init_master(params)
  meta = init_dot_meta()
  for g in jax.random.split(kg, 2):
    grads = jax.tree.map(lambda p: jax.random.normal(g, p.shape), params)
    updates, opt_state = tx.update(grads, opt_state, fp8_optim.master_params(master))
    master = fp8_optim.apply_master_updates(master, updates)
    meta = jax.tree.map(lambda m: m._replace(amax_history=m.amax_history.at[0].set(
        jnp.abs(grads["w"]).max()), scale=m.scale * 0.5), meta,
        is_leaf=lambda x: hasattr(x, "amax_history"))
  return TrainState(jnp.asarray(2, jnp.int32), master, {"dense": meta}, opt_state), tx


def test_o2_state_round_trips_bit_for_bit_in_native_dtypes(tmp_path, key):
  state, tx = _o2_state(key)
  dtypes = {np.asarray(x).dtype for x in jax.tree.leaves(state)}
  assert {np.dtype(jnp.float8_e4m3fn), np.dtype(np.float16)} <= dtypes
  step = jax.jit(lambda s, g: s._replace(
      opt_state=tx.update(g, s.opt_state, fp8_optim.master_params(s.params))[1]),
      donate_argnums=0)
  grads = jax.tree.map(lambda p: jnp.ones(p.shape), fp8_optim.master_params(state.params))
  with CheckpointManager(tmp_path / "ck", async_save=True) as mgr:
    mgr.save(2, state, {"data": {"position": 8}})
    saved = jax.tree.map(np.asarray, state)
    target = jax.tree.map(jnp.zeros_like, state)
    after = step(state, grads)  # donates the saved buffers while the write may still run
    mgr.wait()
    restored = mgr.restore(target)
  assert restored.step == 2 and restored.meta["data"] == {"position": 8}
  _assert_bitwise_equal(restored.state, saved)
  _assert_bitwise_equal(step(restored.state, grads), after)
  with pytest.raises(AssertionError):  # the comparison can fail: the update moved the state
    _assert_bitwise_equal(after, saved)


def test_torn_save_directory_is_never_restored_and_is_removed(tmp_path, key, caplog):
  x = {"w": jax.random.normal(key, (64, 8))}
  with CheckpointManager(tmp_path) as mgr:
    mgr.save(5, x)
    mgr.wait()
  torn = tmp_path / "9.orbax-checkpoint-tmp-1234"  # what a crash mid-write leaves
  (torn / "state").mkdir(parents=True)
  (torn / "state" / "_METADATA").write_text("{")
  with caplog.at_level(logging.WARNING, logger="fp8jax"):
    with CheckpointManager(tmp_path) as mgr:
      assert mgr.steps() == [5] and mgr.torn == [torn.name]
      assert sorted(os.listdir(tmp_path)) == ["5"]  # the torn folder is gone
      restored = mgr.restore(jax.tree.map(jnp.zeros_like, x))
      mgr.save(9, x)  # the step it tore can be saved again
      mgr.wait()
      assert mgr.steps() == [5, 9]
  assert restored.step == 5
  _assert_bitwise_equal(restored.state, x)
  assert any(torn.name in r.getMessage() and "did not finish" in r.getMessage()
             for r in caplog.records)


def _largest_file(folder):
  files = [os.path.join(d, n) for d, _, names in os.walk(folder) for n in names]
  return max(files, key=os.path.getsize)


@pytest.mark.parametrize("damage", ["truncate", "corrupt_metadata"])
def test_damaged_latest_checkpoint_warns_and_restores_the_previous(tmp_path, key, caplog,
                                                                   damage):
  trees = [{"w": jax.random.normal(k, (256, 64)), "s": jnp.float32(i)}
           for i, k in enumerate(jax.random.split(key, 2))]
  with CheckpointManager(tmp_path, keep=3) as mgr:
    for step, tree in zip((10, 20), trees):
      mgr.save(step, tree, {"step_note": step})
    mgr.wait()
  if damage == "truncate":
    path = _largest_file(tmp_path / "20" / "state")
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  else:
    (tmp_path / "20" / "state" / "_METADATA").write_text('{"tree_metadata": ')
  with caplog.at_level(logging.WARNING, logger="fp8jax"):
    with CheckpointManager(tmp_path) as mgr:
      restored = mgr.restore(jax.tree.map(jnp.zeros_like, trees[0]))
      assert mgr.steps() == [10]
  assert restored.step == 10 and restored.meta["step_note"] == 10
  _assert_bitwise_equal(restored.state, trees[0])
  assert "checkpoint step 20" in caplog.text and "damaged" in caplog.text
  assert any(name.startswith("damaged-20") for name in os.listdir(tmp_path))


def test_read_only_manager_changes_nothing_on_disk(tmp_path, key):
  """What fp8jax eval opens a (possibly still training) run's checkpoints with: a torn save in
  flight and a damaged newest checkpoint stay where they are, the previous one restores, and
  saving is refused."""
  trees = [{"w": jax.random.normal(k, (64, 8))} for k in jax.random.split(key, 2)]
  with CheckpointManager(tmp_path) as mgr:
    for step, tree in zip((10, 20), trees):
      mgr.save(step, tree)
    mgr.wait()
  (tmp_path / "20" / "state" / "_METADATA").write_text('{"tree_metadata": ')
  (tmp_path / "30.orbax-checkpoint-tmp-99" / "state").mkdir(parents=True)
  before = sorted(os.listdir(tmp_path))
  mgr = CheckpointManager(tmp_path, read_only=True)
  assert mgr.steps() == [10, 20] and mgr.torn == []
  restored = mgr.restore(jax.tree.map(jnp.zeros_like, trees[0]))
  assert restored.step == 10
  _assert_bitwise_equal(restored.state, trees[0])
  with pytest.raises(ValueError, match="is read-only"):
    mgr.save(40, trees[0])
  assert sorted(os.listdir(tmp_path)) == before


def _shardings(state, mesh, sharded):
  """Leaves whose first dim splits over the mesh get P('d') when `sharded(path)`."""
  n = mesh.devices.size

  def one(path, x):
    split = x.ndim >= 1 and x.shape[0] % n == 0 and sharded(jax.tree_util.keystr(path))
    return NamedSharding(mesh, P("d") if split else P())
  return jax.tree_util.tree_map_with_path(one, state)


def _small_fp8_run(key):
  """A 2-layer FP8 (O1) MLP language model, its state after 2 steps, its jitted train step
  and 3 more batches."""
  fp8 = functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())
  model = nn.Sequential([nn.Dense(64, dot_general_cls=fp8), nn.gelu,
                         nn.Dense(64, dot_general_cls=fp8)])
  apply_fn = lambda variables, tokens: model.apply(variables, jax.nn.one_hot(tokens, 64))
  kp, kb = jax.random.split(key)
  batches = list(jax.random.randint(kb, (5, 16, 9), 0, 64))
  variables = jax.jit(model.init)(kp, jnp.zeros((16, 8, 64)))
  tx = optax.adamw(1e-2)
  state = TrainState(jnp.zeros((), jnp.int32), variables["params"], variables[FP8_COLLECTION],
                     tx.init(variables["params"]))
  step = jax.jit(make_train_step(apply_fn, tx))
  for batch in batches[:2]:
    state, _ = step(state, batch)
  return state, step, batches[2:]


def test_resharding_restore_8_to_4_to_1_devices_continues_training(tmp_path, key):
  """Saved ZeRO-3-like (params and optimizer state split over 8 devices), restored
  ZeRO-1-like on 4 (optimizer state split, params replicated) and on 1 device; the next
  steps match the 8-device run to within reduction-order differences."""
  state, step, batches = _small_fp8_run(key)
  auto = (AxisType.Auto,)
  mesh8 = jax.make_mesh((8,), ("d",), axis_types=auto)
  state8 = jax.device_put(state, _shardings(state, mesh8, lambda p: True))
  assert any(len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
             for x in jax.tree.leaves(state8.params))
  with CheckpointManager(tmp_path / "ck") as mgr:
    mgr.save(2, state8)
    mgr.wait()
    mesh4 = jax.make_mesh((4,), ("d",), axis_types=auto, devices=jax.devices()[:4])
    mesh1 = jax.make_mesh((1,), ("d",), axis_types=auto, devices=jax.devices()[4:5])
    zero1 = _shardings(state, mesh4, lambda p: "opt_state" in p)
    single = _shardings(state, mesh1, lambda p: True)
    on4 = mgr.restore(state8, zero1).state
    on1 = mgr.restore(state8, single).state
  assert all(x.sharding == s for x, s in zip(jax.tree.leaves(on4), jax.tree.leaves(zero1)))
  assert any(not x.sharding.is_fully_replicated for x in jax.tree.leaves(on4.opt_state))
  assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(on4.params))
  assert all(x.sharding.device_set == {jax.devices()[4]} for x in jax.tree.leaves(on1))
  _assert_bitwise_equal(on4, state8)
  _assert_bitwise_equal(on1, state8)
  runs = {}
  for name, s in (("8", state8), ("4", on4), ("1", on1)):
    losses = []
    for batch in batches:
      s, m = step(s, batch)
      losses.append(float(m["loss"]))
    runs[name] = (np.array(losses), s)
  ref_losses, ref_state = runs["8"]
  assert np.all(np.isfinite(ref_losses))
  for name in ("4", "1"):
    losses, s = runs[name]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for a, b in zip(_leaves(s.params), _leaves(ref_state.params)):
      assert np.linalg.norm(a - b) <= 1e-4 * np.linalg.norm(b) + 1e-7
  # the continued runs really moved away from the checkpoint
  assert not np.allclose(_leaves(runs["1"][1].params)[0], _leaves(on1.params)[0])


_SAVER = textwrap.dedent("""
    import sys, jax, jax.numpy as jnp
    from fp8jax.checkpoint import CheckpointManager, ShapeMismatch
    mgr = CheckpointManager(sys.argv[1])
    small = {"w": jnp.full((1024,), 1.0)}
    mgr.save(1, small); mgr.wait()
    big = {"w": jnp.full((48 * 2**20,), 2.0)}  # 192 MiB: the write takes a while
    mgr.save(2, big)
    print("saving", flush=True)
    mgr.wait()
    print("saved", flush=True)
""")


@pytest.mark.slow
def test_killed_during_an_asynchronous_save_restores_the_earlier_checkpoint(tmp_path):
  proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(tmp_path)], env=ft_util.env(),
                          stdout=subprocess.PIPE, text=True, cwd=ft_util.ROOT)
  try:
    assert proc.stdout.readline().strip() == "saving"
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL
  leftovers = [n for n in os.listdir(tmp_path) if n != "1"]
  assert leftovers and all("tmp" in n for n in leftovers), leftovers  # killed mid-write
  with CheckpointManager(tmp_path) as mgr:
    assert mgr.steps() == [1] and sorted(mgr.torn) == sorted(leftovers)
    restored = mgr.restore({"w": jnp.zeros((1024,))})
  assert restored.step == 1 and float(restored.state["w"][0]) == 1.0
  assert os.listdir(tmp_path) == ["1"]  # the torn save is cleaned up on resume


def test_a_checkpoint_of_other_shapes_is_refused_and_kept(tmp_path, key):
  """Restoring into a state whose arrays have other shapes (another model shape or layout)
  raises ShapeMismatch naming the shapes; the checkpoint is not moved aside as damaged and
  still restores into the right shapes."""
  w = jax.random.normal(key, (2, 3, 4))
  with CheckpointManager(tmp_path, save_every=1, async_save=False) as m:
    m.save(1, {"w": w})
  with CheckpointManager(tmp_path) as m:
    with pytest.raises(ShapeMismatch, match=r"step 1 .* does not fit .*\(2, 4, 3\).*\(2, 3, 4\)"):
      m.restore({"w": jnp.zeros((2, 4, 3))})
    assert m.steps() == [1] and sorted(os.listdir(tmp_path)) == ["1"]
    np.testing.assert_array_equal(np.asarray(m.restore({"w": jnp.zeros((2, 3, 4))}).state["w"]),
                                  np.asarray(w))


@pytest.mark.parametrize("kwargs,message", [
    ({"save_every": -1}, "save_every=-1 is not allowed; use an integer >= 0"),
    ({"keep": 0}, "keep=0 is not allowed; use an integer >= 1"),
    ({"keep_every": 0}, "keep_every=0 is not allowed; use an integer >= 1 or None"),
    ({"save_every": 2.5}, "save_every=2.5 is not allowed"),
])
def test_manager_refuses_bad_arguments(tmp_path, kwargs, message):
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    CheckpointManager(tmp_path, **kwargs)


def test_save_refuses_a_negative_step(tmp_path):
  with CheckpointManager(tmp_path) as mgr:
    with pytest.raises(ValueError, match="step=-1 is not allowed; use an integer >= 0"):
      mgr.save(-1, {"w": jnp.ones(3)})


@pytest.mark.parametrize("override,message", [
    ("checkpoint.checkpoint_every_n_steps=-1", "checkpoint.checkpoint_every_n_steps=-1 is not "
     "allowed; use a value >= 0"),
    ("checkpoint.keep_every=0", "checkpoint.keep_every=0 is not allowed; use a value >= 1"),
    ("checkpoint.auto_resume=3", "checkpoint.auto_resume=3 has type int; expected true or false"),
    ("runtime.heartbeat_interval=0", "runtime.heartbeat_interval=0.0 is not allowed; use a value > 0"),
    ("runtime.heartbeat_tolerance=0", "runtime.heartbeat_tolerance=0 is not allowed"),
    ("runtime.max_consecutive_skips=-2", "runtime.max_consecutive_skips=-2 is not allowed"),
    ("runtime.divergence_threshold=0", "runtime.divergence_threshold=0.0 is not allowed; use a "
     "value > 0"),
    ("runtime.divergence_check_every=1.5", "runtime.divergence_check_every=1.5 has type float"),
])
def test_config_refuses_bad_fault_tolerance_knobs(override, message):
  with pytest.raises(ValueError) as e:
    load_config(None, [override])
  assert message in str(e.value)


def test_config_wires_checkpoint_and_runtime_knobs(tmp_path):
  cfg = load_config(None, ["checkpoint.checkpoint_every_n_steps=50", "checkpoint.auto_resume=true",
                           "runtime.heartbeat_interval=30", "checkpoint.keep_every=1000"])
  assert cfg.checkpoint.enabled and cfg.runtime.heartbeat_interval == 30.0
  assert not load_config(None).checkpoint.enabled


def test_resume_refuses_checkpoints_of_another_model_or_level():
  from types import SimpleNamespace

  from fp8jax.config import config_to_dict
  from fp8jax.train.resume import RunCheckpoints
  saved = load_config(None, ["model.d_model=256", "train.opt_level=O2"])
  meta = {"config": config_to_dict(saved)}
  fake = lambda cfg: SimpleNamespace(config=cfg, directory="ck")
  RunCheckpoints._check_same_run(fake(saved), meta)  # same model and level: fine
  with pytest.raises(ValueError) as e:
    RunCheckpoints._check_same_run(fake(load_config(None, ["train.opt_level=O2"])), meta)
  assert "model.d_model=128 but the checkpoints in ck were written with model.d_model=256" in (
      str(e.value))
  with pytest.raises(ValueError, match="train.opt_level='O1' but .* train.opt_level='O2'"):
    RunCheckpoints._check_same_run(fake(load_config(None, ["model.d_model=256"])), meta)


def test_resume_of_a_checkpoint_from_before_fp8_head_names_the_setting():
  """Checkpoints written before model.fp8_head existed ran the LM head in FP8 (it has FP8
  state): resuming one at an FP8 level asks for fp8_head true; at O0 the key is moot."""
  from types import SimpleNamespace

  from fp8jax.config import config_to_dict
  from fp8jax.train.resume import RunCheckpoints
  fake = lambda cfg: SimpleNamespace(config=cfg, directory="ck")
  for level in ("O0", "O2"):
    meta = {"config": config_to_dict(load_config(None, [f"train.opt_level={level}"]))}
    del meta["config"]["model"]["fp8_head"]
    RunCheckpoints._check_same_run(fake(load_config(None, [f"train.opt_level={level}",
                                                            "model.fp8_head=true"])), meta)
    now = fake(load_config(None, [f"train.opt_level={level}"]))
    if level == "O0":
      RunCheckpoints._check_same_run(now, meta)
    else:
      with pytest.raises(ValueError, match="model.fp8_head=False but the checkpoints in ck "
                                           "were written with model.fp8_head=True"):
        RunCheckpoints._check_same_run(now, meta)
