"""GELU inside the FP8 cast (lhs_activation="gelu", model.fuse_gelu_into_fp8_cast): the fused
kernel casts GELU(x) without storing it; the GEMM and its gradients equal the unfused ones,
track a float64 reference at FP8's (not BF16's) error, and the model trains the same."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from conftest import rel_err
from fp8jax import dot
from fp8jax.config import load_config
from fp8jax.kernels import cast_transpose as ct
from fp8jax.models import GPT, ModelConfig, init_model, layers
from fp8jax.models.llama import LlamaConfig
from fp8jax.train import batch_loss

E4M3 = jnp.float8_e4m3fn
DN = (((1,), (0,)), ((), ()))


def _gelu64(x):
  x = np.asarray(x, np.float64)
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def test_kernel_casts_the_activation(key):
  x = (2 * jax.random.normal(key, (128, 256))).astype(jnp.bfloat16)
  scale = jnp.float32(0.02)
  got = ct.cast_transpose_amax(x, scale, E4M3, interpret=True, activation="gelu")
  ref = ct.cast_transpose_reference(x, scale, E4M3, "gelu")
  for a, b in zip(got, ref, strict=True):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(got[0], np.float32).T)
  assert float(got[2]) == pytest.approx(float(np.max(np.abs(_gelu64(x)))), rel=1e-2)
  err = rel_err(np.asarray(got[0], np.float32) * 0.02, _gelu64(x))
  assert 5e-3 < err < 0.06, err  # E4M3 rounding (BF16 alone: ~2e-3)
  with pytest.raises(ValueError,
                     match=r"activation='relu' is not allowed; use one of \['gelu', 'swiglu'\]"):
    ct.cast_transpose_amax(x, scale, E4M3, interpret=True, activation="relu")


def _e5m2_steps(a, b):
  """|a - b| in units of the E5M2 spacing at max(|a|, |b|) (2**(e - 2); subnormals 2**-16)."""
  m = np.maximum(np.abs(a), np.abs(b))
  spacing = np.exp2(np.maximum(np.floor(np.log2(np.where(m > 0, m, 1.0))), -14.0) - 2.0)
  return np.abs(a - b) / spacing


def test_kernel_casts_the_activations_gradient(key):
  """With activation_input the kernel casts dy * gelu'(x) (the gradient entering an MLP's first
  GEMM): q_t is q transposed, q is the XLA reference's up to a rare one-step rounding (the
  derivative's f32 arithmetic may contract differently), and its error against float64 is
  E5M2's."""
  k1, k2 = jax.random.split(key)
  dy = jax.random.normal(k1, (128, 256)).astype(jnp.bfloat16)
  x = (2 * jax.random.normal(k2, (128, 256))).astype(jnp.bfloat16)
  scale = jnp.float32(2.0 ** -10)
  e5m2 = jnp.float8_e5m2
  q, q_t, amax = ct.cast_transpose_amax(dy, scale, e5m2, interpret=True, activation="gelu",
                                        activation_input=x)
  rq, _, ramax = ct.cast_transpose_reference(dy, scale, e5m2, "gelu", x)
  q32, rq32 = np.asarray(q, np.float32), np.asarray(rq, np.float32)
  np.testing.assert_array_equal(np.asarray(q_t, np.float32), q32.T)
  # Where GELU's derivative nearly vanishes (x < -4) its two terms cancel in f32 and a
  # different contraction moves the tiny result by more: judged absolutely there.
  big = np.maximum(np.abs(q32), np.abs(rq32)) > 1e-3 * np.max(np.abs(rq32))
  steps = _e5m2_steps(q32, rq32)
  assert np.max(steps[big]) <= 1.0 and np.mean(steps > 0) < 2e-2, (np.max(steps[big]),
                                                                    np.mean(steps > 0))
  assert np.max(np.abs(q32 - rq32)[~big]) <= 1e-3 * np.max(np.abs(rq32))
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  eps = 1e-4
  exact = dy64 * (_gelu64(x64 + eps) - _gelu64(x64 - eps)) / (2 * eps)
  assert float(amax) == pytest.approx(float(np.max(np.abs(exact))), rel=1e-2)
  assert float(amax) == pytest.approx(float(ramax), rel=1e-2)
  err = rel_err(q32 * float(scale), exact)
  assert 3e-2 < err < 0.15, err  # E5M2 rounding (BF16 alone: ~3e-3)
  same = ct.cast_transpose_amax(dy[None], scale, e5m2, interpret=True, activation="gelu",
                                activation_input=x[None])
  np.testing.assert_array_equal(np.asarray(same[0][0], np.float32), q32)  # [B, M, K] too
  with pytest.raises(ValueError, match="activation_input needs an activation and x's shape"):
    ct.cast_transpose_amax(dy, scale, e5m2, interpret=True, activation_input=x)
  with pytest.raises(ValueError, match="activation_input needs an activation and x's shape"):
    ct.cast_transpose_amax(dy, scale, e5m2, interpret=True, activation="gelu",
                           activation_input=x[:64])


@pytest.mark.parametrize("fused", [False, True])
def test_dot_with_gelu_matches_unfused_and_float64(key, fused):
  kx, kw, kg = jax.random.split(key, 3)
  x = (2 * jax.random.normal(kx, (128, 256))).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (256, 128)) / 16).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (128, 128)).astype(jnp.bfloat16)
  recipe = fp8jax.O1.recipe.replace(fused_cast_transpose=fused)
  meta = fp8jax.init_dot_meta(recipe)

  def run(act):
    def f(x, w):
      if act:
        return dot.fp8_dot_general_chained(x, w, DN, meta, recipe, lhs_activation="gelu")[0]
      return fp8jax.fp8_dot_general(ct.activate(x, "gelu"), w, DN, meta, recipe)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(g))

  with ct.interpret_anywhere(fused):
    fused_out, plain = jax.jit(lambda: run(True))(), jax.jit(lambda: run(False))()
  # Same quantized math. Not bit for bit: XLA may fuse GELU into the next op without rounding
  # it to bf16 first (excess precision), which moves a rare E4M3 rounding or bf16 step.
  for a, b in zip(fused_out, plain, strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert np.mean(a != b) < 1e-3
    np.testing.assert_allclose(a, b, rtol=1e-2, atol=1e-2 * float(np.max(np.abs(b))))
  # Against float64: y = gelu(x) w, dx = (g w^T) gelu'(x), dw = gelu(x)^T g.
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  a64 = _gelu64(x64)
  eps = 1e-4
  dgelu = (_gelu64(x64 + eps) - _gelu64(x64 - eps)) / (2 * eps)
  refs = (a64 @ w64, (g64 @ w64.T) * dgelu, a64.T @ g64)
  for name, got, ref in zip(("y", "dx", "dw"), fused_out, refs):
    err = rel_err(got, ref)
    assert 5e-3 < err < 0.1, (name, err)  # FP8 error, clearly above BF16's ~3e-3


def test_model_with_fused_gelu_is_as_accurate_as_the_unfused_model(key):
  """The O1 model's whole gradient with and without the fused GELU against the same model in
  f32: the same (FP8) error level (ratio 0.96-1.02 over 10 seeds). The two FP8 runs differ from
  each other about as much as each differs from f32 (E5M2 roundings flip), so the reference,
  not each other, is the yardstick."""
  cfg = ModelConfig(d_model=64, n_layers=2, n_heads=2, d_ff=256, max_seq_len=64, remat=True)
  k1, k2 = jax.random.split(key)
  variables = init_model(cfg, fp8jax.O1.recipe, k1, 4, 32)
  batch = jax.random.randint(k2, (4, 33), 0, 256)

  def grads(config, recipe, v):
    model = GPT(config, recipe)
    loss = lambda v: batch_loss(model.apply, v, batch)
    g = jax.jit(jax.grad(loss))(v)["params"]
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in jax.tree.leaves(g)])

  params_only = {"params": variables["params"]}
  ref = grads(cfg.replace(dtype="float32"), None, params_only)
  e_bf16, e_unfused, e_fused = (rel_err(g, ref) for g in (
      grads(cfg, None, params_only),
      *(grads(cfg.replace(fuse_gelu_into_fp8_cast=f), fp8jax.O1.recipe, variables)
        for f in (False, True))))
  print(f"gradient error vs f32: bf16 {e_bf16:.4f} unfused {e_unfused:.4f} fused {e_fused:.4f}")
  assert e_fused < 1.15 * e_unfused
  assert 3 * e_bf16 < e_fused < 0.3  # FP8 ran, and stays bounded


def test_auto_fuses_the_gelu_mlp_only():
  assert ModelConfig().fuse_gelu_into_fp8_cast == "auto"
  assert layers.fuses_gelu(ModelConfig(mlp="gelu"))
  assert not layers.fuses_gelu(ModelConfig(mlp="swiglu"))
  assert not layers.fuses_gelu(ModelConfig(mlp="gelu", fuse_gelu_into_fp8_cast=False))
  assert layers.fuses_gelu(ModelConfig(mlp="gelu", fuse_gelu_into_fp8_cast=True))
  assert not layers.fuses_gelu(LlamaConfig())
  assert load_config("configs/tiny.yaml").model.fuse_gelu_into_fp8_cast == "auto"
  with pytest.raises(ValueError, match=r"fuse_gelu_into_fp8_cast='yes' is not allowed; use "
                                       r"True, False or 'auto'"):
    ModelConfig(fuse_gelu_into_fp8_cast="yes")
  with pytest.raises(ValueError, match=r"fuse_gelu_into_fp8_cast='yes' is not allowed"):
    ModelConfig(mlp="swiglu", fuse_gelu_into_fp8_cast="yes")  # the value first, then the MLP


def test_fused_gelu_needs_the_gelu_mlp():
  with pytest.raises(ValueError, match="fuse_gelu_into_fp8_cast=True needs mlp='gelu'"):
    ModelConfig(mlp="swiglu", fuse_gelu_into_fp8_cast=True)
  with pytest.raises(ValueError, match="model.fuse_gelu_into_fp8_cast=True needs model.mlp"):
    load_config("configs/tiny.yaml", ["model.mlp=swiglu", "model.fuse_gelu_into_fp8_cast=true"])
