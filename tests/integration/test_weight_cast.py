"""Remat keeps the forward's FP8 weight casts: half the weight casts and weight amax passes
per microbatch, bit-identical loss and gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import fsdp, parallel
from fp8jax.dot import SAVE_FP8_WEIGHTS
from fp8jax.models import GPT, ModelConfig, init_model
from fp8jax.train import batch_loss

# fp8_head: the LM head's FP8 GEMM is the one outside the layer scan
CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16, remat=True,
                  fp8_head=True)
RECIPE = fp8jax.O1.recipe
B, T = 2, 8  # activations are [16, D] / [16, F]: no weight has 16 rows
# Each GEMM's weight as cast ([K, N]): qkv, attn out, fc_in, fc_out (per layer), head.
WEIGHT_SHAPES = {(32, 96), (32, 32), (32, 64), (64, 32), (32, 256)}


@functools.lru_cache(maxsize=None)
def _loss_and_grads(save: bool):
  """(variables, int32[B, T+1]) -> (loss, grads w.r.t. all variables), not jitted."""
  model = GPT(CFG.replace(remat_save_fp8_weights=save), RECIPE)
  loss_fn = lambda v, batch: batch_loss(model.apply, v, batch)
  return jax.value_and_grad(loss_fn)


def _eqns(jaxpr):
  """All equations of `jaxpr` and of the jaxprs nested in it (scan, remat, custom_vjp, ...)."""
  for eqn in jaxpr.eqns:
    yield eqn
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
        if hasattr(sub, "eqns"):
          yield from _eqns(sub)


def _weight_ops(save: bool, variables, batch):
  """(FP8 casts, amax reductions) of weight-shaped arrays in the traced training gradient.

  Each op inside the layer scan is counted once (it runs once per layer)."""
  jaxpr = jax.make_jaxpr(_loss_and_grads(save))(variables, batch).jaxpr
  casts = amaxes = 0
  for eqn in _eqns(jaxpr):
    shape = tuple(eqn.invars[0].aval.shape) if eqn.invars else ()
    if shape not in WEIGHT_SHAPES:
      continue
    casts += (eqn.primitive.name == "convert_element_type"
              and eqn.params["new_dtype"] == RECIPE.fwd_format)
    amaxes += eqn.primitive.name == "reduce_max"
  return casts, amaxes


def _inputs(key):
  k1, k2 = jax.random.split(key)
  return init_model(CFG, RECIPE, k1, B, T), jax.random.randint(k2, (B, T + 1), 0, 256)


def test_weight_casts_halve_under_remat(key):
  variables, batch = _inputs(key)
  # Off: 4 GEMMs per layer cast (and amax) their weight in the forward and again in the
  # recomputation; the head (outside remat) once. On: the recomputation reuses the forward's.
  assert _weight_ops(False, variables, batch) == (4 * 2 + 1, 4 * 2 + 1)
  assert _weight_ops(True, variables, batch) == (4 + 1, 4 + 1)


def test_saved_weight_casts_are_bit_identical_at_o1(key):
  """Loss, parameter gradients and FP8 state updates are bit-identical with the option on
  and off, over two steps (fresh state, then delayed scales) on fresh random tokens."""
  variables, _ = _inputs(key)
  off, on = jax.jit(_loss_and_grads(False)), jax.jit(_loss_and_grads(True))
  for step in range(2):
    batch = jax.random.randint(jax.random.fold_in(key, step), (B, T + 1), 0, 256)
    (loss_off, g_off), (loss_on, g_on) = off(variables, batch), on(variables, batch)
    assert np.isfinite(float(loss_off)) and float(loss_off) == float(loss_on)
    for a, b in zip(jax.tree.leaves(g_off), jax.tree.leaves(g_on), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(jnp.max(jnp.abs(g_on["params"]["layers"]["mlp"]["fc_in"]["kernel"]))) > 0
    variables = fp8jax.apply_fp8_updates(variables, g_off)


def test_dot_under_checkpoint_with_saved_weight_cast(key):
  """SAVE_FP8_WEIGHTS on a bare dot: same gradients as no remat, no NaN. E4M3 weights above
  240 would turn NaN if the payload were saved as a float (remat's reduce_precision)."""
  k1, k2 = jax.random.split(key)
  x, w = jax.random.normal(k1, (32, 64)), jax.random.normal(k2, (64, 48))
  dn = (((1,), (0,)), ((), ()))
  f = lambda x, w, m: jnp.sum(jnp.tanh(fp8jax.fp8_dot_general(x, w, dn, m, RECIPE)))
  meta = fp8jax.init_dot_meta(RECIPE)
  plain = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2)))(x, w, meta)
  saved = jax.jit(jax.value_and_grad(jax.checkpoint(f, policy=SAVE_FP8_WEIGHTS),
                                     argnums=(0, 1, 2)))(x, w, meta)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(saved), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("value", ["yes", 1])
def test_bad_option_raises(value):
  with pytest.raises(ValueError, match=f"remat_save_fp8_weights={value!r} is not allowed"):
    CFG.replace(remat_save_fp8_weights=value)


# --- weights cast once per optimizer step for all microbatches (fp8.cast_weights_once) ---

def _fp8_casts(jaxpr, in_scan=False):
  """(input shape, inside a scan) of every cast to the forward FP8 format in `jaxpr`."""
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "convert_element_type"
        and eqn.params["new_dtype"] == RECIPE.fwd_format):
      yield tuple(eqn.invars[0].aval.shape), in_scan
    for param in eqn.params.values():
      for sub in param if isinstance(param, (tuple, list)) else (param,):
        sub = getattr(sub, "jaxpr", sub)
        if hasattr(sub, "eqns"):
          yield from _fp8_casts(sub, in_scan or eqn.primitive.name == "scan")


def _step_casts(key, once: bool, microbatches: int = 2):
  """Weight casts of a traced O1 train step: (inside the microbatch scan, outside it)."""
  import optax
  from fp8jax.train.build import weight_cast_fn
  from fp8jax.train.state import init_state
  from fp8jax.train.step import make_train_step
  from fp8jax.config import config_from_dict
  model = GPT(CFG, RECIPE)
  tx = optax.sgd(0.1)
  state = init_state(model, tx, fp8jax.O1, B, T, 0)
  cfg = config_from_dict({"fp8": {"cast_weights_once": once}})
  cast = weight_cast_fn(cfg, model, microbatches)
  step = make_train_step(model.apply, tx, microbatches, cast_weights=cast)
  batch = jax.random.randint(key, (B * microbatches, T + 1), 0, 256)
  casts = list(_fp8_casts(jax.make_jaxpr(step)(state, batch).jaxpr))
  params = jax.tree.leaves(state.params)
  inside = sum(shape in WEIGHT_SHAPES for shape, scanned in casts if scanned)
  outside = sum(any(shape == p.shape for p in params) for shape, scanned in casts if not scanned)
  return inside, outside


def test_weights_cast_once_per_step_for_all_microbatches(key):
  # Per microbatch: 4 GEMMs per layer (once per layer under remat with saved casts) + the head,
  # inside the microbatch loop. Once: every kernel (layers stacked: one cast each) before it.
  assert _step_casts(key, once=False) == (4 + 1, 0)
  assert _step_casts(key, once=True) == (0, 4 + 1)
  # One microbatch (no microbatch loop): nothing to save; the layers' 4 casts run inside the
  # layer scan, the head's outside any scan, as without the option.
  assert _step_casts(key, once=True, microbatches=1) == (4, 1)
  assert _step_casts(key, once=False, microbatches=1) == (4, 1)


# O1 casts f32 parameters (through the compute dtype), O2 its decoded BF16 matrices; ZeRO-1
# adds sharded parameters (O1 unsharded takes no path that the two cases do not).
@pytest.mark.parametrize("level, zero_stage", [("O2", None), ("O1", 1)])
def test_cast_once_trainer_is_bit_identical(tmp_path, monkeypatch, level, zero_stage):
  """Three calibrated Trainer steps of 2 microbatches (the first with the calibration pass's
  scales), fp8.cast_weights_once on and off: every state array bit-identical (data parallel,
  and ZeRO-1, over the 8 CPU devices)."""
  from fp8jax.config import config_from_dict
  from fp8jax import linen
  from fp8jax.train.loop import Trainer
  traced = []  # the steps that cast their weights before the microbatch loop (trace time)
  cast_weights = linen.cast_weights
  monkeypatch.setattr(linen, "cast_weights", lambda *a, **k: traced.append(1) or
                      cast_weights(*a, **k))
  states = {}
  for once in (False, True):
    cfg = config_from_dict({
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 16,
                  "remat": True, "fp8_head": True},
        "data": {"seq_len": 16, "max_bytes": 200_000},
        "train": {"steps": 3, "batch_size": 16, "microbatches": 2, "warmup_steps": 1,
                  "eval_every": 0, "opt_level": level},
        "parallel": {} if zero_stage is None else {"zero_stage": zero_stage},
        "fp8": {"cast_weights_once": once, "calibrate": "always"},
        "runtime": {"run_dir": str(tmp_path / str(once))}})
    trainer = Trainer(cfg, progress=False)
    for s in range(3):
      trainer.state, m = trainer.step_fn(2)(trainer.state, trainer.next_batch(s))
    assert np.isfinite(float(m["loss"])) and trainer.calibration.pending is False
    assert trainer.plan.stage == (zero_stage or 0)
    assert len(traced) == once  # one step program: the calibration pass scales the first
    states[once] = jax.device_get(trainer.state)
  p0 = jax.tree.leaves(states[False].model_params())[0]
  assert float(jnp.std(p0)) > 0
  for a, b in zip(jax.tree.leaves(states[False]), jax.tree.leaves(states[True]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_weight_casts_are_refused(key):
  x, w = jax.random.normal(key, (16, 32)), jax.random.normal(key, (32, 48))
  dn = (((1,), (0,)), ((), ()))
  meta = fp8jax.init_dot_meta(RECIPE)
  good = fp8jax.dot.cast_weight(w, meta.kernel, RECIPE)
  got = fp8jax.fp8_dot_general(x, w, dn, meta, RECIPE)
  np.testing.assert_array_equal(got, fp8jax.dot.fp8_dot_general_chained(
      x, w, dn, meta, RECIPE, weight_cast=good)[0])
  with pytest.raises(ValueError, match=r"weight_cast.q is float8_e4m3fn\[48, 32\]; the rhs "
                                       r"needs float8_e4m3fn\[32, 48\]"):
    fp8jax.dot.fp8_dot_general_chained(x, w, dn, meta, RECIPE,
                                       weight_cast=good._replace(q=good.q.T))
  with pytest.raises(TypeError, match="weight_cast must be an fp8jax.dot.WeightCast"):
    fp8jax.dot.fp8_dot_general_chained(x, w, dn, meta, RECIPE, weight_cast=tuple(good))
  from fp8jax.train.step import make_train_step
  with pytest.raises(ValueError, match="cast_weights with weight_gather is not supported"):
    make_train_step(lambda v, t: t, None, 2, cast_weights=lambda v: {},
                    weight_gather=fsdp.WeightGather(parallel.make_mesh(), lambda p, s: (P(), P())))
