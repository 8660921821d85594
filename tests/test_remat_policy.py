"""model.remat_policy="save_gemm_outputs": the recomputation runs no projection GEMM again,
and loss and gradients are bit-identical to full remat."""
import re

import jax
import numpy as np
import pytest

import fp8jax
from fp8jax.config import load_config
from fp8jax.models import GPT, ModelConfig, init_model, next_token_loss

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=16, remat=True)
B, T = 2, 8


def _grad_fn(policy: str, recipe, mlp: str):
  model = GPT(CFG.replace(remat_policy=policy, mlp=mlp), recipe)
  loss = lambda v, b: next_token_loss(model.apply(v, b[:, :-1]), b[:, 1:])
  return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("level, mlp", [("O0", "gelu"), ("O1", "gelu"), ("O1", "swiglu")])
def test_saved_gemm_outputs_skip_the_recomputed_gemms(key, level, mlp):
  recipe = fp8jax.opt_level(level).recipe
  k1, k2 = jax.random.split(key)
  variables = init_model(CFG.replace(mlp=mlp), recipe, k1, B, T)
  batch = jax.random.randint(k2, (B, T + 1), 0, 256)
  dots, out = {}, {}
  for policy in ("full", "save_gemm_outputs"):
    f = _grad_fn(policy, recipe, mlp)
    dots[policy] = len(re.findall(r"= \S+ dot\(", f.lower(variables, batch).compile().as_text()))
    out[policy] = f(variables, batch)
  # Full remat recomputes qkv, attention out and MLP in (fc_out's output is not needed by the
  # backward); saved, none of them runs again. The attention's own dots still do.
  assert dots["full"] - dots["save_gemm_outputs"] == 3, dots
  loss, grads = out["full"]
  assert np.isfinite(float(loss))
  assert float(np.abs(grads["params"]["layers"]["mlp"]["fc_out"]["kernel"]).max()) > 0
  for a, b in zip(jax.tree.leaves(out["full"]), jax.tree.leaves(out["save_gemm_outputs"]),
                  strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_remat_policy_is_refused():
  with pytest.raises(ValueError, match=r"ModelConfig.remat_policy='dots' is not allowed; use "
                                       r"one of \['full', 'save_gemm_outputs'\]"):
    CFG.replace(remat_policy="dots")
  with pytest.raises(ValueError, match=r"model.remat_policy='none' is not allowed"):
    load_config("configs/tiny.yaml", ["model.remat_policy=none"])


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
