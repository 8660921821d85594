"""Flax NNX support: FP8 Linear/Einsum vs float64, Fp8State handling, scan, training."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import fp8jax
import fp8jax.nnx as fnnx
from fp8jax.nnx import Fp8State

DIFF = nnx.DiffState(0, fnnx.PARAM_AND_FP8)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _rel(out, ref) -> float:
  """||out - ref|| / ||ref|| in float64."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  assert np.all(np.isfinite(out)), "non-finite output"
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def _bf16(x) -> np.ndarray:
  """x rounded to bfloat16, as float64 (the inputs a BF16 GEMM sees)."""
  return np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)


def _f64(x) -> np.ndarray:
  return np.asarray(x, np.float64)


def _normal(seed, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _assert_fp8_error(out, ref, bf16_ref, bound=0.1):
  """FP8 error is bounded and clearly above BF16's (FP8 really happened)."""
  err, err_bf16 = _rel(out, ref), _rel(bf16_ref, ref)
  assert err < bound, (err, err_bf16)
  assert err > 3 * err_bf16, (err, err_bf16)


def _meta(module) -> fp8jax.Fp8DotMeta:
  return module.fp8_meta.get_value()


# ------------------------------------------------------------------------------- Linear

def test_linear_forward_and_grads_vs_float64():
  lin = fnnx.Linear(64, 48, bias_init=nnx.initializers.normal(1.0), rngs=nnx.Rngs(0))
  assert isinstance(lin, nnx.Linear)
  x, g = _normal(1, (4, 8, 64)), _normal(2, (4, 8, 48))
  w, b = _f64(lin.kernel[...]), _f64(lin.bias[...])

  def loss(model, x):
    return jnp.sum(model(x) * g)

  y = nnx.jit(lambda m, x: m(x))(lin, x)
  _assert_fp8_error(y, _f64(x) @ w + b, _bf16(x) @ _bf16(w) + b)

  grads, dx = nnx.jit(nnx.grad(loss, argnums=(DIFF, 1)))(lin, x)
  g64 = _f64(g)
  _assert_fp8_error(dx, g64 @ w.T, _bf16(g) @ _bf16(w).T, bound=0.15)
  dw_ref = np.einsum("btk,btn->kn", _f64(x), g64)
  dw_bf16 = np.einsum("btk,btn->kn", _bf16(x), _bf16(g))
  _assert_fp8_error(grads["kernel"][...], dw_ref, dw_bf16, bound=0.15)
  np.testing.assert_allclose(grads["bias"][...], g64.sum((0, 1)), rtol=1e-5, atol=1e-4)


def test_linear_matches_nnx_linear_init_and_rejects_bad_args():
  ours = fnnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(3))
  ref = nnx.Linear(8, 4, use_bias=False, rngs=nnx.Rngs(3))
  np.testing.assert_array_equal(ours.kernel[...], ref.kernel[...])
  assert ours.bias is None
  with pytest.raises(ValueError, match="dot_general"):
    fnnx.Linear(8, 4, dot_general=lambda *a, **k: None, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="recipe"):
    fnnx.Linear(8, 4, recipe="O1", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="out_sharding"):
    ours(jnp.ones((2, 8)), out_sharding="x")


# ------------------------------------------------------------------------------- Einsum

EINSUMS = [
    # (equation, input shape, kernel shape, bias shape, bias broadcast to the output)
    ("btd,dh->bth", (4, 8, 32), (32, 24), (24,), (1, 1, 24)),
    ("bsnh,nhd->bsd", (4, 6, 4, 16), (4, 16, 24), (24,), (1, 1, 24)),  # two contracting dims
    ("ntha,hab->nhtb", (4, 8, 3, 32), (3, 32, 16), (3, 16), (1, 3, 1, 16)),  # batch h, transposed
    ("...d,dh->...h", (2, 3, 5, 32), (32, 24), None, None),              # ellipsis
    ("...hd,hdf->...hf", (4, 6, 2, 32), (2, 32, 16), (2, 16), (1, 1, 2, 16)),  # ellipsis + batch
    ("btd,dh->hbt", (4, 8, 32), (32, 24), None, None),                   # output transposed
    ("btdx,dh->bth", (4, 8, 32, 3), (32, 24), (24,), (1, 1, 24)),        # lhs-only label summed
]


@pytest.mark.parametrize("eqn,x_shape,k_shape,b_shape,b_bcast", EINSUMS)
def test_einsum_forward_vs_float64(eqn, x_shape, k_shape, b_shape, b_bcast):
  layer = fnnx.Einsum(eqn, k_shape, b_shape, bias_init=nnx.initializers.normal(1.0),
                      rngs=nnx.Rngs(0))
  assert isinstance(layer, nnx.Einsum)
  x = _normal(1, x_shape)
  k = _f64(layer.kernel[...])
  y = nnx.jit(lambda m, x: m(x))(layer, x)
  ref = np.einsum(eqn, _f64(x), k)
  ref_bf16 = np.einsum(eqn, _bf16(x), _bf16(k))
  assert y.shape == ref.shape
  if b_shape is not None:
    b = np.reshape(_f64(layer.bias[...]), b_bcast)
    ref, ref_bf16 = ref + b, ref_bf16 + b
  _assert_fp8_error(y, ref, ref_bf16)


TRANSLATIONS = [
    ("ij,jk->ik", (5, 6), (6, 7)),
    ("ij,jk", (5, 6), (6, 7)),                          # implicit output
    ("bij,bjk->bki", (3, 5, 6), (3, 6, 7)),
    ("abcd,cdbe->eba", (2, 3, 4, 5), (4, 5, 3, 6)),
    ("i,j->ji", (5,), (7,)),                            # outer product, no contraction
    ("ijx,jyk->i", (4, 5, 3), (5, 2, 6)),               # summed labels on both sides
    ("...ij,...jk->...ik", (2, 3, 4, 5), (3, 5, 6)),    # ellipsis broadcast by rank
    ("...ij,...jk->...ik", (2, 1, 4, 5), (3, 5, 6)),    # size-1 axis broadcast
    ("...ij,jk->k", (2, 3, 4, 5), (5, 6), "abij,jk->k"),  # ellipsis dims summed (jnp rule)
    ("bqhd,bkhd->bhqk", (2, 5, 3, 4), (2, 7, 3, 4)),    # attention scores
]


@pytest.mark.parametrize("eqn,ls,rs,ref_eqn", [t + (t[0],) if len(t) == 3 else t
                                                for t in TRANSLATIONS])
def test_einsum_to_dot_general_is_exact(eqn, ls, rs, ref_eqn):
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in (ls, rs))
  d = fnnx.einsum_to_dot_general(eqn, ls, rs)
  a2 = jnp.sum(a, axis=d.lhs_sum) if d.lhs_sum else a
  b2 = jnp.sum(b, axis=d.rhs_sum) if d.rhs_sum else b
  y = lax.dot_general(a2, b2, d.dimension_numbers, precision=lax.Precision.HIGHEST)
  y = jnp.transpose(y, d.out_perm)
  ref = np.einsum(ref_eqn, _f64(a), _f64(b))
  assert y.shape == ref.shape
  assert _rel(y, ref) < 1e-5


@pytest.mark.parametrize("eqn,ls,rs,match", [
    ("ii,ij->j", (3, 3), (3, 4), "repeated label"),
    ("ij,jk,kl->il", (2, 3), (3, 4), "two operands"),
    ("ij,jk->iz", (2, 3), (3, 4), "no operand"),
    ("ij,jk->ik", (2, 3), (4, 5), "size 3"),
    ("ijk,jk->i", (2, 3), (3, 4), "2"),
    ("i1,1k->ik", (2, 3), (3, 4), "letters"),
])
def test_einsum_bad_equations_raise(eqn, ls, rs, match):
  with pytest.raises(ValueError, match=match):
    fnnx.einsum_to_dot_general(eqn, ls, rs)


def test_einsum_call_time_equation_and_grads():
  layer = fnnx.Einsum("btd,dh->bth", (32, 16), rngs=nnx.Rngs(0))
  x, g = _normal(1, (2, 8, 32)), _normal(2, (2, 16, 8))
  # a call-time equation wins over the constructor's, as in nnx.Einsum
  loss = lambda m: jnp.sum(m(x, "btd,dh->bht") * g)
  grads = nnx.jit(nnx.grad(loss, argnums=DIFF))(layer)
  k_ref = np.einsum("btd,bht->dh", _f64(x), _f64(g))
  k_bf16 = np.einsum("btd,bht->dh", _bf16(x), _bf16(g))
  _assert_fp8_error(grads["kernel"][...], k_ref, k_bf16, bound=0.15)
  meta = grads["fp8_meta"].get_value()
  assert float(meta.input.amax_history[0]) == float(jnp.max(jnp.abs(x)))
  assert float(meta.output_grad.amax_history[0]) == float(jnp.max(jnp.abs(g)))


# ------------------------------------------------------------------------- FP8 state

class _MLP(nnx.Module):
  """in -> hidden -> hidden -> out with tanh; `linear` picks FP8 or plain nnx.Linear."""

  def __init__(self, sizes, linear, rngs):
    self.layers = nnx.List([linear(a, b, rngs=rngs) for a, b in zip(sizes[:-1], sizes[1:])])

  def __call__(self, x):
    for layer in self.layers[:-1]:
      x = jnp.tanh(layer(x))
    return self.layers[-1](x)


def test_fp8_state_is_not_a_param_and_optimizer_ignores_it():
  model = _MLP((16, 32, 8), fnnx.Linear, nnx.Rngs(0))
  assert not issubclass(Fp8State, nnx.Param)
  assert len(jax.tree.leaves(nnx.state(model, Fp8State))) == 2 * 6
  x = _normal(1, (8, 16))
  param_grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2)))(model)  # Params only
  assert not jax.tree.leaves(nnx.filter_state(param_grads, Fp8State))
  with pytest.raises(ValueError, match="PARAM_AND_FP8"):
    fnnx.apply_fp8_updates(model, param_grads)

  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  opt_paths = [jax.tree_util.keystr(p) for p, _ in
               jax.tree_util.tree_flatten_with_path(nnx.state(optimizer))[0]]
  assert opt_paths and not any("fp8" in p for p in opt_paths)

  grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=DIFF))(model)
  rest = fnnx.apply_fp8_updates(model, grads)
  assert not jax.tree.leaves(nnx.filter_state(rest, Fp8State))
  before = jax.tree.map(np.asarray, nnx.state(model, Fp8State))
  optimizer.update(model, rest)  # must not touch FP8 state
  after = nnx.state(model, Fp8State)
  jax.tree.map(np.testing.assert_array_equal, before, after)


def test_fp8_state_gradient_is_the_updated_meta():
  lin = fnnx.Linear(32, 16, rngs=nnx.Rngs(0))
  x, g = _normal(1, (8, 32), 3.0), _normal(2, (8, 16), 0.01)
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) * g), argnums=DIFF))(lin)
  meta = grads["fp8_meta"].get_value()
  assert isinstance(meta, fp8jax.Fp8DotMeta)
  for role, amax, fmt_max in ((meta.input, jnp.max(jnp.abs(x)), E4M3_MAX),
                              (meta.kernel, jnp.max(jnp.abs(lin.kernel[...])), E4M3_MAX),
                              (meta.output_grad, jnp.max(jnp.abs(g)), E5M2_MAX)):
    assert float(role.amax_history[0]) == float(amax)
    assert not np.any(role.amax_history[1:])
    np.testing.assert_allclose(role.scale, amax / fmt_max, rtol=1e-6)
  # the forward left the model's state alone; apply_fp8_updates writes the new meta
  assert not np.any(_meta(lin).input.amax_history)
  fnnx.apply_fp8_updates(lin, grads)
  jax.tree.map(np.testing.assert_array_equal, _meta(lin), meta)


@pytest.mark.parametrize("big_first", [False, True])
def test_layer_called_twice_combines_by_max(big_first):
  lin = fnnx.Linear(32, 16, rngs=nnx.Rngs(0))
  x_small, x_big = _normal(1, (8, 32)), _normal(2, (8, 32), 1000.0)
  g_big, g_small = _normal(3, (8, 16), 50.0), _normal(4, (8, 16), 0.02)
  xs = (x_big, x_small) if big_first else (x_small, x_big)
  gs = (g_small, g_big) if big_first else (g_big, g_small)

  def loss(model):
    return jnp.sum(model(xs[0]) * gs[0]) + jnp.sum(model(xs[1]) * gs[1])

  grads = nnx.jit(nnx.grad(loss, argnums=DIFF))(lin)
  meta = grads["fp8_meta"].get_value()
  amax_x = float(jnp.max(jnp.abs(x_big)))
  amax_g = float(jnp.max(jnp.abs(g_big)))
  assert float(meta.input.amax_history[0]) == amax_x          # max, not the sum
  assert float(meta.output_grad.amax_history[0]) == amax_g
  assert float(meta.kernel.amax_history[0]) == float(jnp.max(jnp.abs(lin.kernel[...])))
  for role in meta:
    assert not np.any(role.amax_history[1:]), "one update per step, not one per call"
  np.testing.assert_allclose(meta.input.scale, amax_x / E4M3_MAX, rtol=1e-6)


def test_untouched_layer_keeps_its_state():
  model = _MLP((16, 32, 8), fnnx.Linear, nnx.Rngs(0))
  x = _normal(1, (8, 16))
  step = nnx.jit(lambda m: fnnx.apply_fp8_updates(
      m, nnx.grad(lambda m: jnp.mean(m(x) ** 2), argnums=DIFF)(m)))
  step(model)
  kept = jax.tree.map(np.asarray, _meta(model.layers[1]))
  assert np.all(kept.input.amax_history[:1] > 0)
  nnx.jit(lambda m: fnnx.apply_fp8_updates(m, nnx.grad(
      lambda m: jnp.mean(m.layers[0](x) ** 2), argnums=DIFF)(m)))(model)  # layers[1] unused
  jax.tree.map(np.testing.assert_array_equal, _meta(model.layers[1]), kept)
  assert float(_meta(model.layers[0]).input.amax_history[1]) > 0  # layers[0] pushed again


def test_twice_called_layer_under_remat_combines_by_max():
  lin = fnnx.Linear(32, 16, rngs=nnx.Rngs(0))
  x = _normal(1, (8, 32))

  @nnx.remat
  def apply(m, x):
    return m(x)

  loss = lambda m: jnp.sum(apply(m, 100.0 * x)) + jnp.sum(apply(m, x))
  meta = nnx.jit(nnx.grad(loss, argnums=DIFF))(lin)["fp8_meta"].get_value()
  assert float(meta.input.amax_history[0]) == float(jnp.max(jnp.abs(100.0 * x)))
  assert not np.any(meta.input.amax_history[1:])


# ------------------------------------------------------------------------------- scan

N_LAYERS, WIDTH = 3, 32


class _Block(nnx.Module):
  def __init__(self, rngs):
    self.linear = fnnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


@nnx.split_rngs(splits=N_LAYERS)
@nnx.vmap(in_axes=(0,), out_axes=0)
def _create_blocks(rngs: nnx.Rngs):
  return _Block(rngs)


@nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
def _apply_blocks(x, block):
  y = block(x)
  return y, y


def test_scan_over_stacked_layers_keeps_per_layer_state():
  blocks = _create_blocks(nnx.Rngs(0))
  # very different kernel magnitudes per layer
  k = blocks.linear.kernel
  k[...] = k[...] * jnp.array([1.0, 4.0, 0.25])[:, None, None]
  meta0 = _meta(blocks.linear)
  assert meta0.input.scale.shape == (N_LAYERS,)
  assert meta0.input.amax_history.shape == (N_LAYERS, 16)
  x, g = _normal(1, (8, WIDTH)), _normal(2, (8, WIDTH))

  def loss(blocks, x):
    out, ys = _apply_blocks(x, blocks)
    return jnp.sum(out * g), ys

  @nnx.jit
  def step(blocks, x):
    (_, ys), grads = nnx.value_and_grad(loss, argnums=DIFF, has_aux=True)(blocks, x)
    fnnx.apply_fp8_updates(blocks, grads)
    return ys

  ys = step(blocks, x)
  meta = _meta(blocks.linear)
  layer_in = [x, ys[0], ys[1]]
  for i in range(N_LAYERS):
    assert float(meta.input.amax_history[i, 0]) == float(jnp.max(jnp.abs(layer_in[i])))
    assert float(meta.kernel.amax_history[i, 0]) == float(jnp.max(jnp.abs(k[...][i])))
    assert float(meta.output_grad.amax_history[i, 0]) > 0
  assert len(set(np.asarray(meta.kernel.amax_history[:, 0]).tolist())) == N_LAYERS
  assert len(set(np.asarray(meta.input.amax_history[:, 0]).tolist())) == N_LAYERS
  g_last = g * (1 + ys[-1]) * (1 - ys[-1])  # through the last tanh
  np.testing.assert_allclose(meta.output_grad.amax_history[N_LAYERS - 1, 0],
                             jnp.max(jnp.abs(g_last)), rtol=1e-5)
  # a second step pushes a new amax per layer, delayed scaling uses the stored scales
  first = np.asarray(meta.input.amax_history[:, 0])
  step(blocks, _normal(3, (8, WIDTH), 2.0))
  np.testing.assert_array_equal(_meta(blocks.linear).input.amax_history[:, 1], first)


# --------------------------------------------------------------------------- training

def _train(linear, steps=50, lr=3e-3):
  """Trains a 3-layer MLP on a fixed teacher; returns per-step losses and the model."""
  model = _MLP((16, 64, 64, 4), linear, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
  x = _normal(10, (256, 16))
  teacher = _normal(11, (16, 4)) / 4.0
  y = jnp.sin(2.0 * x @ teacher) + 0.5 * (x[:, :4] ** 2)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=DIFF)(model)
    param_grads = fnnx.apply_fp8_updates(model, grads)
    optimizer.update(model, param_grads)
    return loss

  losses = [float(train_step(model, optimizer, x, y)) for _ in range(steps)]
  return np.array(losses), model


def test_mlp_training_tracks_float32():
  ref_losses, _ = _train(nnx.Linear)
  fp8_losses, model = _train(fnnx.Linear)
  assert np.all(np.isfinite(fp8_losses))
  assert ref_losses[0] == pytest.approx(fp8_losses[0], rel=0.1)
  assert ref_losses[-1] < 0.35 * ref_losses[0], ref_losses
  assert fp8_losses[-1] < 0.35 * fp8_losses[0], fp8_losses
  assert abs(fp8_losses[-1] - ref_losses[-1]) < 0.15 * ref_losses[-1], (fp8_losses, ref_losses)
  # the FP8 path really ran: losses differ from f32, and every history slot is filled
  assert np.max(np.abs(fp8_losses - ref_losses) / ref_losses) > 1e-3
  for layer in model.layers:
    for role in _meta(layer):
      assert np.all(np.asarray(role.amax_history) > 0)
