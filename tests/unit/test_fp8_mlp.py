"""fp8jax.dot.fp8_mlp_chained: an MLP's two FP8 GEMMs in one differentiated op, the GELU
inside the second GEMM's input cast and its derivative inside the cast of the gradient that
enters the first. Checked against two fp8_dot_general_chained calls (the same quantized
math), against float64 (FP8's error, not BF16's), under remat, and for bad input; and
fp8jax.linen.dense_mlp, which runs two Flax Dense layers' variables through it."""
import contextlib
import functools
import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from conftest import assert_same_quantized_math, rel_err
from fp8jax import dot
from fp8jax import linen as fp8_linen
from jax.sharding import PartitionSpec as P
from fp8jax.kernels import cast_transpose as ct

DN = (((2,), (0,)), ((), ()))  # x[B, T, D] . w[D, F], as nn.Dense calls it


def _gelu64(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _data(key, b=2, t=64, d=128, f=256, n=128):
  kx, k1, k2, kg = jax.random.split(key, 4)
  x = jax.random.normal(kx, (b, t, d)).astype(jnp.bfloat16)
  w_in = (jax.random.normal(k1, (d, f)) / np.sqrt(d)).astype(jnp.bfloat16)
  w_out = (jax.random.normal(k2, (f, n)) / np.sqrt(f)).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (b, t, n)).astype(jnp.bfloat16)
  return x, w_in, w_out, g


def _fused(x, w_in, w_out, m_in, m_out, recipe):
  return dot.fp8_mlp_chained(x, w_in, w_out, m_in, m_out, recipe)[0]


def _two_calls(x, w_in, w_out, m_in, m_out, recipe):
  h = dot.fp8_dot_general_chained(x, w_in, DN, m_in, recipe)[0]
  return dot.fp8_dot_general_chained(h, w_out, DN, m_out, recipe, lhs_activation="gelu")[0]


def _grads(fn, x, w_in, w_out, g, m_in, m_out, recipe):
  """(y, dx, dw_in, dw_out, new meta_in, new meta_out)."""
  y, vjp = jax.vjp(lambda *a: fn(*a, recipe), x, w_in, w_out, m_in, m_out)
  return (y, *vjp(g))


@pytest.mark.parametrize("fused", [False, True])
def test_matches_two_gemm_calls(key, fused):
  x, w_in, w_out, g = _data(key)
  recipe = fp8jax.Recipe(amax_history_len=4, fused_cast_transpose=fused)
  m_in, m_out = fp8jax.init_dot_meta(recipe), fp8jax.init_dot_meta(recipe)
  with ct.interpret_anywhere(fused):
    run_fused = jax.jit(lambda *a: _grads(_fused, *a, recipe))
    run_plain = jax.jit(lambda *a: _grads(_two_calls, *a, recipe))
    for step in range(2):  # never-observed metas (just-in-time scales), then delayed scales
      a = run_fused(x * (step + 1), w_in, w_out, g, m_in, m_out)
      b = run_plain(x * (step + 1), w_in, w_out, g, m_in, m_out)
      # Same quantized math; XLA and the kernel may contract the derivative's f32
      # arithmetic differently, which moves a rare rounding of the E5M2 gradient.
      assert_same_quantized_math(a[:4], b[:4], a[4:], b[4:])
      m_in, m_out = b[4], b[5]
  with ct.interpret_anywhere(fused):  # kernels: x, GELU(h); g_y, GELU'(h) * (g_y w_out^T)
    jaxpr = str(jax.make_jaxpr(lambda *a: _grads(_fused, *a, recipe))(x, w_in, w_out, g, m_in,
                                                                        m_out))
  assert jaxpr.count("pallas_call") == (4 if fused else 0)


def test_error_against_float64_is_fp8s(key):
  x, w_in, w_out, g = _data(key)
  recipe = fp8jax.Recipe(fused_cast_transpose=True)
  m = fp8jax.init_dot_meta(recipe)
  with ct.interpret_anywhere():
    y, dx, dw_in, dw_out = jax.jit(lambda *a: _grads(_fused, *a, m, m, recipe))(
        x, w_in, w_out, g)[:4]
  x64, wi, wo, g64 = (np.asarray(a, np.float64) for a in (x, w_in, w_out, g))
  h = x64 @ wi
  a = _gelu64(h)
  eps = 1e-4
  dgelu = (_gelu64(h + eps) - _gelu64(h - eps)) / (2 * eps)
  gh = (g64 @ wo.T) * dgelu
  refs = (a @ wo, gh @ wi.T, x64.reshape(-1, x64.shape[-1]).T @ gh.reshape(-1, gh.shape[-1]),
          a.reshape(-1, a.shape[-1]).T @ g64.reshape(-1, g64.shape[-1]))
  bf = lambda v: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64)  # noqa: E731
  hb = bf(bf(x64) @ bf(wi))
  ab = bf(_gelu64(hb))
  ghb = bf(bf(bf(g64) @ bf(wo).T) * dgelu)
  bf16 = (ab @ bf(wo), ghb @ bf(wi).T,
          bf(x64).reshape(-1, x64.shape[-1]).T @ ghb.reshape(-1, ghb.shape[-1]),
          ab.reshape(-1, ab.shape[-1]).T @ bf(g64).reshape(-1, g64.shape[-1]))
  for name, got, ref, b16 in zip(("y", "dx", "dw_in", "dw_out"), (y, dx, dw_in, dw_out), refs,
                                 bf16):
    e = rel_err(got, ref)
    assert 3 * rel_err(b16, ref) < e < 0.15, (name, e, rel_err(b16, ref))  # FP8 ran, bounded


def test_remat_saves_the_hidden_state_and_keeps_the_results(key):
  """Under jax.checkpoint saving GEMM outputs and input casts the hidden pre-activation is a
  saved residual (tagged GEMM_OUTPUT_NAME inside the op), and the op gives the same values as
  without remat."""
  x, w_in, w_out, g = _data(key, t=32)
  recipe = fp8jax.Recipe()
  m = fp8jax.init_dot_meta(recipe)
  policy = jax.checkpoint_policies.save_only_these_names(
      dot.GEMM_OUTPUT_NAME, dot.INPUT_CAST_NAME, dot.WEIGHT_CAST_NAME)
  rematted = jax.checkpoint(lambda *a: _fused(*a, recipe), policy=policy)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(
        lambda *a: jnp.sum(rematted(*a, m, m).astype(jnp.float32)), x, w_in, w_out)
  # [B * T, F]: the op works on the flattened rows
  assert f"bf16[64,256] named '{dot.GEMM_OUTPUT_NAME}'" in out.getvalue(), out.getvalue()
  a = jax.jit(lambda *v: _grads(lambda *u: rematted(*u[:-1]), *v, m, m, recipe))(
      x, w_in, w_out, g)
  b = jax.jit(lambda *v: _grads(_fused, *v, m, m, recipe))(x, w_in, w_out, g)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
    np.testing.assert_allclose(u, v, rtol=1e-2, atol=1e-2 * float(np.max(np.abs(v))))


def test_weights_cast_outside(key):
  """weight_cast_in / weight_cast_out (cast_weight of each weight) give bit-identical results,
  and the op multiplies those casts (a cast of other weights changes y; the weights' own
  gradients are unchanged by what was cast)."""
  x, w_in, w_out, g = _data(key)
  recipe = fp8jax.Recipe(amax_history_len=4)
  m_in, m_out = fp8jax.init_dot_meta(recipe), fp8jax.init_dot_meta(recipe)
  run = jax.jit(lambda x, w_in, w_out, m_in, m_out, c_in, c_out: _grads(
      lambda *a: dot.fp8_mlp_chained(*a[:5], a[5], weight_cast_in=c_in,
                                     weight_cast_out=c_out)[0],
      x, w_in, w_out, g, m_in, m_out, recipe))
  plain = jax.jit(lambda *a: _grads(_fused, *a, recipe))(x, w_in, w_out, g, m_in, m_out)
  c_in = dot.cast_weight(w_in, m_in.kernel, recipe)
  c_out = dot.cast_weight(w_out, m_out.kernel, recipe)
  cast = run(x, w_in, w_out, m_in, m_out, c_in, c_out)
  for u, v in zip(jax.tree.leaves(plain), jax.tree.leaves(cast), strict=True):
    np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
  other = dot.cast_weight(-w_out, m_out.kernel, recipe)
  y = run(x, w_in, w_out, m_in, m_out, c_in, other)[0]
  assert rel_err(y, -np.asarray(plain[0], np.float32)) < 1e-6  # -w_out's cast was multiplied
  with pytest.raises(ValueError, match=r"weight_cast.q is float8_e4m3fn\[128, 256\]"):
    dot.fp8_mlp_chained(x, w_in, w_out, m_in, m_out, weight_cast_out=c_in)


def test_bad_input():
  x = jnp.ones((4, 16), jnp.bfloat16)
  w_in, w_out = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 8), jnp.bfloat16)
  m = fp8jax.init_dot_meta()
  with pytest.raises(ValueError, match="activation=None is not allowed"):
    dot.fp8_mlp_chained(x, w_in, w_out, m, m, activation=None)
  with pytest.raises(ValueError, match=r"activation='relu' is not allowed"):
    dot.fp8_mlp_chained(x, w_in, w_out, m, m, activation="relu")
  with pytest.raises(ValueError, match=r"do not chain as x\[..., D\] @ w_in\[D, F\]"):
    dot.fp8_mlp_chained(x, w_out, w_in, m, m)
  with pytest.raises(TypeError, match="meta_out must be an Fp8DotMeta"):
    dot.fp8_mlp_chained(x, w_in, w_out, m, m.input)
  with pytest.raises(TypeError, match="x must be a float array"):
    dot.fp8_mlp_chained(jnp.ones((4, 16), jnp.int32), w_in, w_out, m, m)


# ----------------------------------------------------------------- fp8jax.linen.dense_mlp

class _Mlp(nn.Module):
  """Two bias-free FP8 Dense layers with the GELU inside fc_out's input cast; `op`: run them
  as one op (fp8jax.linen.dense_mlp) where it can. `probe`: return dense_mlp_reason."""
  recipe: fp8jax.Recipe
  op: bool = True
  probe: bool = False
  gemm: str = "fp8"
  bias: bool = False
  force: bool = False

  @nn.compact
  def __call__(self, x):
    if self.probe and not self.is_initializing():
      return fp8_linen.dense_mlp_reason(self, x)
    if self.force:
      return fp8_linen.dense_mlp(self, x, self.recipe)
    if self.op and fp8_linen.dense_mlp_reason(self, x) is None:
      return fp8_linen.dense_mlp(self, x, self.recipe, "gelu", jnp.bfloat16)
    kw = dict(use_bias=self.bias, dtype=jnp.bfloat16)
    if self.gemm == "fp8":
      gemm = functools.partial(fp8_linen.Fp8DotGeneral, recipe=self.recipe)
      h = nn.Dense(256, name="fc_in", dot_general_cls=gemm, **kw)(x)
      return nn.Dense(128, name="fc_out", **kw,
                      dot_general_cls=functools.partial(gemm, lhs_activation="gelu"))(h)
    return nn.Dense(128, name="fc_out", **kw)(nn.gelu(nn.Dense(256, name="fc_in", **kw)(x)))


class _Twice(nn.Module):
  """The same MLP applied twice in one apply (its FP8 updates must chain: max, not sum)."""
  recipe: fp8jax.Recipe
  op: bool = True

  @nn.compact
  def __call__(self, x):
    mlp = _Mlp(self.recipe, self.op, name="mlp")
    return mlp(mlp(x) + x)


@pytest.mark.parametrize("fused, cast", [(False, False), (True, False), (False, True)])
def test_dense_mlp_is_the_dense_layers(key, fused, cast):
  """The one-op path gives the Dense layers' output, parameter gradients and FP8 updates (the
  same quantized math up to a rare E5M2 rounding, as above), over two steps of a layer
  applied twice per apply, also with the weights cast outside (`cast`: cast_weights, as the
  Trainer does with several microbatches); it runs as one op (the Dense path never does)."""
  x, _, _, g = _data(key)
  recipe = fp8jax.Recipe(amax_history_len=4, fused_cast_transpose=fused)
  op, dense = _Twice(recipe, op=True), _Twice(recipe, op=False)
  variables = op.init(jax.random.key(1), x)
  assert jax.tree.structure(variables) == jax.tree.structure(dense.init(jax.random.key(1), x))

  def run(model):
    def step(v, x):
      if cast:
        v = {**v, **fp8_linen.cast_weights(v, recipe, jnp.bfloat16)}
      y, vjp = jax.vjp(lambda v: model.apply(v, x), v)
      return y, vjp(g)[0]
    return jax.jit(step)

  with ct.interpret_anywhere(fused):
    for step in range(2):  # never-observed metas (just-in-time scales), then delayed scales
      y_op, g_op = run(op)(variables, x * (step + 1))
      y_d, g_d = run(dense)(variables, x * (step + 1))
      assert_same_quantized_math((y_op, g_op["params"]), (y_d, g_d["params"]),
                                 g_op[fp8jax.FP8_COLLECTION], g_d[fp8jax.FP8_COLLECTION])
      variables = fp8jax.apply_fp8_updates(variables, g_d)
    if cast:
      variables = {**variables, **fp8_linen.cast_weights(variables, recipe, jnp.bfloat16)}
    jaxprs = [str(jax.make_jaxpr(lambda v: m.apply(v, x))(variables)) for m in (op, dense)]
  assert [j.count("_fp8_mlp") > 0 for j in jaxprs] == [True, False]


def test_dense_mlp_multiplies_the_weight_casts_it_finds(key):
  """With a WEIGHT_CAST_COLLECTION present, the op multiplies those casts, as the Dense
  layers do: casts of a negated fc_out kernel negate the output on both paths."""
  x = jax.random.normal(key, (2, 8, 128)).astype(jnp.bfloat16)
  recipe = fp8jax.Recipe()
  op, dense = _Mlp(recipe, op=True), _Mlp(recipe, op=False)
  variables = op.init(jax.random.key(0), x)
  params = variables["params"]
  flipped = {**params, "fc_out": {"kernel": -params["fc_out"]["kernel"]}}
  casts = fp8_linen.cast_weights({**variables, "params": flipped}, recipe, jnp.bfloat16)
  y = op.apply(variables, x)
  assert float(jnp.max(jnp.abs(y.astype(jnp.float32)))) > 0
  for model in (op, dense):
    np.testing.assert_array_equal(np.asarray(model.apply({**variables, **casts}, x), np.float32),
                                  -np.asarray(model.apply(variables, x), np.float32))


def test_dense_mlp_reason_and_refusal(key):
  """Where the one op cannot run, dense_mlp_reason says why (the layers then run as Dense
  layers) and dense_mlp refuses."""
  x = jax.random.normal(key, (2, 8, 128)).astype(jnp.bfloat16)
  recipe = fp8jax.Recipe()
  probe = _Mlp(recipe, probe=True)
  variables = probe.init(jax.random.key(0), x)
  assert probe.apply(variables, x) is None
  reason = lambda **kw: _Mlp(recipe, probe=True, **kw).apply(
      _Mlp(recipe, **kw).init(jax.random.key(0), x), x)
  assert "not a bias-free nn.Dense" in reason(bias=True)
  assert "no Fp8DotGeneral_0 FP8 state" in reason(gemm="bf16")
  assert "health probe" in probe.apply(variables, x, mutable=[fp8_linen.HEALTH_COLLECTION])[0]
  taps = {fp8_linen.PERTURBATIONS: {"fc_in": {"output_grad_health": jnp.zeros(2)}}}
  assert "health probe" in probe.apply({**variables, **taps}, x)  # a probe's taps given
  seen = []
  mesh = jax.make_mesh((jax.device_count(),), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))

  def body(x):
    seen.append(probe.apply(variables, x))
    return x
  jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"))(
      jnp.tile(x, (jax.device_count(), 1, 1)))
  assert seen and seen[0].startswith("inside shard_map")
  with pytest.raises(ValueError, match=r"dense_mlp of .*: initializing"):
    _Mlp(recipe, force=True).init(jax.random.key(0), x)
