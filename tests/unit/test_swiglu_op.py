"""SwiGLU inside the FP8 casts: the gated cast kernel (Pallas interpreter on CPU) against its
XLA reference, the reference against float64 on interleaved (gate, up) pairs,
fp8jax.dot.fp8_mlp_chained(activation="swiglu") against two FP8 GEMM calls with the
activation between them, its error against float64 (FP8's, not BF16's), and
fp8jax.linen.dense_mlp on an nn.DenseGeneral((F, 2)) as the models' SwiGLU MLP runs it."""
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from conftest import assert_same_quantized_math, rel_err
from fp8jax import dot, scaling
from fp8jax import linen as fp8_linen
from fp8jax.kernels import cast_transpose as ct

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]
DN = (((2,), (0,)), ((), ()))  # x[B, T, D] . w[D, N]


def _silu64(x):
  return x / (1 + np.exp(-x))


def _pairs(key, shape):
  """bf16 (gate, up) pairs [.., 2F] spread over ~10 binades."""
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, shape) * jnp.exp2(jax.random.uniform(k2, shape, minval=-6, maxval=4))
  return x.astype(jnp.bfloat16)


def _scale(v, fmt):
  """A scale that saturates the largest values of v."""
  amax = float(jnp.max(jnp.abs(v.astype(jnp.float32))))
  return jnp.float32(amax / scaling.fp8_max(fmt) * 0.5)


def _bits(a):
  return np.asarray(a).view(np.uint8)


def test_reference_is_silu_of_the_even_columns_times_the_odd(key):
  """activate / activation_grad against float64 on interleaved pairs: column 2f is the gate of
  hidden unit f, 2f + 1 its up value; the gradient comes back interleaved the same way."""
  kx, kd = jax.random.split(key)
  x = _pairs(kx, (64, 96))
  dy = jax.random.normal(kd, (64, 48)).astype(jnp.bfloat16)
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  g, u = x64[:, 0::2], x64[:, 1::2]
  h = ct.activate(x, "swiglu")
  assert h.shape == (64, 48) and h.dtype == jnp.bfloat16
  assert 0 < rel_err(h, _silu64(g) * u) < 2 ** -8  # bf16's rounding of the exact value
  s = 1 / (1 + np.exp(-g))
  want = np.empty_like(x64)
  want[:, 0::2] = dy64 * u * s * (1 + g * (1 - s))
  want[:, 1::2] = dy64 * _silu64(g)
  grad = ct.activation_grad(dy, x, "swiglu")
  assert grad.shape == x.shape and grad.dtype == jnp.bfloat16
  assert 0 < rel_err(grad, want) < 2 ** -8
  with pytest.raises(ValueError, match="the last axis must be even, got 7"):
    ct.activate(jnp.ones((2, 7), jnp.bfloat16), "swiglu")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,block", [((128, 512), (64, 128)), ((2, 64, 128), (32, 32))])
def test_kernel_matches_xla_reference(key, fmt, shape, block):
  """Forward (the activation cast) and backward (its gradient cast): q bit-identical, q_t its
  transpose, amax identical; the largest values saturate."""
  kx, kd = jax.random.split(key)
  x = _pairs(kx, shape)
  dy = jax.random.normal(kd, shape[:-1] + (shape[-1] // 2,)).astype(jnp.bfloat16)
  kw = dict(interpret=True, block_m=block[0], block_k=block[1], activation="swiglu")
  for args, operand in (((x,), ct.activate(x, "swiglu")),
                        ((dy,), ct.activation_grad(dy, x, "swiglu"))):
    extra = {} if operand.shape[-1] * 2 == shape[-1] else {"activation_input": x}
    scale = _scale(operand, fmt)
    q, qt, amax = ct.cast_transpose_amax(*args, scale, fmt, **kw, **extra)
    rq, _, ramax = ct.cast_transpose_reference(*args, scale, fmt, activation="swiglu", **extra)
    assert q.shape == operand.shape and q.dtype == fmt
    np.testing.assert_array_equal(_bits(q), _bits(rq))
    np.testing.assert_array_equal(_bits(qt), np.swapaxes(_bits(q), -1, -2))
    assert float(amax) == float(ramax) == float(jnp.max(jnp.abs(operand.astype(jnp.float32))))
    assert (np.abs(np.asarray(q, np.float32)) == scaling.fp8_max(fmt)).any()


def test_kernel_keeps_nan(key):
  x = _pairs(key, (64, 256)).at[5, 7].set(jnp.nan)  # the up value of hidden unit 3, row 5
  dy = jax.random.normal(key, (64, 128)).astype(jnp.bfloat16)
  for args, extra in (((x,), {}), ((dy,), {"activation_input": x})):
    q, _, amax = ct.cast_transpose_amax(*args, jnp.float32(0.01), jnp.float8_e4m3fn,
                                        interpret=True, activation="swiglu", **extra)
    assert np.isnan(float(amax))
    nan = np.argwhere(np.isnan(np.asarray(q, np.float32)))
    # forward: h[5, 3]; backward: d gate of unit 3 (d up = dy * silu(gate) stays finite)
    assert nan.tolist() == ([[5, 3]] if not extra else [[5, 6]])


def test_kernel_reason_and_bad_input():
  e4 = jnp.float8_e4m3fn
  with ct.interpret_anywhere():
    assert ct.kernel_reason((128, 512), jnp.bfloat16, e4, activation="swiglu") is None
    assert "reads bf16" in ct.kernel_reason((128, 512), jnp.float32, e4, activation="swiglu")
    assert "hidden width 192 is not a multiple of the block (128)" in ct.kernel_reason(
        (128, 384), jnp.bfloat16, e4, activation="swiglu")
    assert ct.kernel_reason((128, 384), jnp.bfloat16, e4) is None  # not gated: K = 384 is fine
  with pytest.raises(TypeError, match="a gated activation reads bf16 pairs"):
    ct.cast_transpose_amax(jnp.ones((64, 256)), 1.0, e4, interpret=True, activation="swiglu")
  with pytest.raises(ValueError, match=r"cotangent of a gated activation must be \[64, 128\]"):
    ct.cast_transpose_amax(jnp.ones((64, 256), jnp.bfloat16), 1.0, e4, interpret=True,
                           activation="swiglu",
                           activation_input=jnp.ones((64, 256), jnp.bfloat16))


# ------------------------------------------------------------------ the MLP as one op

def _data(key, b=2, t=64, d=128, f=128, n=128):
  kx, k1, k2, kg = jax.random.split(key, 4)
  x = jax.random.normal(kx, (b, t, d)).astype(jnp.bfloat16)
  w_in = (jax.random.normal(k1, (d, 2 * f)) / np.sqrt(d)).astype(jnp.bfloat16)
  w_out = (jax.random.normal(k2, (f, n)) / np.sqrt(f)).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (b, t, n)).astype(jnp.bfloat16)
  return x, w_in, w_out, g


def _op(x, w_in, w_out, m_in, m_out, recipe):
  return dot.fp8_mlp_chained(x, w_in, w_out, m_in, m_out, recipe, "swiglu")[0]


def _two_calls(x, w_in, w_out, m_in, m_out, recipe):
  h = dot.fp8_dot_general_chained(x, w_in, DN, m_in, recipe)[0]
  return dot.fp8_dot_general_chained(ct.activate(h, "swiglu"), w_out, DN, m_out, recipe)[0]


def _grads(fn, x, w_in, w_out, g, m_in, m_out, recipe):
  y, vjp = jax.vjp(lambda *a: fn(*a, recipe), x, w_in, w_out, m_in, m_out)
  return (y, *vjp(g))


@pytest.mark.parametrize("fused", [False, True])
def test_op_matches_two_gemm_calls(key, fused):
  x, w_in, w_out, g = _data(key)
  recipe = fp8jax.Recipe(amax_history_len=4, fused_cast_transpose=fused)
  m_in, m_out = fp8jax.init_dot_meta(recipe), fp8jax.init_dot_meta(recipe)
  with ct.interpret_anywhere(fused):
    run_op = jax.jit(lambda *a: _grads(_op, *a, recipe))
    run_plain = jax.jit(lambda *a: _grads(_two_calls, *a, recipe))
    for step in range(2):  # never-observed metas (just-in-time scales), then delayed scales
      a = run_op(x * (step + 1), w_in, w_out, g, m_in, m_out)
      b = run_plain(x * (step + 1), w_in, w_out, g, m_in, m_out)
      assert_same_quantized_math(a[:4], b[:4], a[4:], b[4:])
      m_in, m_out = b[4], b[5]
    jaxpr = str(jax.make_jaxpr(lambda *a: _grads(_op, *a, recipe))(x, w_in, w_out, g, m_in,
                                                                     m_out))
  # kernels: x, swiglu(h); g_y, swiglu'(h) (g_y w_out^T)
  kernels = sorted(re.findall(r"name=(fp8_cast_transpose_amax\w*)", jaxpr))
  assert kernels == (["fp8_cast_transpose_amax"] * 2 + ["fp8_cast_transpose_amax_swiglu",
                                                        "fp8_cast_transpose_amax_swiglu_grad"]
                     if fused else [])
  assert jaxpr.count("pallas_call") == (4 if fused else 0)


def test_op_error_against_float64_is_fp8s(key):
  x, w_in, w_out, g = _data(key)
  recipe = fp8jax.Recipe(fused_cast_transpose=True)
  m = fp8jax.init_dot_meta(recipe)
  with ct.interpret_anywhere():
    y, dx, dw_in, dw_out = jax.jit(lambda *a: _grads(_op, *a, m, m, recipe))(
        x, w_in, w_out, g)[:4]
  x64, wi, wo, g64 = (np.asarray(a, np.float64) for a in (x, w_in, w_out, g))
  bf = lambda v: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64)  # noqa: E731

  def mlp(x64, wi, wo, g64, r):  # r: rounding of each stored tensor
    h = r(x64 @ wi)
    gate, up = h[..., 0::2], h[..., 1::2]
    a = r(_silu64(gate) * up)
    ga = r(g64 @ wo.T)
    s = 1 / (1 + np.exp(-gate))
    gh = np.empty_like(h)
    gh[..., 0::2], gh[..., 1::2] = ga * up * s * (1 + gate * (1 - s)), ga * _silu64(gate)
    gh = r(gh)
    flat = lambda v: v.reshape(-1, v.shape[-1])  # noqa: E731
    return a @ wo, gh @ wi.T, flat(x64).T @ flat(gh), flat(a).T @ flat(g64)

  refs = mlp(x64, wi, wo, g64, lambda v: v)
  bf16 = mlp(bf(x64), bf(wi), bf(wo), bf(g64), bf)
  for name, got, ref, b16 in zip(("y", "dx", "dw_in", "dw_out"), (y, dx, dw_in, dw_out), refs,
                                 bf16):
    e = rel_err(got, ref)
    assert 3 * rel_err(b16, ref) < e < 0.15, (name, e, rel_err(b16, ref))  # FP8 ran, bounded


def test_op_bad_input():
  x = jnp.ones((4, 16), jnp.bfloat16)
  m = fp8jax.init_dot_meta()
  w_in, w_out = jnp.ones((16, 32), jnp.bfloat16), jnp.ones((32, 8), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"w_in\[D, 2F\] \(gate, up pairs\) -> swiglu"):
    dot.fp8_mlp_chained(x, w_in, w_out, m, m, activation="swiglu")
  with pytest.raises(ValueError, match="lhs_activation='swiglu' is gated"):
    dot.fp8_dot_general_chained(x, w_in, (((1,), (0,)), ((), ())), m, lhs_activation="swiglu")


class _SwiGLU(nn.Module):
  """The models' SwiGLU MLP shape: gate/up as one nn.DenseGeneral((F, 2)), then fc_out; `op`:
  as one op (dense_mlp) where it can."""
  recipe: fp8jax.Recipe
  op: bool = True

  @nn.compact
  def __call__(self, x):
    names = ("fc_gate_in", "fc_out")
    if self.op and fp8_linen.dense_mlp_reason(self, x, names, "swiglu") is None:
      return fp8_linen.dense_mlp(self, x, self.recipe, "swiglu", jnp.bfloat16, names)
    gemm = functools.partial(fp8_linen.Fp8DotGeneral, recipe=self.recipe)
    kw = dict(use_bias=False, dtype=jnp.bfloat16, dot_general_cls=gemm)
    gu = nn.DenseGeneral((128, 2), name="fc_gate_in", **kw)(x)
    return nn.Dense(128, name="fc_out", **kw)(ct.activate(gu.reshape(*gu.shape[:-2], -1),
                                                          "swiglu"))


@pytest.mark.parametrize("fused, cast", [(True, False), (False, True)])
def test_dense_mlp_is_the_dense_layers(key, fused, cast):
  """The one-op path on the [D, F, 2] gate/up kernel gives the Dense layers' output, parameter
  gradients (the gate/up one in its [D, F, 2] layout) and FP8 updates over two steps, also
  with the weights cast outside (cast_weights); only the op path runs the op."""
  x, _, _, g = _data(key)
  recipe = fp8jax.Recipe(amax_history_len=4, fused_cast_transpose=fused)
  op, dense = _SwiGLU(recipe, op=True), _SwiGLU(recipe, op=False)
  variables = op.init(jax.random.key(1), x)
  assert variables["params"]["fc_gate_in"]["kernel"].shape == (128, 128, 2)

  def run(model):
    def step(v, x):
      if cast:
        v = {**v, **fp8_linen.cast_weights(v, recipe, jnp.bfloat16)}
      y, vjp = jax.vjp(lambda v: model.apply(v, x), v)
      return y, vjp(g)[0]
    return jax.jit(step)

  with ct.interpret_anywhere(fused):
    for step in range(2):
      y_op, g_op = run(op)(variables, x * (step + 1))
      y_d, g_d = run(dense)(variables, x * (step + 1))
      assert_same_quantized_math((y_op, g_op["params"]), (y_d, g_d["params"]),
                                 g_op[fp8jax.FP8_COLLECTION], g_d[fp8jax.FP8_COLLECTION])
      variables = fp8jax.apply_fp8_updates(variables, g_d)
    jaxprs = [str(jax.make_jaxpr(lambda v: m.apply(v, x))(variables)) for m in (op, dense)]
  assert [j.count("_fp8_mlp") > 0 for j in jaxprs] == [True, False]


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_models_run_their_swiglu_mlp_as_one_op(key, family, monkeypatch):
  """At an FP8 level the GPT (mlp="swiglu") and LLaMA MLPs run as the one op in every layer
  (at O0 never), and their loss gradients equal the two-Dense path's to FP8's rounding."""
  from fp8jax.models import layers
  from fp8jax.models.gpt import GPT, ModelConfig
  from fp8jax.models.llama import Llama, LlamaConfig
  from fp8jax.train import batch_loss
  shape = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=32,
               scan_layers=False)
  if family == "gpt":
    build, cfg = GPT, ModelConfig(mlp="swiglu", **shape)
  else:
    build, cfg = Llama, LlamaConfig(n_kv_heads=2, **shape)
  tokens = jax.random.randint(key, (2, 33), 0, 64)
  recipe = fp8jax.opt_level("O1").recipe
  model = build(cfg, recipe)
  variables = model.init(jax.random.key(1), tokens[:, :-1])
  count = lambda m, v: str(jax.make_jaxpr(m.apply)(v, tokens[:, :-1])).count(  # noqa: E731
      "_fp8_mlp")
  x, w_in, w_out, _ = _data(key)
  m = fp8jax.init_dot_meta(recipe)
  per_op = str(jax.make_jaxpr(functools.partial(_op, recipe=recipe))(x, w_in, w_out, m, m)
               ).count("_fp8_mlp")
  assert per_op > 0 and count(model, variables) == cfg.n_layers * per_op
  plain = build(cfg, None)
  assert count(plain, plain.init(jax.random.key(1), tokens[:, :-1])) == 0
  grad = lambda: jax.jit(jax.grad(lambda v: batch_loss(model.apply, v, tokens)))(  # noqa
      variables)
  g_op = grad()
  monkeypatch.setattr(layers, "dense_mlp_reason", lambda *a, **k: "the two-Dense path")
  assert count(model, variables) == 0
  g_dense = grad()
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_op["params"])[0],
                          jax.tree.leaves(g_dense["params"]), strict=True):
    assert rel_err(a, b) < 2e-2, (jax.tree_util.keystr(path), rel_err(a, b))
