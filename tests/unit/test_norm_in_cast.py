"""RMSNorm inside the FP8 cast of the next GEMM's input: fp8jax.kernels.cast_transpose.rms_norm
against flax's nn.RMSNorm (the same ops: values and gradients equal up to a rare rounding) and
float64; the cast kernel with ``norm=(rstd, gain)`` (Pallas interpreter on CPU) against its
XLA reference; fp8_dot_general_chained(lhs_norm=...) and fp8_mlp_chained(norm=...) against the
norm applied before the same FP8 GEMMs; the decoders normalizing inside the cast in every
layer."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from conftest import assert_same_quantized_math, rel_err
from fp8jax import dot, scaling
from fp8jax.kernels import cast_transpose as ct

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]
DN = (((2,), (0,)), ((), ()))  # x[B, T, D] . w[D, N]
EPS = 1e-5


def _x(key, shape):
  """bf16 rows of different scales (the norm must undo them)."""
  k1, k2 = jax.random.split(key)
  rows = jnp.exp2(jax.random.uniform(k2, shape[:-1] + (1,), minval=-4, maxval=4))
  return (jax.random.normal(k1, shape) * rows).astype(jnp.bfloat16)


def _gain(key, d):
  return 1 + 0.3 * jax.random.normal(key, (d,))


def _flax_norm(x, gain):
  """The models' unfused norm: nn.RMSNorm in f32, rounded to x's dtype."""
  return nn.RMSNorm(epsilon=EPS, dtype=jnp.float32).apply(
      {"params": {"scale": gain}}, x.astype(jnp.float32)).astype(x.dtype)


def _bits(a):
  return np.asarray(a).view(np.uint8)


@pytest.mark.parametrize("shape", [(64, 256), (2, 32, 128)])
def test_rms_norm_is_flax_rmsnorm(key, shape):
  kx, kg, kd = jax.random.split(key, 3)
  x, gain = _x(kx, shape), _gain(kg, shape[-1])
  dy = jax.random.normal(kd, shape).astype(jnp.bfloat16)
  run = lambda f: jax.jit(lambda x, g, dy: (f(x, g),) + jax.vjp(f, x, g)[1](dy))(  # noqa: E731
      x, gain, dy)
  ours, theirs = run(lambda x, g: ct.rms_norm(x, g, EPS)), run(_flax_norm)
  for a, b in zip(ours, theirs, strict=True):
    _equal_but_a_rare_step(a, b)
  x64, g64 = np.asarray(x, np.float64), np.asarray(gain, np.float64)
  want = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + EPS) * g64
  assert 0 < rel_err(ours[0], want) < 2 ** -8  # bf16's rounding of the exact value
  rstd = ct.rms_norm_rstd(x, EPS)
  assert rstd.shape == shape[:-1] and rstd.dtype == jnp.float32
  _equal_but_a_rare_step(ct.rms_norm_apply(x, rstd, gain), ours[0])


def _equal_but_a_rare_step(a, b):
  """The same ops compiled apart: XLA may sum a row in another order, so a rare element
  rounds one bf16 step apart."""
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert np.mean(a != b) < 1e-3
  np.testing.assert_allclose(a, b, rtol=2 ** -7)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(128, 256), (2, 64, 128)])
def test_kernel_matches_xla_reference(key, fmt, shape):
  kx, kg = jax.random.split(key)
  x, gain = _x(kx, shape), _gain(kg, shape[-1])
  norm = (ct.rms_norm_rstd(x, EPS), gain)
  normed = ct.rms_norm(x, gain, EPS)
  amax = float(jnp.max(jnp.abs(normed.astype(jnp.float32))))
  scale = jnp.float32(amax / scaling.fp8_max(fmt) * 0.5)  # the largest values saturate
  q, qt, a = ct.cast_transpose_amax(x, scale, fmt, interpret=True, block_m=32, block_k=64,
                                    norm=norm)
  rq, rqt, ra = ct.cast_transpose_reference(x, scale, fmt, norm=norm)
  np.testing.assert_array_equal(_bits(q), _bits(rq))
  np.testing.assert_array_equal(_bits(qt), _bits(rqt))
  assert float(a) == float(ra) == amax
  # ... and the reference is the plain cast of the normed tensor.
  np.testing.assert_array_equal(_bits(q), _bits(scaling.quantize(normed, scale, fmt)))
  assert (np.abs(np.asarray(q, np.float32)) == scaling.fp8_max(fmt)).any()


def test_kernel_bad_input(key):
  x = _x(key, (64, 128))
  rstd, gain = ct.rms_norm_rstd(x, EPS), jnp.ones(128)
  cast = functools.partial(ct.cast_transpose_amax, scale=jnp.float32(1), fmt=jnp.float8_e4m3fn,
                           interpret=True, block_m=32, block_k=64)
  with pytest.raises(ValueError, match=r"must be shaped \[64\] and \[128\]"):
    cast(x, norm=(rstd[:32], gain))
  with pytest.raises(ValueError, match=r"must be shaped \[64\] and \[128\]"):
    cast(x, norm=(rstd, gain[:64]))
  with pytest.raises(ValueError, match="norm is applied alone"):
    cast(x, norm=(rstd, gain), activation="gelu")
  with pytest.raises(ValueError, match="norm is applied alone"):
    ct.cast_operand(x, "gelu", norm=(rstd, gain))


def _data(key, d=128, n=256):
  kx, kg, kw, kd = jax.random.split(key, 4)
  x = _x(kx, (2, 32, d))
  w = (jax.random.normal(kw, (d, n)) * d ** -0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(kd, (2, 32, n)).astype(jnp.bfloat16)
  return x, _gain(kg, d), w, dy


def _with_grads(f, args, dy):
  return jax.jit(lambda *a: (f(*a),) + jax.vjp(f, *a)[1](dy))(*args)


@pytest.mark.parametrize("fused", [False, True])
def test_dot_with_lhs_norm_is_the_norm_then_the_gemm(key, fused):
  """The values and gradients (x, gain, w) of rms_norm followed by the same FP8 GEMM (up to a
  rare flipped rounding), with XLA's casts and with the kernel; the output's error against
  float64 is FP8's."""
  x, gain, w, dy = _data(key)
  recipe = fp8jax.Recipe(fused_cast_transpose=fused)
  meta = fp8jax.init_dot_meta(recipe)
  op = lambda x, g, w: dot.fp8_dot_general_chained(  # noqa: E731
      x, w, DN, meta, recipe, lhs_norm=(g, EPS))[0]
  ref = lambda x, g, w: dot.fp8_dot_general_chained(  # noqa: E731
      ct.rms_norm(x, g, EPS), w, DN, meta, recipe)[0]
  with ct.interpret_anywhere(fused):
    got, want = _with_grads(op, (x, gain, w), dy), _with_grads(ref, (x, gain, w), dy)
    jaxpr = str(jax.make_jaxpr(op)(x, gain, w))
  assert_same_quantized_math(got, want)  # (two programs: a rare rounding may flip)
  assert jaxpr.count("pallas_call") == (1 if fused else 0)  # the forward's one cast: x's
  x64, g64, w64 = (np.asarray(a, np.float64) for a in (x, gain, w))
  y64 = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + EPS) * g64 @ w64
  bf16 = rel_err(np.einsum("btd,dn->btn", np.asarray(_flax_norm(x, gain), np.float32),
                           np.asarray(w, np.float32)), y64)
  assert 3 * bf16 < rel_err(got[0], y64) < 0.1


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_mlp_op_with_norm_is_the_norm_then_the_op(key, activation):
  x, gain, w_in, _ = _data(key)
  f = 128 if activation == "swiglu" else 256
  w_out = (jax.random.normal(jax.random.key(3), (f, 64)) * f ** -0.5).astype(jnp.bfloat16)
  dy = jax.random.normal(jax.random.key(4), (2, 32, 64)).astype(jnp.bfloat16)
  recipe = fp8jax.Recipe(fused_cast_transpose=True)
  m = fp8jax.init_dot_meta(recipe)
  op = lambda x, g, a, b: dot.fp8_mlp_chained(  # noqa: E731
      x, a, b, m, m, recipe, activation, norm=(g, EPS))[0]
  ref = lambda x, g, a, b: dot.fp8_mlp_chained(  # noqa: E731
      ct.rms_norm(x, g, EPS), a, b, m, m, recipe, activation)[0]
  with ct.interpret_anywhere():
    got = _with_grads(op, (x, gain, w_in, w_out), dy)
    want = _with_grads(ref, (x, gain, w_in, w_out), dy)
  assert_same_quantized_math(got, want)
  assert np.any(np.asarray(got[2], np.float32) != 0)  # gain's gradient is not zero


def test_lhs_norm_bad_input(key):
  x, gain, w, _ = _data(key)
  meta = fp8jax.init_dot_meta()
  call = functools.partial(dot.fp8_dot_general_chained, x, w, DN, meta)
  with pytest.raises(ValueError, match=r"gain must be a float \[128\]"):
    call(lhs_norm=(gain[:64], EPS))
  with pytest.raises(ValueError, match="eps must be > 0"):
    call(lhs_norm=(gain, 0.0))
  with pytest.raises(TypeError, match=r"lhs_norm must be \(gain, eps\)"):
    call(lhs_norm=gain)
  with pytest.raises(ValueError, match="lhs_norm with lhs_activation is not supported"):
    call(lhs_norm=(gain, EPS), lhs_activation="gelu")
  with pytest.raises(ValueError, match="last axis, which must be its one contracting axis"):
    dot.fp8_dot_general_chained(x, w[:32, :32], (((1,), (0,)), ((), ())), meta,
                                lhs_norm=(gain, EPS))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_models_normalize_inside_the_cast(key, family, monkeypatch):
  """At an FP8 level GPT (rmsnorm) and LLaMA normalize inside both GEMM casts of every layer
  (the final norm stays), never at O0 or with LayerNorm; the parameters are the same and the
  loss gradients equal those of the norm applied first. In f32 compute: in bf16, XLA may feed
  the unrounded f32 sum of the residual add into a norm it fuses with (excess precision), so
  the two programs' FP8 roundings flip apart; in f32 they agree but for a rare FP8 rounding
  flipped by XLA's summation order (one seed: 0.5% on the embedding's gradient; a gain
  applied wrongly moves the gradients by far more)."""
  from fp8jax.models import layers
  from fp8jax.models.gpt import GPT, ModelConfig
  from fp8jax.models.llama import Llama, LlamaConfig
  from fp8jax.train import batch_loss
  shape = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=32,
               scan_layers=False)
  if family == "gpt":
    build, cfg = GPT, ModelConfig(dtype="float32", **shape)
  else:
    build, cfg = Llama, LlamaConfig(n_kv_heads=2, dtype="float32", **shape)
  tokens = jax.random.randint(key, (2, 33), 0, 64)
  calls = []
  rstd = ct.rms_norm_rstd
  monkeypatch.setattr(ct, "rms_norm_rstd", lambda *a: calls.append(1) or rstd(*a))

  def count(model, variables):
    calls.clear()
    jax.make_jaxpr(model.apply)(variables, tokens[:, :-1])
    return len(calls)
  model = build(cfg, fp8jax.opt_level("O1").recipe)
  variables = model.init(jax.random.key(1), tokens[:, :-1])
  assert "scale" in variables["params"]["layers"]["norm_attn"]
  assert count(model, variables) == 2 * cfg.n_layers
  plain = build(cfg, None)
  assert count(plain, plain.init(jax.random.key(1), tokens[:, :-1])) == 0
  if family == "gpt":
    ln = build(cfg.replace(norm="layernorm"), fp8jax.opt_level("O1").recipe)
    assert count(ln, ln.init(jax.random.key(1), tokens[:, :-1])) == 0
  # A gain that is not all ones, so a gain applied twice or not at all shows.
  variables = jax.tree_util.tree_map_with_path(
      lambda p, v: v * (1 + 0.3 * jax.random.normal(jax.random.key(5), v.shape))
      if "norm" in jax.tree_util.keystr(p) else v, variables)
  grad = lambda: jax.jit(jax.grad(lambda v: batch_loss(model.apply, v, tokens)))(  # noqa
      variables)
  g_fused = grad()
  monkeypatch.setattr(layers, "norm_in_cast", lambda *a, **k: None)
  assert count(model, variables) == 0
  g_first = grad()
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g_fused["params"])[0],
                          jax.tree.leaves(g_first["params"]), strict=True):
    assert rel_err(a, b) < 2e-2, (jax.tree_util.keystr(path), rel_err(a, b))
