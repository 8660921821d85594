"""The reference GPT: shapes, causality, FP8 vs BF16, scan/remat, a short real training run."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax
from fp8jax import FP8_COLLECTION, data
from fp8jax.models import GPT, ModelConfig, flops_per_token, init_model, matmul_param_count
from fp8jax.optim import num_params
from fp8jax.train import batch_loss, cross_entropy
from conftest import rel_err

TINY = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=64)
FP8 = fp8jax.Recipe()
B, T = 16, 32  # one batch shape everywhere, so compiled functions are shared between tests
_TX = optax.adamw(3e-3, weight_decay=0.01)


def _tokens(key, batch=B, seq_len=T):
  return jax.random.randint(key, (batch, seq_len), 0, 256, jnp.int32)


def _variables(cfg, key):
  """FP8 variables (params + FP8 state) of `cfg` for [B, T] inputs; O0 uses their params."""
  return init_model(cfg, FP8, key, B, T)


def _o0(variables):
  return {"params": variables["params"]}


@functools.lru_cache(maxsize=None)
def _apply(cfg, recipe):
  """Jitted ``GPT(cfg, recipe).apply(variables, tokens) -> logits``."""
  return jax.jit(GPT(cfg, recipe).apply)


@functools.lru_cache(maxsize=None)
def _loss_and_grads(cfg, recipe):
  """Jitted (variables, int32[B, T+1]) -> (loss, grads w.r.t. all variables)."""
  model = GPT(cfg, recipe)
  loss_fn = lambda v, batch: batch_loss(model.apply, v, batch)
  return jax.jit(jax.value_and_grad(loss_fn))


@jax.jit
def _update(variables, opt_state, grads):
  """One AdamW step on params; FP8 state <- its new value from `grads`."""
  updates, opt_state = _TX.update(grads["params"], opt_state, variables["params"])
  variables = fp8jax.apply_fp8_updates(variables, grads)
  return {**variables, "params": optax.apply_updates(variables["params"], updates)}, opt_state


@pytest.mark.parametrize("cfg", [TINY, TINY.replace(mlp="swiglu", norm="layernorm",
                                                    tie_embeddings=True)])
def test_shapes_params_and_flops(key, cfg):
  k1, k2 = jax.random.split(key)
  variables = _o0(_variables(cfg, k1))
  logits = _apply(cfg, None)(variables, _tokens(k2))
  assert logits.shape == (B, T, 256) and logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all() and float(jnp.std(logits)) > 0
  params = variables["params"]
  assert ("head" in params) != cfg.tie_embeddings
  norms = sum(num_params(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]
              if "norm" in jax.tree_util.keystr(k))
  embed = num_params(params["embed"])
  head_counted = embed if cfg.tie_embeddings else 0  # the tied head is still a GEMM
  assert matmul_param_count(cfg) == num_params(params) - embed - norms + head_counted
  assert flops_per_token(cfg, 24) == 6 * matmul_param_count(cfg) + 12 * 2 * 64 * 24


@pytest.mark.parametrize("recipe", [None, FP8])
def test_causal(key, recipe):
  """Changing token t leaves logits before t bit-identical (FP8: with delayed scales)."""
  k1, k2, k3 = jax.random.split(key, 3)
  variables = _variables(TINY, k1)
  batch = _tokens(k2, B, T + 1)
  if recipe is None:
    variables = _o0(variables)
  else:  # one step so the forward uses stored (delayed) scales
    variables = fp8jax.apply_fp8_updates(variables, _loss_and_grads(TINY, FP8)(variables, batch)[1])
  tokens, t = batch[:, :-1], 20
  changed = tokens.at[:, t].set((tokens[:, t] + 1 + jax.random.randint(k3, (B,), 0, 254)) % 256)
  apply = _apply(TINY, recipe)
  a, b = np.asarray(apply(variables, tokens)), np.asarray(apply(variables, changed))
  np.testing.assert_array_equal(a[:, :t], b[:, :t])
  assert np.abs(a[:, t:] - b[:, t:]).max(axis=-1).min() > 0


def test_fp8_close_to_bf16_and_state_stacked(key):
  k1, k2 = jax.random.split(key)
  variables = _variables(TINY, k1)
  tokens = _tokens(k2)
  ref = _apply(TINY.replace(dtype="float32"), None)(_o0(variables), tokens)
  bf16 = _apply(TINY, None)(_o0(variables), tokens)
  fp8 = _apply(TINY, FP8)(variables, tokens)
  e_bf16, e_fp8 = rel_err(bf16, ref), rel_err(fp8, ref)
  assert e_bf16 < 0.03
  assert 3 * e_bf16 < e_fp8 < 0.2  # FP8 happened (~0.10 vs BF16 ~0.009), and is bounded
  targets = jnp.roll(tokens, -1, axis=1)
  assert rel_err(cross_entropy(fp8, targets), cross_entropy(bf16, targets)) < 0.03
  meta = variables[FP8_COLLECTION]
  layer_leaves = jax.tree.leaves(meta["layers"])
  assert len(layer_leaves) == 4 * 3 * 2  # qkv, out, fc_in, fc_out x 3 roles x 2 arrays
  assert all(a.shape[0] == TINY.n_layers for a in layer_leaves)
  assert "head" not in meta  # the LM head is a BF16 GEMM unless fp8_head
  o0_shapes = jax.eval_shape(GPT(TINY).init, k1, tokens)
  assert FP8_COLLECTION not in o0_shapes


def test_lm_head_is_bf16_unless_fp8_head(key):
  """At an FP8 level the untied LM head runs the BF16 GEMM of O0 (bit for bit) by default,
  and in FP8 with fp8_head: its logits then err clearly above BF16's against the f32 head,
  within FP8's bound, and its FP8 state sits outside the layer scan."""
  k1, k2 = jax.random.split(key)
  fp8_head = TINY.replace(fp8_head=True)
  variables = _variables(fp8_head, k1)
  assert jax.tree.leaves(variables[FP8_COLLECTION]["head"])[0].shape == ()
  x = jax.random.normal(k2, (B, T, TINY.d_model), jnp.float32)  # a final hidden state

  def logits(cfg, recipe):
    parts = GPT(cfg, recipe).parts()
    return parts.logits(parts.split(variables)[1], x)
  ref = logits(TINY.replace(dtype="float32"), None)
  bf16, default, fp8 = logits(TINY, None), logits(TINY, FP8), logits(fp8_head, FP8)
  np.testing.assert_array_equal(default, bf16)
  e_bf16, e_fp8 = rel_err(bf16, ref), rel_err(fp8, ref)
  assert e_bf16 < 0.02 and 3 * e_bf16 < e_fp8 < 0.2


@pytest.mark.default_codegen
def test_remat_matches_no_remat(key):
  """Remat (FP8 GEMMs, FP8 state updated in the recomputation) changes nothing but rounding.

  XLA fuses the recomputed forward differently, so now and then an activation rounds one
  bf16 ulp apart and an element of an FP8 cast moves one step (191 seeds: bit-identical in
  178; otherwise at most 0.65% per gradient in norm, embedding-only in most). A wrong scale
  or precision in the recomputation moves every gradient by FP8's own error (3-18%)."""
  k1, k2 = jax.random.split(key)
  variables = _variables(TINY, k1)
  batch = _tokens(k2, B, T + 1)
  loss, grads = _loss_and_grads(TINY, FP8)(variables, batch)
  loss_r, grads_r = _loss_and_grads(TINY.replace(remat=True), FP8)(variables, batch)
  assert jax.tree.structure(grads) == jax.tree.structure(grads_r)
  assert float(loss) == pytest.approx(float(loss_r), rel=1e-6)
  same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), grads[FP8_COLLECTION],
                      grads_r[FP8_COLLECTION])
  assert jax.tree.all(same)  # identical FP8 state updates
  for g, g_r in zip(jax.tree.leaves(grads["params"]), jax.tree.leaves(grads_r["params"])):
    g, g_r = np.asarray(g, np.float32), np.asarray(g_r, np.float32)
    assert np.linalg.norm(g_r - g) <= 2 ** -6 * np.linalg.norm(g)
  hist = grads_r[FP8_COLLECTION]["layers"]["mlp"]["fc_in"]["Fp8DotGeneral_0"]["output_grad"]
  assert (np.asarray(hist.amax_history)[:, 0] > 0).all()  # backward recorded its amax


def _train(recipe, variables, batches):
  """Losses of one AdamW step per batch, and the final variables."""
  opt_state, losses = _TX.init(variables["params"]), []
  for batch in batches:
    loss, grads = _loss_and_grads(TINY, recipe)(variables, batch)
    variables, opt_state = _update(variables, opt_state, grads)
    losses.append(float(loss))
  return np.array(losses), variables


def test_tiny_model_learns_stdlib_in_fp8_like_bf16(key):
  corpus = data.load_data(max_bytes=1 << 20)
  it = corpus.batches("train", B, T, seed=int(jax.random.randint(key, (), 0, 1 << 20)))
  batches = [jnp.asarray(it.next()) for _ in range(30)]
  variables = _variables(TINY, key)
  l_bf16, _ = _train(None, _o0(variables), batches)
  l_fp8, v_fp8 = _train(FP8, variables, batches)
  assert np.isfinite(l_bf16).all() and np.isfinite(l_fp8).all()
  end_bf16, end_fp8 = l_bf16[-5:].mean(), l_fp8[-5:].mean()
  assert end_bf16 < 0.6 * l_bf16[0] and end_fp8 < 0.6 * l_fp8[0]  # ~6.3 -> ~3 nats
  assert abs(end_fp8 - end_bf16) < 0.03 * end_bf16
  scales = np.asarray(v_fp8[FP8_COLLECTION]["layers"]["attn"]["qkv"]["Fp8DotGeneral_0"]
                      ["input"].scale)
  assert (scales != 1.0).all()  # the FP8 state was carried through training


@pytest.mark.parametrize("changes,match", [
    (dict(d_model=66), "d_model=66 is not divisible by n_heads=4"),
    (dict(d_model=12, n_heads=4), "head dim .*=3 is odd"),
    (dict(n_layers=0), "n_layers=0 is not allowed; use an integer >= 1"),
    (dict(d_ff=2.5), "d_ff=2.5 is not allowed"),
    (dict(mlp="relu"), r"mlp='relu' is not allowed; use one of \['gelu', 'swiglu'\]"),
    (dict(norm="batchnorm"), "norm='batchnorm' is not allowed"),
    (dict(dtype="float8_e4m3fn"), "dtype='float8_e4m3fn' is not allowed"),
    (dict(param_dtype="int8"), "param_dtype='int8' is not allowed"),
    (dict(remat="yes"), "remat='yes' is not allowed; use True or False"),
    (dict(dropout_rate=1.0), r"dropout_rate=1.0 is not allowed; use a number in \[0, 1\)"),
    (dict(attention_impl="flash"), "attention_impl='flash' is not allowed"),
])
def test_bad_config_raises(changes, match):
  with pytest.raises(ValueError, match=match):
    TINY.replace(**changes)


def test_bad_inputs_raise(key):
  variables = _o0(_variables(TINY, key))
  apply = _apply(TINY, None)
  with pytest.raises(ValueError, match="seq_len=65 is not allowed; use 1..64"):
    apply(variables, jnp.zeros((1, 65), jnp.int32))
  with pytest.raises(ValueError, match=r"integer array \[batch, seq_len\], got float32\[1, 8\]"):
    apply(variables, jnp.ones((1, 8), jnp.float32))
  with pytest.raises(ValueError, match="batch_size=0 is not allowed"):
    init_model(TINY, None, key, 0, 8)


@pytest.mark.parametrize("vocab", [256, 5000])  # one-hot GEMM lookup, gather lookup
def test_embed_matches_gather_lookup_and_gradient(key, vocab):
  from fp8jax.models.gpt import Embed
  k1, k2, k3 = jax.random.split(key, 3)
  tokens = jax.random.randint(k1, (4, 24), 0, vocab, jnp.int32)
  module = Embed(vocab, 32, dtype=jnp.float32)
  params = module.init(k2, tokens)
  table = params["params"]["embedding"]
  cot = jax.random.normal(k3, (4, 24, 32), jnp.float32)
  out, vjp = jax.vjp(lambda p: module.apply(p, tokens), params)
  np.testing.assert_allclose(out, table[tokens], rtol=1e-6, atol=0)
  ref_grad = jnp.zeros_like(table).at[tokens].add(cot)
  assert rel_err(vjp(cot)[0]["params"]["embedding"], ref_grad) < 1e-5
