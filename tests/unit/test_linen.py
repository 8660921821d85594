import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax.linen import FP8_COLLECTION, Einsum, Fp8DotGeneral, apply_fp8_updates
from conftest import rel_err

FP8 = functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())


def _f64_vjp(fn, params, x, g):
  """fn's output and gradients in float64."""
  with jax.enable_x64():
    to64 = lambda t: jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), t)
    y, vjp = jax.vjp(fn, to64(params), to64(x))
    return jax.tree.map(np.asarray, (y, *vjp(to64(g))))


@pytest.mark.parametrize("make", [
    lambda dg: nn.Dense(48, dot_general_cls=dg),
    lambda dg: nn.DenseGeneral((4, 12), axis=(-2, -1), dot_general_cls=dg),
    lambda dg: nn.DenseGeneral(24, axis=-1, batch_dims=(0,), dot_general_cls=dg),
])
def test_dense_layers_vs_float64(key, make):
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (6, 8, 64))
  layer, ref_layer = make(FP8), make(None)
  variables = layer.init(k2, x)
  params = variables["params"]
  g = jax.random.normal(k3, jax.eval_shape(lambda: ref_layer.apply({"params": params}, x)).shape)
  y_ref, dp_ref, dx_ref = _f64_vjp(lambda p, x: ref_layer.apply({"params": p}, x), params, x, g)
  y, vjp = jax.vjp(lambda p, x: layer.apply({**variables, "params": p}, x), params, x)
  dp, dx = vjp(g)
  with jax.default_matmul_precision("bfloat16"):
    yb = ref_layer.apply({"params": jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)},
                         x.astype(jnp.bfloat16))
  assert 3 * rel_err(yb, y_ref) < rel_err(y, y_ref) < 0.08
  assert rel_err(dx, dx_ref) < 0.15 and rel_err(dp["kernel"], dp_ref["kernel"]) < 0.15
  assert rel_err(dp["bias"], dp_ref["bias"]) < 1e-5  # bias add is not FP8


@pytest.mark.parametrize("eqn,x_shape,k_shape", [
    ("btd,dhk->bthk", (2, 8, 32), (32, 4, 16)),
    ("bthk,hkd->btd", (2, 8, 4, 16), (4, 16, 32)),
    ("...d,de->e...", (3, 5, 32), (32, 16)),
])
def test_einsum_vs_float64(key, eqn, x_shape, k_shape):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, x_shape)
  layer = Einsum(k_shape, eqn, use_bias=False)
  variables = layer.init(k2, x)
  ref = np.einsum(eqn, np.asarray(x, np.float64), np.asarray(variables["params"]["kernel"], np.float64))
  y = layer.apply(variables, x)
  assert y.shape == ref.shape
  assert 0.005 < rel_err(y, ref) < 0.08
  assert FP8_COLLECTION in variables


def _model_twice():
  class Twice(nn.Module):
    @nn.compact
    def __call__(self, x):
      d = nn.Dense(32, dot_general_cls=FP8)
      return d(x) + d(x * 1000.0)
  return Twice()


def test_reused_layer_records_the_max_amax_once(key):
  x = jax.random.normal(key, (16, 32))
  model = _model_twice()
  variables = model.init(jax.random.key(0), x)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)
  meta = grads[FP8_COLLECTION]["Dense_0"]["Fp8DotGeneral_0"]
  assert float(meta["input"].amax_history[0]) == float(jnp.max(jnp.abs(x * 1000.0)))
  assert not np.asarray(meta["input"].amax_history[1:]).any()
  assert float(meta["kernel"].amax_history[0]) == float(
      jnp.max(jnp.abs(variables["params"]["Dense_0"]["kernel"])))


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return nn.gelu(nn.Dense(x.shape[-1], dot_general_cls=FP8)(x)), None


def _stack(n, remat):
  class Stack(nn.Module):
    @nn.compact
    def __call__(self, x):
      block = nn.remat(_Block) if remat else _Block
      layers = nn.scan(block, variable_axes={"params": 0, FP8_COLLECTION: 0},
                       split_rngs={"params": True}, length=n)
      return layers()(x, None)[0]
  return Stack()


@pytest.mark.parametrize("remat", [False, True])
def test_scan_stacks_state_per_layer(key, remat):
  x = jax.random.normal(key, (16, 32)) * 5
  model = _stack(3, remat)
  variables = model.init(jax.random.key(0), x)
  state = jax.tree.leaves(variables[FP8_COLLECTION])
  assert all(a.shape[0] == 3 for a in state)
  grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2)))(variables)
  (inner,) = grads[FP8_COLLECTION].values()
  hist = inner["Dense_0"]["Fp8DotGeneral_0"]["input"].amax_history
  assert hist.shape == (3, 16)
  assert float(hist[0, 0]) == float(jnp.max(jnp.abs(x)))
  assert len(set(np.asarray(hist[:, 0]).tolist())) == 3  # each layer its own amax


def test_apply_fp8_updates_replaces_state_and_keeps_params(key):
  x = jax.random.normal(key, (16, 32))
  model = _model_twice()
  variables = model.init(jax.random.key(0), x)
  grads = jax.grad(lambda v: jnp.sum(model.apply(v, x)))(variables)
  new = apply_fp8_updates(variables, grads)
  assert new["params"] is variables["params"]
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), new[FP8_COLLECTION],
                                   grads[FP8_COLLECTION]))
  with pytest.raises(ValueError, match="no 'fp8_meta' collection"):
    apply_fp8_updates(variables, {"params": grads["params"]})


def test_apply_fp8_updates_keeps_state_of_layers_that_did_not_run(key):
  class Branchy(nn.Module):
    @nn.compact
    def __call__(self, x, use_b):
      a, b = nn.Dense(8, dot_general_cls=FP8), nn.Dense(8, dot_general_cls=FP8)
      return a(x) + (b(x) if use_b else 0.0)
  x = jax.random.normal(key, (4, 16))
  m = Branchy()
  variables = m.init(jax.random.key(0), x, True)
  variables = apply_fp8_updates(variables, jax.grad(lambda v: jnp.sum(m.apply(v, x, True)))(variables))
  grads = jax.grad(lambda v: jnp.sum(m.apply(v, x, False)))(variables)
  new = apply_fp8_updates(variables, grads)
  old_b = variables[FP8_COLLECTION]["Dense_1"]["Fp8DotGeneral_0"]["input"]
  new_b = new[FP8_COLLECTION]["Dense_1"]["Fp8DotGeneral_0"]["input"]
  assert float(new_b.scale) == float(old_b.scale) > 0


class _MLP(nn.Module):
  dot_general_cls: object = None

  @nn.compact
  def __call__(self, x):
    for width in (64, 64):
      x = nn.gelu(nn.Dense(width, dot_general_cls=self.dot_general_cls)(x))
    return nn.Dense(1, dot_general_cls=self.dot_general_cls)(x)


def _train(model, x, y, steps=60):
  variables = model.init(jax.random.key(0), x)
  tx = optax.adam(3e-3)
  opt_state = tx.init(variables["params"])

  @jax.jit
  def step(variables, opt_state):
    loss, grads = jax.value_and_grad(lambda v: jnp.mean((model.apply(v, x) - y) ** 2))(variables)
    updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
    variables = apply_fp8_updates(variables, grads)
    return {**variables, "params": optax.apply_updates(variables["params"], updates)}, opt_state, loss

  losses = []
  for _ in range(steps):
    variables, opt_state, loss = step(variables, opt_state)
    losses.append(float(loss))
  return np.array(losses), opt_state


def test_fp8_training_tracks_float32(key):
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (256, 16))
  y = jnp.sin(x @ jax.random.normal(k2, (16, 1)))
  l32, _ = _train(_MLP(), x, y)
  l8, opt_state = _train(_MLP(FP8), x, y)
  assert np.isfinite(l8).all()
  assert l32[-1] < 0.1 * l32[0] and l8[-1] < 0.1 * l8[0]
  # The curves agree to a few % of the starting loss (FP8 gradient noise, ~6% per element,
  # shows only near convergence).
  assert np.max(np.abs(l8 - l32)) < 0.06 * l32[0]
  assert not np.array_equal(l8, l32)  # FP8 really ran
  # The optimizer never saw FP8 state.
  assert not any(isinstance(x, fp8jax.Fp8Meta) for x in
                 jax.tree.leaves(opt_state, is_leaf=lambda t: isinstance(t, fp8jax.Fp8Meta)))
