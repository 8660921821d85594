"""Heterogeneous meshes: balanced microbatch counts give the full-batch gradient, the balancer
is optimal and respects memory, capability agreement is one decision, device_map/profile
inputs are checked, and the Trainer runs balanced."""
import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ft_util

import fp8jax
from fp8jax import hardware
from fp8jax.config import config_from_dict
from fp8jax.parallel import balance, capability, make_mesh
from fp8jax.parallel import device_map as device_map_lib
from fp8jax.parallel import profile as profile_lib
from fp8jax.train import profile as train_profile
from fp8jax.parallel.layout import batch_sharding, layout_counts, microbatches_sharding, put_global
from fp8jax.train.step import GroupLoop, make_train_step
from conftest import rel_err
from hetero_model import MICROBATCH, _LM, _state, setup

def _balanced_step(model, tx, state, batch, counts, mesh):
  sharding = batch_sharding(mesh)
  put = lambda x: put_global(np.asarray(x), sharding)
  step = jax.jit(make_train_step(model.apply, tx, groups=GroupLoop(mesh)))
  return step(state, put(layout_counts(batch, counts, MICROBATCH)),
              put(np.asarray(counts, np.int32)))


def _full_batch_grads(model, params, batch):
  def loss(p):
    logits = model.apply({"params": p}, batch[:, :-1]).astype(jnp.float32)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]))
  return jax.jit(jax.grad(loss))(params)


# ------------------------------------------------------------------------- balanced step

def _keep_gradient() -> optax.GradientTransformation:
  """An optimizer whose state is the last gradient, exactly (and whose update is zero)."""
  return optax.GradientTransformation(
      lambda p: jax.tree.map(jnp.zeros_like, p),
      lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), g))


@pytest.mark.parametrize("counts", [(1, 3, 0, 4, 0, 0, 2, 2), (0, 0, 0, 0, 0, 0, 0, 5)])
def test_uneven_counts_give_the_full_batch_gradient(counts):
  mesh = make_mesh(data=8)
  seed = int(np.random.SeedSequence().entropy % 2**31)
  model, _, _, batch = setup(False, sum(counts) * MICROBATCH, seed)
  tx = _keep_gradient()
  state = _state(model, tx, batch, seed)
  new, metrics = _balanced_step(model, tx, state, batch, counts, mesh)
  ref = _full_batch_grads(model, state.params, jnp.asarray(batch))
  for g, r in zip(jax.tree.leaves(new.opt_state), jax.tree.leaves(ref)):
    assert rel_err(g, r) < 2e-5, f"seed {seed}"
  # A wrong weighting (mean of the groups' means) would be far off with these counts.
  assert rel_err(metrics["grad_norm"], optax.tree.norm(ref)) < 2e-5


def test_fp8_balanced_step_equals_uniform_microbatches_and_ran_in_fp8():
  mesh = make_mesh(data=8)
  counts = (3, 0, 1, 2, 0, 1, 4, 1)
  model, tx, state, batch = setup(True, sum(counts) * MICROBATCH,
                                  int(np.random.SeedSequence().entropy % 2**31))
  # Give the FP8 state a history so the delayed scales are not the initial ones.
  warm, _ = jax.jit(make_train_step(model.apply, optax.sgd(0.0), sum(counts)))(state, batch)
  state = state._replace(fp8=warm.fp8)
  new, metrics = _balanced_step(model, tx, state, batch, counts, mesh)
  ref, ref_metrics = jax.jit(make_train_step(model.apply, tx, sum(counts)))(state, batch)
  for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-6)
  # FP8 state: max over microbatches and groups == max over the uniform step's microbatches.
  for a, b in zip(jax.tree.leaves(new.fp8), jax.tree.leaves(ref.fp8)):
    np.testing.assert_array_equal(a, b)
  assert np.asarray(jax.tree.leaves(new.fp8)[1])[0] > 0  # a fresh amax was recorded
  # It ran in FP8: the gradient is clearly off the f32 model's, and bounded.
  g_fp8 = jax.tree.map(lambda a, b: a - b, state.params, new.params)
  g_f32 = _full_batch_grads(_LM(False), state.params, jnp.asarray(batch))
  errors = [rel_err(a, b) for a, b in zip(jax.tree.leaves(g_fp8), jax.tree.leaves(g_f32))]
  assert 2e-3 < max(errors) < 0.25, errors


def test_layout_batch_keeps_order_and_checks_counts():
  batch = np.arange(2 * 6 * 3).reshape(12, 3)
  out = layout_counts(batch, [2, 0, 1, 3], 2)
  assert out.shape == (4, 3, 2, 3)
  np.testing.assert_array_equal(out[0, :2].reshape(-1, 3), batch[:4])
  np.testing.assert_array_equal(out[2, 0], batch[4:6])
  np.testing.assert_array_equal(out[3].reshape(-1, 3), batch[6:])
  assert not out[1].any() and not out[2, 1:].any()
  with pytest.raises(ValueError, match=r"batch of 12 sequences != sum\(counts\)=5"):
    layout_counts(batch, [2, 3], 2)
  with pytest.raises(ValueError, match="must be >= 0"):
    layout_counts(batch, [-1, 7], 2)


@pytest.mark.parametrize("rows, spec", [(8, ("data", "fsdp")), (4, ("data",)), (12, ("data",)),
                                       (2, None), (3, None)])
def test_microbatches_split_only_over_ranks_they_fill(rows, spec):
  """A balanced run's microbatch of fewer sequences than data ranks stays whole (an uneven
  split pads it, and the padding's resharding inside a pipeline stage's branch hung)."""
  mesh = make_mesh(data=4, fsdp=2)
  want = jax.sharding.PartitionSpec(None, spec) if spec else jax.sharding.PartitionSpec()
  assert microbatches_sharding(mesh, rows).spec == want
  x = jax.device_put(np.arange(2 * rows * 3).reshape(2, rows, 3),
                     microbatches_sharding(mesh, rows))
  np.testing.assert_array_equal(np.asarray(x), np.arange(2 * rows * 3).reshape(2, rows, 3))


# ------------------------------------------------------------------------------ balancer

def _brute_force(seconds, total, caps):
  best = None
  for counts in itertools.product(*[range(total + 1 if c is None else min(c, total) + 1)
                                    for c in caps]):
    if sum(counts) == total:
      span = balance.makespan(counts, seconds)
      best = span if best is None else min(best, span)
  return best


def test_balancer_matches_brute_force():
  rng = np.random.default_rng()
  for _ in range(60):
    groups = int(rng.integers(1, 5))
    seconds = list(rng.uniform(0.1, 3.0, groups))
    total = int(rng.integers(1, 9))
    caps = [None if rng.random() < 0.5 else int(rng.integers(0, 6)) for _ in range(groups)]
    if sum(np.inf if c is None else c for c in caps) < total:
      with pytest.raises(ValueError, match="do not fit"):
        balance.balance_counts(seconds, total, caps)
      continue
    counts = balance.balance_counts(seconds, total, caps)
    assert sum(counts) == total
    assert all(c is None or n <= c for n, c in zip(counts, caps))
    assert balance.makespan(counts, seconds) == pytest.approx(_brute_force(seconds, total, caps))


def test_balancer_gives_faster_groups_more_and_is_deterministic():
  assert balance.balance_counts([1.0, 1.0, 2.0, 2.0], 12) == (4, 4, 2, 2)
  assert balance.balance_counts([1.0, 1.0], 3) == (2, 1)  # ties: lower index first
  for bad, message in [(([1.0, 0.0], 2), "must be finite and > 0"),
                       (([1.0], 0), "total_microbatches=0 is not allowed"),
                       (([], 1), "is empty")]:
    with pytest.raises(ValueError, match=message):
      balance.balance_counts(*bad)


def test_plan_respects_memory_and_picks_the_fastest_size():
  fast = balance.KindProfile("H100", {1: 1.0, 2: 1.6, 4: 2.8}, {4: True})
  slow = balance.KindProfile("A100", {1: 2.5, 2: 4.0, 4: 7.0}, {4: False})  # 4 does not fit
  plan = balance.plan_microbatches(["H100", "H100", "A100", "A100"],
                                   {"H100": fast, "A100": slow}, 16)
  assert plan.microbatch_size == 2  # 4 would be faster per sequence but the A100 cannot hold it
  assert sum(plan.counts) * plan.microbatch_size == 16
  assert plan.counts[0] > plan.counts[2]
  assert plan.seconds < plan.uniform_seconds
  alone = balance.plan_microbatches(["H100"], {"H100": fast}, 16)
  assert alone.microbatch_size == 4
  with pytest.raises(ValueError, match=r"no throughput profile for device kind\(s\) \['B200'\]"):
    balance.plan_microbatches(["B200"], {"H100": fast}, 16)
  with pytest.raises(ValueError, match="no microbatch size"):
    balance.plan_microbatches(["A100"], {"A100": slow}, 16, sizes=[4])  # 4 does not fit


# ---------------------------------------------------------------------------- capability

def _report(i, kind="NVIDIA H100 80GB HBM3", cc="9.0", platform="gpu"):
  return hardware.DeviceReport(i, platform, kind, cc, 8)


def test_capability_decisions_per_kind_and_uniform():
  reports = [_report(1), _report(0, "NVIDIA A100-SXM4-80GB", "8.0"), _report(2, "cpu", None,
                                                                             "cpu")]
  plan = capability.decide(reports)
  assert plan.native == (False, True, False)
  assert "8.0 < 8.9" in plan.reason_on(0) and "no FP8 GEMMs" in plan.reason_on(2)
  assert "process 1: 8 x NVIDIA H100 80GB HBM3 (gpu, sm 9.0): native FP8 GEMMs" in plan.lines()
  uniform = capability.decide(reports, "uniform")
  assert uniform.native == (False, False, False)
  assert "uniform policy, process 0" in uniform.reason_on(1)
  assert capability.decide([_report(0, "NVIDIA L40S", "8.9")]).native == (True,)
  with pytest.raises(ValueError, match="policy 'fastest' is not allowed"):
    capability.decide(reports, "fastest")
  with pytest.raises(ValueError, match=r"need each of 0..1 once"):
    capability.decide([_report(0), _report(0)])


def test_capability_plan_drives_the_fp8_dot():
  plan = capability.decide([_report(0)])
  try:
    hardware.install_plan(plan)
    assert fp8jax.dot.native_fp8_reason() is None
    hardware.install_plan(capability.decide([_report(0, "NVIDIA A100-SXM4-80GB", "8.0")]))
    assert "8.0 < 8.9" in fp8jax.dot.native_fp8_reason()
  finally:
    hardware.install_plan(None)
  assert "cpu" in fp8jax.dot.native_fp8_reason()


def test_agree_installs_the_plan_the_fp8_dot_reads():
  try:
    plan = capability.agree("per_kind", _report(0))
    assert hardware.active_plan() is plan
    assert fp8jax.dot.native_fp8_reason() is None
  finally:
    hardware.install_plan(None)
  assert hardware.active_plan() is None


class _FakeDevice:
  def __init__(self, kind):
    self.platform, self.device_kind = "gpu", kind
    self.compute_capability = "9.0"

  def memory_stats(self):
    return {"bytes_limit": 80 * 2**30}


def test_mixed_kinds_in_one_process_are_refused():
  ok = hardware.local_report([_FakeDevice("NVIDIA H100"), _FakeDevice("NVIDIA H100")])
  assert ok.device_count == 2 and ok.memory_bytes == 80 * 2**30
  with pytest.raises(hardware.MixedDevicesError, match="Launch one process per kind"):
    hardware.local_report([_FakeDevice("NVIDIA H100"), _FakeDevice("NVIDIA A100")])


# ---------------------------------------------------------------------- device_map, config

def test_device_map_matches_kinds_and_reads_profiles(tmp_path):
  kinds = ["NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"]
  assert device_map_lib.seconds_per_microbatch({"H100": 2.0, "a100": 1.0}, kinds, 4) == \
      [0.5, 1.0]
  assert device_map_lib.seconds_per_microbatch(
      {"NVIDIA": 1.0, "H100 80GB": {"throughput": 0.25}}, kinds, 4) == [4.0, 1.0]  # longest
  data = {"format": profile_lib.FORMAT, "device_kind": kinds[1], "compute_capability": "8.0",
          "platform": "gpu", "memory_bytes": None, "level": "O2", "seq_len": 16,
          "points": [{"microbatch": 4, "seconds": 0.3, "tokens_per_s": 213.0,
                      "peak_bytes": None, "fits": True}]}
  path = profile_lib.write(data, str(tmp_path / "a100.json"))
  assert device_map_lib.seconds_per_microbatch({"A100": {"profile": path}, "H100": 1.0},
                                               kinds, 4) == [1.0, 0.3]
  assert device_map_lib.seconds_per_microbatch(str(tmp_path), kinds[1:], 4) == [0.3]
  with pytest.raises(ValueError, match="no entry for device kind 'NVIDIA H100 80GB HBM3'"):
    device_map_lib.seconds_per_microbatch({"A100": 1.0}, kinds, 4)
  with pytest.raises(ValueError, match=r"no fitting measurement at microbatch 8 \(measured: "):
    device_map_lib.seconds_per_microbatch(str(tmp_path), kinds[1:], 8)
  with pytest.raises(ValueError, match="no \\*.json profiles"):
    device_map_lib.seconds_per_microbatch(str(tmp_path / "none"), kinds, 4)
  (tmp_path / "bad.json").write_text('{"format": "other"}')
  with pytest.raises(ValueError, match="format must be 'fp8jax-profile/1'"):
    profile_lib.load(str(tmp_path / "bad.json"))


@pytest.mark.parametrize("value, message", [
    ({"H100": 0}, r"parallel.device_map.H100=0 is not allowed; use a relative throughput > 0"),
    ({"H100": True}, r"parallel.device_map.H100=True is not allowed"),
    ({"H100": {"speed": 1}}, r"give exactly one of \('throughput', 'profile'\)"),
    ({"H100": {"profile": 3}}, r"profile=3 must be a file path"),
    ([1, 2], r"device_map=\[1, 2\] has type list; expected a mapping"),
    ({}, r"device_map={} is not allowed; use a mapping"),
])
def test_bad_device_maps_are_refused(value, message):
  with pytest.raises(ValueError, match=message):
    config_from_dict({"parallel": {"device_map": value}})


def test_offload_with_device_map_is_refused_and_policy_checked():
  with pytest.raises(ValueError, match="offload_optimizer=True with parallel.device_map"):
    config_from_dict({"parallel": {"device_map": {"cpu": 1}, "offload_optimizer": True,
                                   "zero_stage": 1}})
  with pytest.raises(ValueError, match="parallel.fp8_capability"):
    config_from_dict({"parallel": {"fp8_capability": "all"}})


# ---------------------------------------------------------------------- profile, Trainer

def _tiny(**over):
  cfg = {"model": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_seq_len": 16},
         "data": {"seq_len": 16, "max_bytes": 200_000},
         "train": {"steps": 3, "batch_size": 12, "microbatches": 6, "warmup_steps": 1,
                   "eval_every": 0, "log_every": 1, "opt_level": "O1",
                   "fp8_health_every": 0},  # (no probe to compile)
         "runtime": {}}
  for path, value in over.items():
    section, key = path.split(".")
    cfg.setdefault(section, {})[key] = value
  return config_from_dict(cfg)


def test_profile_measures_sizes_and_round_trips(tmp_path):
  data = train_profile.measure(_tiny(), [1, 2], steps=1)
  assert [p["microbatch"] for p in data["points"]] == [1, 2]
  assert all(p["fits"] and p["seconds"] > 0 for p in data["points"])
  assert data["device_kind"] == jax.devices()[0].device_kind and data["level"] == "O1"
  path = profile_lib.write(data, str(tmp_path / "p.json"))
  assert profile_lib.load(path).admits(2)
  assert "ms/microbatch" in profile_lib.table(data)
  small = train_profile.measure(_tiny(), [1, 2], steps=1, memory_limit_bytes=1)
  assert small["points"] == [{**small["points"][0], "fits": False, "seconds": None}]


def test_profile_calibrates_like_the_trainer(monkeypatch):
  """With fp8.calibrate on, the profile times the calibrated step, its scales from a
  calibration pass (as the Trainer runs it): one train-step program."""
  from fp8jax.train.compiles import CompileLog
  models = []
  real = train_profile.calibrated
  monkeypatch.setattr(train_profile, "calibrated",
                      lambda m: models.append(real(m)) or models[-1])
  with CompileLog() as log:
    data = train_profile.measure(_tiny(**{"fp8.calibrate": "always"}), [1], steps=1)
  assert data["points"][0]["fits"] and len(models) == 1 and models[0].recipe.calibrated
  # (the step jax names after guards.skip_nonfinite_steps's wrapper)
  assert len(log.of("guarded")) == len(log.of("fp8_probe")) == 1, log.compiles
  train_profile.measure(_tiny(**{"fp8.calibrate": "never"}), [1], steps=1)
  assert len(models) == 1


def test_trainer_runs_balanced_and_matches_the_uniform_run(tmp_path):
  """The balanced run at ZeRO-3, where its groups' unequal counts (1 or 0 microbatches) make
  the per-group step take the parameters whole (per-layer collectives inside loops of
  different lengths would not pair up), against the uniform run (stage 0)."""
  from fp8jax.train.loop import Trainer
  runs = {}
  for name, extra in [("uniform", {}), ("balanced", {"parallel.device_map": {"cpu": 1.0},
                                                     "parallel.zero_stage": 3})]:
    trainer = Trainer(_tiny(**{"runtime.run_dir": str(tmp_path / name), **extra}),
                      progress=False)
    runs[name] = (trainer, trainer.run())
  balanced_trainer = runs["balanced"][0]
  assert balanced_trainer.balanced_counts(6) == (1, 1, 1, 1, 1, 1, 0, 0)  # 8 CPU devices
  assert balanced_trainer.balanced_counts(13) == (2, 2, 2, 2, 2, 1, 1, 1)
  losses = {n: [r["loss"] for r in fp8jax.train.metrics.read_jsonl(
      str(tmp_path / n / "metrics.jsonl")) if "loss" in r] for n in runs}
  assert len(losses["balanced"]) == 3
  np.testing.assert_allclose(losses["balanced"], losses["uniform"], rtol=2e-4)


# ----------------------------------------------------------------- two processes (slow)

@pytest.mark.slow
def test_two_processes_agree_and_balanced_step_is_the_full_batch_step(tmp_path):
  counts = (1, 3)
  # No timing steps: step times are benchmarks/hetero/balance_cpu.py's (this worker, timed).
  ft_util.run_workers("hetero_worker.py", [tmp_path, "1,3", "2,0", 0], 2, timeout=400)
  plans = [json.loads((tmp_path / f"plan_{i}.json").read_text()) for i in range(2)]
  assert plans[0] == plans[1] and plans[0]["native"] == [False, True]
  model, tx, state, batch = setup(True, sum(counts) * MICROBATCH)
  ref, ref_metrics = jax.jit(make_train_step(model.apply, tx, sum(counts)))(state, batch)
  got = np.load(tmp_path / "step.npz")
  got = [got[f"arr_{i}"] for i in range(len(got.files))]
  want = jax.tree.leaves((ref.params, ref.fp8, ref_metrics["loss"]))
  assert len(got) == len(want)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
