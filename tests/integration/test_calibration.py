"""Calibrated delayed scaling: once every FP8 state has observed a tensor, a cast no longer
depends on its own tensor's amax (so XLA can fuse amax and cast into one pass); the Trainer
gives the first step its scales with a calibration pass and runs the calibrated step from the
start, with the losses of an uncalibrated run."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import dot, scaling
from fp8jax.config import load_config
from fp8jax.train.calibration import any_unobserved as _any_unobserved
from fp8jax.train.loop import Trainer
from numerics import fresh_seed

TINY = "configs/tiny.yaml"
E4M3, E5M2 = fp8jax.O1.recipe.fwd_format, fp8jax.O1.recipe.bwd_format


def _is_meta(x) -> bool:
  return isinstance(x, scaling.Fp8Meta)


def _nested(eqn):
  """Equations of the jaxprs nested in `eqn` (pjit, custom_jvp, ...), recursively."""
  for param in eqn.params.values():
    for sub in param if isinstance(param, (tuple, list)) else (param,):
      sub = getattr(sub, "jaxpr", sub)
      if hasattr(sub, "eqns"):
        for e in sub.eqns:
          yield e
          yield from _nested(e)


def _is_cast(eqn, fmt) -> bool:
  cast = lambda e: (e.primitive.name == "convert_element_type"
                    and np.dtype(e.params["new_dtype"]) == np.dtype(fmt))
  return cast(eqn) or any(cast(e) for e in _nested(eqn))


def _cast_ancestry(jaxpr, fmt, shape):
  """For each cast of a `shape` array to FP8 `fmt` at the top level of `jaxpr`: the set of
  primitive names it (transitively) depends on, nested jaxprs included."""
  producer = {v: e for e in jaxpr.eqns for v in e.outvars}
  out = []
  for eqn in jaxpr.eqns:
    if not _is_cast(eqn, fmt) or tuple(eqn.outvars[0].aval.shape) != shape:
      continue
    names, seen, stack = set(), set(), list(eqn.invars)
    while stack:
      v = stack.pop()
      if hasattr(v, "val") or v in seen:  # literals
        continue
      seen.add(v)
      e = producer.get(v)
      if e is not None:
        names |= {e.primitive.name} | {n.primitive.name for n in _nested(e)}
        stack.extend(e.invars)
    out.append(names)
  return out


def _observed_meta(key, recipe):
  """A meta that has seen a tensor (random positive history, scale from it)."""
  m = dot.init_dot_meta(recipe)
  amax = jax.random.uniform(key, (3,), minval=0.5, maxval=4.0)
  return dot.Fp8DotMeta(*(scaling.update_meta(r, a, recipe, f) for r, a, f in zip(
      m, amax, (recipe.fwd_format, recipe.fwd_format, recipe.bwd_format))))


@pytest.mark.parametrize("calibrated", [False, True])
def test_calibrated_casts_do_not_wait_for_their_own_amax(calibrated):
  recipe = fp8jax.O1.recipe.replace(calibrated=calibrated)
  cfg = dot._Config(recipe, jnp.float32, False, (), jnp.float32, jnp.float32)
  kx, kw, kg, km = jax.random.split(jax.random.key(1), 4)
  x, w = jax.random.normal(kx, (32, 48)), jax.random.normal(kw, (48, 16))
  meta = _observed_meta(km, recipe)
  fwd = jax.make_jaxpr(lambda x, w, m: dot._fp8_matmul_fwd(x, w, m, None, None, cfg))(x, w, meta)
  (y, _), res = dot._fp8_matmul_fwd(x, w, meta, None, None, cfg)
  g = jax.random.normal(kg, y.shape)
  bwd = jax.make_jaxpr(lambda res, g: dot._fp8_matmul_bwd(cfg, res, (g, meta)))(res, g)
  for jaxpr, fmt, shape in ((fwd.jaxpr, E4M3, x.shape), (fwd.jaxpr, E4M3, w.shape),
                            (bwd.jaxpr, E5M2, g.shape)):
    ancestry = _cast_ancestry(jaxpr, fmt, shape)
    assert len(ancestry) == 1, (shape, len(ancestry))
    assert ("reduce_max" in ancestry[0]) is not calibrated, (shape, sorted(ancestry[0]))


def test_calibrated_matches_uncalibrated_on_observed_state_and_differs_on_fresh():
  kx, kw, km = jax.random.split(jax.random.key(2), 3)
  x, w = jax.random.normal(kx, (64, 32)) * 3.0, jax.random.normal(kw, (32, 16)) * 0.1
  dn = (((1,), (0,)), ((), ()))
  plain, calibrated = fp8jax.O1.recipe, fp8jax.O1.recipe.replace(calibrated=True)
  run = lambda meta, recipe: fp8jax.fp8_dot_general(x, w, dn, meta, recipe)
  meta = _observed_meta(km, plain)
  np.testing.assert_array_equal(run(meta, plain), run(meta, calibrated))
  exact = x @ w
  err = lambda y: float(jnp.linalg.norm(y - exact) / jnp.linalg.norm(exact))
  fresh = dot.init_dot_meta(plain)
  assert err(run(fresh, plain)) < 0.1  # just-in-time scale on the first cast
  # Calibrated trusts the fresh meta's scale of 1: x (|x| up to ~12) fits E4M3, but the
  # product differs from the just-in-time cast's (another scale, other roundings).
  assert not np.array_equal(np.asarray(run(fresh, plain)), np.asarray(run(fresh, calibrated)))


@pytest.mark.parametrize("stages", [1, 2])
def test_trainer_calibrates_before_the_first_step_with_the_same_losses(tmp_path, stages):
  """fp8.calibrate=always: a calibration pass gives the first step the scales its own
  amaxes would (the uncalibrated model's just-in-time casts), so the calibrated step runs
  from step 0 with the losses of a run that never calibrates. With pipeline stages (2 x data
  4, 2 microbatches) the pass runs through the stages; the first step's second microbatch
  casts with the first one's scales instead of its own amaxes (as a run without stages of 2
  microbatches does): the same losses to 1e-4 at the first step."""
  losses, k = {}, 1 if stages == 1 else 2
  pipeline = [] if stages == 1 else [f"parallel.pipeline_parallel_size={stages}",
                                     f"train.microbatches={k}"]
  for mode in ("never", "always"):
    cfg = load_config(TINY, ["train.opt_level=O1", f"fp8.calibrate={mode}", "train.steps=4",
                             "train.warmup_steps=1", "checkpoint.checkpoint_every_n_steps=0",
                             "model.n_layers=2", "model.d_model=64",
                             "model.d_ff=128", f"runtime.run_dir={tmp_path / mode}",
                             *pipeline])
    trainer = Trainer(cfg, progress=False)
    assert trainer.calibration.enabled is (mode == "always")
    assert _any_unobserved(trainer.state.fp8)
    if mode == "always":  # the pass's scales: finite, every fresh state's changed
      data = trainer.train_batches.state()
      _, fp8 = trainer._calibrate(trainer.state, trainer.next_batch(0))
      trainer.train_batches.restore(data)  # (the step reads the batch again)
      fresh, given = (jax.tree.leaves(jax.device_get(f), is_leaf=_is_meta)
                      for f in (trainer.state.fp8, fp8))
      for a, b in zip(fresh, given):
        assert np.all(np.isfinite(b.scale)) and np.all(b.scale > 0)
        assert np.all(b.scale != a.scale) and np.array_equal(b.amax_history, a.amax_history)
    step, out = trainer.step_fn(k), []
    for s in range(4):
      trainer.state, m = step(trainer.state, trainer.next_batch(s))
      out.append(float(m["loss"]))
    assert not _any_unobserved(trainer.state.fp8)
    first, steady = trainer.calibration.first, trainer.calibration.model
    # one compiled step: the calibration pass (the FP8 probe) gave the first step its scales
    assert {(id(m), n) for m, n in trainer.steps.built()} == {(id(steady), k)}
    assert (first is steady) is (mode == "never")
    assert trainer.calibration.passes == (mode == "always")
    losses[mode] = out
  np.testing.assert_allclose(losses["always"], losses["never"], rtol=2e-3 if k > 1 else 2e-4)
  if k == 1:
    assert losses["always"][0] == losses["never"][0]  # the same first step
  else:
    # (the second microbatch casts with the first's scales: FP8 rounding of one microbatch)
    assert losses["always"][0] == pytest.approx(losses["never"][0], rel=2e-4)


def test_auto_calibrates_only_with_native_fp8_gemms():
  cfg = load_config(TINY, ["train.opt_level=O1", "checkpoint.checkpoint_every_n_steps=0"])
  trainer = Trainer(cfg, progress=False)
  assert trainer.calibration.enabled is (dot.native_fp8_reason() is None)
  assert not trainer.calibration.first.recipe.calibrated
  assert trainer.model.recipe.calibrated is trainer.calibration.enabled


def test_bad_calibrate_value_names_the_key():
  with pytest.raises(ValueError, match=r"fp8\.calibrate.*sometimes.*auto"):
    load_config(TINY, ["fp8.calibrate=sometimes"])
  with pytest.raises(ValueError, match=r"Recipe\.calibrated"):
    fp8jax.Recipe(calibrated="yes")


def test_unobserved_state_found_on_any_device():
  """A stacked FP8 state split over devices by layer (pipeline stages): a never-observed layer
  on the second device counts, as on the first."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2,), ("pipe",), devices=jax.devices()[:2])
  rng = np.random.default_rng(fresh_seed("unobserved shards"))
  history = rng.uniform(0.5, 2.0, (4, 16)).astype(np.float32)  # 4 layers, 2 per device
  put = lambda h: jax.device_put(h, NamedSharding(mesh, P("pipe")))
  meta = lambda h: {"layers": scaling.Fp8Meta(put(np.ones((4,), np.float32)), put(h))}
  assert not _any_unobserved(meta(history))
  for layer in (0, 3):
    fresh = history.copy()
    fresh[layer] = 0.0
    assert _any_unobserved(meta(fresh)), layer
