"""The train step: microbatches give the full-batch update, FP8 state by max, optimizer
never sees FP8 state."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from fp8jax.linen import FP8_COLLECTION, Fp8DotGeneral
from fp8jax.train import TrainState, eval_loss_fn, make_train_step
from fp8jax.train.optimizer import lr_schedule, make_optimizer


class _TinyLM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    fp8 = functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())
    h = nn.Embed(256, 32)(tokens)
    h = nn.gelu(nn.Dense(64, dot_general_cls=fp8)(h))
    return nn.Dense(256, dot_general_cls=fp8)(h)


def _setup(key, tx):
  model = _TinyLM()
  batch = jax.random.randint(key, (8, 17), 0, 256)
  variables = model.init(jax.random.key(0), batch[:, :-1])
  state = TrainState(jnp.zeros((), jnp.int32), variables["params"], variables[FP8_COLLECTION],
                     tx.init(variables["params"]))
  return model, batch, state


def test_microbatches_match_full_batch_and_max_fp8_state(key):
  tx = optax.sgd(0.1)
  model, batch, state = _setup(key, tx)
  full = jax.jit(make_train_step(model.apply, tx, 1))(state, batch)
  split = jax.jit(make_train_step(model.apply, tx, 4))(state, batch)
  (s1, m1), (s4, m4) = full, split
  # FP8 per-microbatch rounding differs from the full batch's: close, not identical.
  for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s4.params)):
    np.testing.assert_allclose(a, b, atol=2e-3)
  np.testing.assert_allclose(m1["loss"], m4["loss"], rtol=1e-3)
  # FP8 input state of the first GEMM: the largest microbatch amax == the full batch's.
  for s in (s1, s4):
    assert int(s.step) == 1
  a1 = s1.fp8["Dense_0"]["Fp8DotGeneral_0"]["input"].amax_history
  a4 = s4.fp8["Dense_0"]["Fp8DotGeneral_0"]["input"].amax_history
  assert float(a4[0]) == float(a1[0]) and not np.asarray(a4[1:]).any()


def test_training_reduces_loss_and_eval_matches(key):
  tx = make_optimizer(lr_schedule(1e-2, 5, 60, 0.1), b1=0.9, b2=0.95, eps=1e-8,
                      weight_decay=0.1, clip_norm=1.0)
  model, batch, state = _setup(key, tx)
  step = jax.jit(make_train_step(model.apply, tx, 2))
  loss = jax.jit(eval_loss_fn(model.apply))
  evaluate = lambda state: float(loss(state.variables(), batch))
  first = evaluate(state)
  for _ in range(60):
    state, metrics = step(state, batch)
  assert np.isfinite(float(metrics["grad_norm"]))
  assert evaluate(state) < 0.7 * first
  assert not any(isinstance(x, fp8jax.Fp8Meta) for x in jax.tree.leaves(
      state.opt_state, is_leaf=lambda t: isinstance(t, fp8jax.Fp8Meta)))
  assert int(state.fp8["Dense_1"]["Fp8DotGeneral_0"]["input"].amax_history.nonzero()[0].size) > 1


def test_schedule_warms_up_then_decays_to_floor():
  s = lr_schedule(1e-3, 10, 100, 0.1)
  assert float(s(0)) == 0.0 and abs(float(s(10)) - 1e-3) < 1e-9
  assert abs(float(s(100)) - 1e-4) < 1e-9 and float(s(50)) < 1e-3
