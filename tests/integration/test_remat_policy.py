"""model.remat_policy="save_gemm_outputs": the recomputation runs no projection GEMM again;
"save_gemm_io": nor any FP8 activation cast; loss and gradients bit-identical to full remat."""
import re

import jax
import numpy as np
import pytest

import fp8jax
from fp8jax.config import load_config
from fp8jax.models import GPT, ModelConfig, init_model
from fp8jax.train import batch_loss
from conftest import primitive_eqns

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16, remat=True)
B, T = 2, 8


def _grad_fn(policy: str, recipe, mlp: str):
  model = GPT(CFG.replace(remat_policy=policy, mlp=mlp), recipe)
  loss = lambda v, b: batch_loss(model.apply, v, b)
  return jax.jit(jax.value_and_grad(loss))


# Each case compiles full remat once and compares every saving policy with it.
@pytest.mark.parametrize("level, mlp, savings", [
    ("O0", "gelu", ("save_gemm_outputs", "save_gemm_io")), ("O1", "gelu", ("save_gemm_outputs",)),
    ("O1", "swiglu", ("save_gemm_outputs", "save_gemm_io"))],
    ids=["O0-gelu", "O1-gelu", "O1-swiglu"])
def test_saved_gemm_outputs_skip_the_recomputed_gemms(key, level, mlp, savings):
  recipe = fp8jax.opt_level(level).recipe
  k1, k2 = jax.random.split(key)
  variables = init_model(CFG.replace(mlp=mlp), recipe, k1, B, T)
  batch = jax.random.randint(k2, (B, T + 1), 0, 256)
  dots, out = {}, {}
  for policy in ("full", *savings):
    f = _grad_fn(policy, recipe, mlp)
    dots[policy] = len(re.findall(r"= \S+ dot\(", f.lower(variables, batch).compile().as_text()))
    out[policy] = f(variables, batch)
  loss, grads = out["full"]
  assert np.isfinite(float(loss))
  assert float(np.abs(grads["params"]["layers"]["mlp"]["fc_out"]["kernel"]).max()) > 0
  for saving in savings:
    # Full remat recomputes qkv, attention out and MLP in (fc_out's output is not needed by
    # the backward); saved, none of them runs again. The attention's own dots still do,
    # except that with the inputs saved its output (P V) is no longer recomputed for out's
    # input.
    assert dots["full"] - dots[saving] == (3 if saving == "save_gemm_outputs" else 4), dots
    for a, b in zip(jax.tree.leaves(out["full"]), jax.tree.leaves(out[saving]), strict=True):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_remat_policy_is_refused():
  with pytest.raises(ValueError, match=r"ModelConfig.remat_policy='dots' is not allowed; use "
                                       r"one of \['auto', 'full', 'save_gemm_outputs', "
                                       r"'save_gemm_io'\]"):
    CFG.replace(remat_policy="dots")
  with pytest.raises(ValueError, match=r"model.remat_policy='none' is not allowed"):
    load_config("configs/tiny.yaml", ["model.remat_policy=none"])


@pytest.mark.default_codegen
def test_attention_residuals_saved_by_name_skip_the_attention_forward(key):
  """causal_attention_saving_residuals (the model uses it with cuDNN; "xla" here, the only
  implementation on CPUs): under a scan of remat'd layers saving the model's names the
  recomputation runs no attention dot (QK^T, PV) again; gradients bit-identical."""
  from fp8jax.models.gpt import (GEMM_OUTPUT_NAME, causal_attention_saving_residuals,
                                 remat_policy)
  from jax.ad_checkpoint import checkpoint_name
  policy = remat_policy(CFG.replace(remat_policy="save_gemm_outputs"))
  k1, k2 = jax.random.split(key)
  x = jax.random.normal(k1, (2, 16, 16))
  ws = jax.random.normal(k2, (3, 16, 48)) / 4

  def layer(x, w, saving):
    qkv = checkpoint_name(x @ w, GEMM_OUTPUT_NAME).reshape(2, 16, 3, 2, 8)
    q, k, v = jax.numpy.tanh(qkv[:, :, 0]), jax.numpy.sin(qkv[:, :, 1]), qkv[:, :, 2]
    if saving:
      o = checkpoint_name(causal_attention_saving_residuals(q, k, v, "xla"), GEMM_OUTPUT_NAME)
    else:
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    return x + jax.numpy.tanh(o.reshape(2, 16, 16)), None

  dots, grads = {}, {}
  for saving in (False, True):
    body = jax.checkpoint(lambda x, w: layer(x, w, saving), policy=policy)
    loss = lambda x, ws: jax.numpy.sum(jax.lax.scan(body, x, ws)[0] ** 2)
    f = jax.jit(jax.grad(loss, argnums=(0, 1)))
    dots[saving] = len(re.findall(r"= \S+ dot\(", f.lower(x, ws).compile().as_text()))
    grads[saving] = f(x, ws)
  assert dots[False] - dots[True] == 2, dots
  assert float(jax.numpy.abs(grads[True][1]).max()) > 0
  for a, b in zip(grads[False], grads[True], strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.default_codegen
def test_saved_gemm_io_casts_no_activation_again(key):
  """With the fused cast kernel (Pallas' interpreter here) the backward's recomputation under
  "save_gemm_io" runs no activation cast: one kernel call fewer per projection of the layer
  body (qkv, out, fc_in, fc_out); same loss and gradients, bit for bit."""
  from fp8jax.kernels import cast_transpose as ct
  cfg = ModelConfig(d_model=128, n_layers=2, n_heads=2, d_ff=256, max_seq_len=64, remat=True)
  recipe = fp8jax.O1.recipe.replace(fused_cast_transpose=True)
  k1, k2 = jax.random.split(key)
  variables = init_model(cfg, recipe, k1, 2, 64)
  batch = jax.random.randint(k2, (2, 65), 0, 256)
  kernels, out = {}, {}
  with ct.interpret_anywhere():
    for policy in ("save_gemm_outputs", "save_gemm_io"):
      model = GPT(cfg.replace(remat_policy=policy), recipe)
      f = jax.value_and_grad(lambda v: batch_loss(model.apply, v, batch))
      kernels[policy] = len(list(primitive_eqns(jax.make_jaxpr(f)(variables).jaxpr,
                                                "pallas_call")))
      out[policy] = jax.jit(f)(variables)
  assert kernels["save_gemm_outputs"] - kernels["save_gemm_io"] == 4, kernels
  assert kernels["save_gemm_io"] > 4  # the forward's casts and the gradients' casts remain
  for a, b in zip(jax.tree.leaves(out["save_gemm_outputs"]), jax.tree.leaves(out["save_gemm_io"]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
