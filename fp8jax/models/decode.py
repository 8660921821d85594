"""Autoregressive decoding with a key/value cache for the decoder families (``gpt``, ``llama``).

:func:`generate` runs a :class:`fp8jax.models.layers.Decoder` (GPT or LLaMA, at any recipe)
on its own variables: the prompt once through every layer (prefill), writing each layer's
keys and values into a cache, then one token per step, each attending to the cache. The
layers are the model's own modules applied to its stacked variables (the qkv / output
projections, MLP, norms and LM head with the same FP8 state; RoPE at each token's absolute
position; each norm inside its GEMMs' FP8 input cast where the model puts it there), so the
logits of a cached step equal those of the full model on the whole sequence up to
accumulation order.

Sampling: temperature 0 is greedy (argmax); otherwise logits / temperature, restricted to the
`top_k` largest when `top_k` > 0, sampled with ``jax.random.categorical``. The whole
generation is one jitted program: the prefill, then a ``lax.scan`` over the new tokens.

Shapes: B batch, P prompt length, N new tokens, S = P + N cache length, L layers, KV key/value
heads, K head dim, D d_model, V vocab.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax import Recipe
from fp8jax.models.layers import (MLP, Decoder, DecoderParts, apply_rope, dense_kwargs,
                                  norm, norm_in_cast)


class KVCache(NamedTuple):
  """Keys and values of every layer for S positions.

  Attributes:
    k: keys [L, B, S, KV, K] in the compute dtype, RoPE applied.
    v: values [L, B, S, KV, K] in the compute dtype.
  """
  k: jax.Array
  v: jax.Array


def init_cache(config, batch_size: int, length: int) -> KVCache:
  """A zero :class:`KVCache` for `batch_size` sequences of `length` positions of a model of
  `config` (a family config: n_layers, n_kv_heads, head_dim, dtype)."""
  shape = (config.n_layers, batch_size, length, config.n_kv_heads, config.head_dim)
  zeros = jnp.zeros(shape, jnp.dtype(config.dtype))
  return KVCache(zeros, zeros)


class _CachedAttention(nn.Module):
  """``layers.Attention`` (same submodules "qkv" and "out", same variables) over T new
  positions starting at `start`, reading and writing the layer's cache."""

  config: Any
  recipe: Recipe | None

  @nn.compact
  def __call__(self, x, cos, sin, k_cache, v_cache, start, norm=None):
    """x [B, T, D]; cos/sin [T, K/2] of positions start..start+T-1; caches [B, S, KV, K];
    `norm`: None or ``norm_in_cast``'s (gain, eps), as for ``layers.Attention``. Returns
    (y [B, T, D], k_cache, v_cache)."""
    cfg = self.config
    h, kv, k_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = h // kv
    std = cfg.d_model ** -0.5
    qkv = nn.DenseGeneral((kv, g + 2, k_dim), name="qkv",
                          **dense_kwargs(cfg, self.recipe, std, norm))(x)
    q, k, v = jnp.split(qkv, (g, g + 1), axis=3)
    q = q.reshape(*qkv.shape[:2], h, k_dim)
    k, v = k[:, :, :, 0], v[:, :, :, 0]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache = lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), start, axis=1)
    v_cache = lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), start, axis=1)
    t, s = x.shape[1], k_cache.shape[1]
    # query at position start + i sees cache positions 0..start + i (later ones are zeros)
    mask = jnp.arange(s)[None, :] <= start + jnp.arange(t)[:, None]
    o = jax.nn.dot_product_attention(q, k_cache.astype(q.dtype), v_cache.astype(q.dtype),
                                     mask=mask[None, None], implementation="xla")
    y = nn.DenseGeneral(cfg.d_model, axis=(-2, -1), name="out",
                        **dense_kwargs(cfg, self.recipe, std))(o)
    return y, k_cache, v_cache


class _CachedBlock(nn.Module):
  """``layers.Block`` (same submodules and variables) with :class:`_CachedAttention`."""

  config: Any
  recipe: Recipe | None

  @nn.compact
  def __call__(self, x, cos, sin, k_cache, v_cache, start):
    cfg = self.config
    # each norm inside its GEMMs' FP8 input cast where the model puts it there, else before
    fused = norm_in_cast(self, cfg, self.recipe, "norm_attn", x)
    attn = _CachedAttention(cfg, self.recipe, name="attn")
    cached = (k_cache, v_cache, start)
    h, k_cache, v_cache = (attn(x, cos, sin, *cached, norm=fused) if fused else
                           attn(norm(cfg, "norm_attn")(x), cos, sin, *cached))
    x = x + h
    fused = norm_in_cast(self, cfg, self.recipe, "norm_mlp", x)
    mlp = MLP(cfg, self.recipe, name="mlp")
    return x + (mlp(x, norm=fused) if fused else mlp(norm(cfg, "norm_mlp")(x))), k_cache, v_cache


def check_decoder(model) -> None:
  """ValueError unless `model` is a decoder of the built-in families (what :func:`generate`
  runs)."""
  if not isinstance(model, Decoder):
    raise ValueError(f"KV-cache decoding runs the gpt and llama families "
                     f"(fp8jax.models.layers.Decoder), not {type(model).__name__}")


def forward_cached(model: Decoder, variables, tokens, cache: KVCache, start):
  """Logits of the last of `tokens` int[B, T], the tokens sitting at positions
  start..start+T-1 after the cache's first `start` positions (written earlier). Returns
  (logits f32[B, V], the cache with those T positions written)."""
  cfg = model.config
  parts = DecoderParts(model)
  stacked, shared = parts.split(variables)
  x = parts.embed(shared, tokens)
  cos, sin = model.rope(cache.k.shape[2])
  t = tokens.shape[1]
  cos, sin = (lax.dynamic_slice_in_dim(a, start, t, axis=0) for a in (cos, sin))
  block = _CachedBlock(cfg, model.recipe, parent=None)

  def layer(x, xs):
    layer_variables, k_cache, v_cache = xs
    x, k_cache, v_cache = block.apply(layer_variables, x, cos, sin, k_cache, v_cache, start)
    return x, (k_cache, v_cache)

  x, (k, v) = lax.scan(layer, x, (stacked, cache.k, cache.v))
  return parts.logits(shared, x[:, -1:])[:, 0], KVCache(k, v)


def sample(logits, key, temperature, top_k: int = 0):
  """Next tokens int32[B] from logits f32[B, V]: argmax where `temperature` <= 0, else a
  draw from softmax(logits / temperature) over the `top_k` largest logits (all when 0)."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  scaled = logits / jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
  if top_k:
    kth = lax.top_k(scaled, top_k)[0][..., -1:]
    scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  drawn = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
  return jnp.where(jnp.asarray(temperature) > 0, drawn, greedy)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "top_k"))
def _generate(model, variables, prompt, key, temperature, *, max_new_tokens, top_k):
  b, p = prompt.shape
  cache = init_cache(model.config, b, p + max_new_tokens)
  logits, cache = forward_cached(model, variables, prompt, cache, 0)

  def step(carry, key):
    cache, logits, position = carry
    token = sample(logits, key, temperature, top_k)
    next_logits, cache = forward_cached(model, variables, token[:, None], cache, position)
    return (cache, next_logits, position + 1), (token, logits)

  keys = jax.random.split(key, max_new_tokens)
  _, (tokens, step_logits) = lax.scan(step, (cache, logits, jnp.int32(p)), keys)
  return tokens.T, jnp.swapaxes(step_logits, 0, 1)


def generate(model: Decoder, variables, prompt, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, key=None):
  """Continues each row of `prompt` by `max_new_tokens` tokens with a key/value cache.

  Args:
    model: a GPT or LLaMA decoder (``fp8jax.models.layers.Decoder``) at any recipe.
    variables: its variables (``{"params": ..., FP8_COLLECTION: ...}`` with a recipe).
    prompt: int[B, P] token ids, P >= 1, every id below the vocabulary.
    max_new_tokens: N >= 1; P + N must be at most ``model.config.max_seq_len``.
    temperature: 0 (greedy) or > 0 (sampling).
    top_k: sample among the k largest logits (0: all).
    key: ``jax.random`` key of the draws (default: key 0); unused when greedy.
  Returns:
    (tokens int32[B, N], logits f32[B, N, V]): the new tokens and the logits each was chosen
    from (row i: the model's logits after prompt + tokens[:, :i]).
  Raises:
    ValueError: another model class, a prompt that is not int[B, P], or lengths or sampling
      settings out of range (naming the value and the bound).
  """
  check_decoder(model)
  cfg = model.config
  prompt = jnp.asarray(prompt)
  if prompt.ndim != 2 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
    raise ValueError(f"generate: the prompt must be token ids int[batch, length >= 1], got "
                     f"{prompt.dtype}{list(prompt.shape)}")
  for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0 or (
        name == "max_new_tokens" and value < 1):
      low = 1 if name == "max_new_tokens" else 0
      raise ValueError(f"generate: {name}={value!r} is not allowed; use an integer >= {low}")
  if top_k > cfg.vocab_size:
    raise ValueError(f"generate: top_k={top_k} is larger than the vocabulary "
                     f"({cfg.vocab_size} ids); use 0 (all) or at most {cfg.vocab_size}")
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
      not np.isfinite(temperature) or temperature < 0:
    raise ValueError(f"generate: temperature={temperature!r} is not allowed; use 0 (greedy) "
                     "or a number > 0")
  total = prompt.shape[1] + max_new_tokens
  if total > cfg.max_seq_len:
    raise ValueError(f"generate: the prompt's {prompt.shape[1]} tokens + max_new_tokens="
                     f"{max_new_tokens} exceed the model's max_seq_len={cfg.max_seq_len}; "
                     f"use at most {cfg.max_seq_len - prompt.shape[1]} new tokens or a "
                     "shorter prompt")
  key = jax.random.key(0) if key is None else key
  return _generate(model, variables, prompt.astype(jnp.int32), key,
                   jnp.float32(temperature), max_new_tokens=int(max_new_tokens),
                   top_k=int(top_k))


__all__ = ["KVCache", "check_decoder", "forward_cached", "generate", "init_cache", "sample"]
