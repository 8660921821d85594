"""A GPT-style decoder LM written only against fp8jax's public API.

Pre-norm blocks (RMSNorm or LayerNorm, computed in f32), rotary position embeddings, causal
multi-head attention (scores and softmax in f32) and a GELU or SwiGLU MLP. Every projection
(fused qkv, attention output, MLP in/gate/out, the LM head unless tied) is an ``nn.Dense`` /
``nn.DenseGeneral`` whose GEMM is :class:`fp8jax.linen.Fp8DotGeneral` when a recipe is given;
embeddings, norms, softmax and the activation x activation attention matmuls stay in the
compute dtype (BF16) / f32, as MS-AMP does. Layers run under ``nn.scan`` (parameters and FP8
state stacked on a leading layer axis) and optionally ``nn.remat`` (which by default keeps
the FP8 weight casts of the forward for the backward, see ``remat_save_fp8_weights``; with
``remat_policy="save_gemm_outputs"`` it also keeps the projection outputs the backward needs
and, with cuDNN attention, the attention's residuals, so only the elementwise work and the FP8
casts are recomputed; ``"save_gemm_io"`` keeps the projections' input casts too). With
``scan_layers=False`` the same stacked variables are used unrolled, one layer slice per call
(:func:`unstack_layers`).

Shapes: B batch, T sequence, D d_model, H heads, K head dim (D / H), F d_ff, V vocab.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp8jax import FP8_COLLECTION, Recipe
from fp8jax.dot import INPUT_CAST_NAME, WEIGHT_CAST_NAME
from fp8jax.linen import (HEALTH_COLLECTION, PERTURBATIONS, WEIGHT_CAST_COLLECTION,
                          Fp8DotGeneral)

MLPS = ("gelu", "swiglu")
NORMS = ("rmsnorm", "layernorm")
DTYPES = ("bfloat16", "float32", "float16")
PARAM_DTYPES = ("float32", "bfloat16")
ATTENTION_IMPLS = ("xla", "cudnn")
REMAT_POLICIES = ("full", "save_gemm_outputs", "save_gemm_io")
# checkpoint_names that remat_policy="save_gemm_outputs" saves: every projection's output and
# the attention's backward residuals (causal_attention_saving_residuals); "save_gemm_io" also
# every projection's input: its FP8 cast (fp8jax.dot.INPUT_CAST_NAME) with a recipe, else the
# bf16 input itself (GEMM_INPUT_NAME).
GEMM_OUTPUT_NAME = "fp8jax_gemm_output"
GEMM_INPUT_NAME = "fp8jax_gemm_input"
ATTENTION_RESIDUALS_NAME = "fp8jax_attention_residuals"
_SAVED_NAMES = {
    "full": (),
    "save_gemm_outputs": (GEMM_OUTPUT_NAME, ATTENTION_RESIDUALS_NAME),
    "save_gemm_io": (GEMM_OUTPUT_NAME, ATTENTION_RESIDUALS_NAME, GEMM_INPUT_NAME,
                     INPUT_CAST_NAME),
}
_POSITIVE = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shape and numerics of a :class:`GPT`.

  Attributes:
    vocab_size: number of token ids (256: bytes).
    d_model, n_layers, n_heads, d_ff: widths and depth; d_model % n_heads == 0 and the head
      dim d_model / n_heads must be even (RoPE rotates pairs).
    max_seq_len: longest sequence accepted.
    mlp: "gelu" (F-wide hidden) or "swiglu" (F-wide gate and up projections).
    norm: "rmsnorm" or "layernorm" (both computed in f32).
    remat: recompute each layer's activations in the backward pass (``nn.remat``).
    remat_policy: what remat keeps from the forward: "full" keeps only the layer input (and the
      FP8 weight casts, see below): every GEMM runs again in the recomputation;
      "save_gemm_outputs" also keeps the projection outputs the backward needs (qkv, attention
      out, MLP in; bf16: 2 * (4D + F) bytes per token and layer, 2 * (4D + 2F) with SwiGLU),
      so no GEMM is recomputed, only norms, RoPE, the activation and the FP8 casts; with
      attention_impl="cudnn" the attention's residuals are kept too (q, k, v, output and
      softmax statistics: ~2 * 4D bytes more), so its forward does not run again either;
      "save_gemm_io" also keeps every projection's input as the weight gradient reads it: its
      FP8 cast with a recipe (3D + F bytes per token and layer), the bf16 input without one
      (2 * (3D + F) bytes), so the recomputation casts no activation to FP8 again (it runs
      only the norms, RoPE and the activation their backward passes need).
    scan_layers: True runs the layers under ``nn.scan``; False unrolls them over layer slices
      of the same stacked variables (same parameters), so the residuals the backward keeps
      are separate buffers rather than slices of stacked ones (no zero-fill, no device copy
      per residual and layer); longer compiles. Applies where no collection is written
      (initialization and FP8-health probes keep the scan); dropout masks differ from the
      scan's.
    remat_save_fp8_weights: with remat, keep each FP8 GEMM's weight cast from the forward
      (1 byte per weight, all layers) instead of casting the weights again in the
      recomputation (``fp8jax.dot.SAVE_FP8_WEIGHTS``); bit-identical results. No effect
      without remat or without a recipe.
    fuse_gelu_into_fp8_cast: with a recipe and the GELU MLP, fc_out's FP8 GEMM takes fc_in's
      output and applies GELU inside its input cast (``Fp8DotGeneral(lhs_activation="gelu")``;
      with the fused cast kernel the bf16 activation is never written). GELU is then computed
      in f32 and rounded once (``nn.gelu`` on bf16 rounds its intermediates): close to, not
      bit-identical with, the unfused model.
    dtype: compute dtype name of activations and BF16 GEMMs ("bfloat16", "float32", ...).
    param_dtype: storage dtype name of parameters.
    tie_embeddings: the LM head reuses the embedding matrix (then it is a BF16 GEMM).
    rope_base: RoPE frequency base.
    dropout_rate: dropout on embeddings and residual branches (training only).
    attention_impl: ``jax.nn.dot_product_attention`` implementation, "xla" or "cudnn".
  """

  vocab_size: int = 256
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  d_ff: int = 1024
  max_seq_len: int = 256
  mlp: str = "gelu"
  norm: str = "rmsnorm"
  remat: bool = False
  remat_policy: str = "full"
  scan_layers: bool = True
  remat_save_fp8_weights: bool = True
  fuse_gelu_into_fp8_cast: bool = False
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  tie_embeddings: bool = False
  rope_base: float = 10000.0
  dropout_rate: float = 0.0
  attention_impl: str = "xla"

  def __post_init__(self):
    for name in _POSITIVE:
      _check_int(name, getattr(self, name))
    if self.d_model % self.n_heads:
      raise ValueError(f"ModelConfig.d_model={self.d_model} is not divisible by "
                       f"n_heads={self.n_heads}; use a d_model that is a multiple of n_heads")
    if (self.d_model // self.n_heads) % 2:
      raise ValueError(f"ModelConfig head dim d_model/n_heads={self.d_model // self.n_heads} is "
                       "odd; RoPE needs an even head dim")
    for name, allowed in (("mlp", MLPS), ("norm", NORMS), ("dtype", DTYPES),
                          ("param_dtype", PARAM_DTYPES), ("attention_impl", ATTENTION_IMPLS),
                          ("remat_policy", REMAT_POLICIES)):
      _check_choice(name, getattr(self, name), allowed)
    if self.fuse_gelu_into_fp8_cast and self.mlp != "gelu":
      raise ValueError(f"ModelConfig.fuse_gelu_into_fp8_cast=True needs mlp='gelu', got "
                       f"mlp={self.mlp!r} (SwiGLU is not fused yet)")
    for name in ("remat", "remat_save_fp8_weights", "tie_embeddings",
                 "fuse_gelu_into_fp8_cast", "scan_layers"):
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} is not allowed; "
                         "use True or False")
    _check_float("rope_base", self.rope_base, lambda v: v > 1, "a number > 1")
    _check_float("dropout_rate", self.dropout_rate, lambda v: 0 <= v < 1, "a number in [0, 1)")

  @property
  def head_dim(self) -> int:
    """K = d_model // n_heads."""
    return self.d_model // self.n_heads

  def replace(self, **changes) -> "ModelConfig":
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)


def _check_int(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"ModelConfig.{name}={value!r} is not allowed; use an integer >= 1")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
  if value not in allowed:
    raise ValueError(f"ModelConfig.{name}={value!r} is not allowed; use one of {list(allowed)}")


def _check_float(name: str, value: Any, ok, allowed: str) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
      or not np.isfinite(value) or not ok(value):
    raise ValueError(f"ModelConfig.{name}={value!r} is not allowed; use {allowed}")


def _saveable(y):
  """A projection's output, named for remat (see ModelConfig.remat_policy)."""
  return checkpoint_name(y, GEMM_OUTPUT_NAME)


def _saveable_input(x, recipe: Recipe | None):
  """A projection's bf16 input, named for remat when the GEMM is BF16 (with a recipe the FP8
  dot names its own cast of x: fp8jax.dot.INPUT_CAST_NAME)."""
  return checkpoint_name(x, GEMM_INPUT_NAME) if recipe is None else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def causal_attention_saving_residuals(q, k, v, implementation: str):
  """``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` whose backward residuals (for
  cuDNN: q, k, v, the output and the softmax statistics) are named
  ``ATTENTION_RESIDUALS_NAME``, so a remat policy that saves that name does not run the attention forward again. (With
  implementation="xla" the residuals include the T x T probabilities: use it for tests.)"""
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def _attention_fwd(q, k, v, implementation):
  o, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation), q, k, v)
  return o, jax.tree.map(lambda r: checkpoint_name(r, ATTENTION_RESIDUALS_NAME), vjp)


def _attention_bwd(implementation, vjp, g):
  del implementation
  return vjp(g)


causal_attention_saving_residuals.defvjp(_attention_fwd, _attention_bwd)


def _dense_kwargs(config: ModelConfig, recipe: Recipe | None, std: float) -> dict:
  """Common nn.Dense/DenseGeneral arguments: dtypes, init N(0, std), the FP8 GEMM."""
  kw = dict(use_bias=False, dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            kernel_init=nn.initializers.normal(std))
  if recipe is not None:
    kw["dot_general_cls"] = functools.partial(Fp8DotGeneral, recipe=recipe)
  return kw


def _f32_out_gemm(recipe: Recipe | None):
  """dot_general_cls whose GEMM (FP8 when `recipe` is given, else BF16) writes f32."""
  if recipe is None:
    return lambda: functools.partial(lax.dot_general, preferred_element_type=jnp.float32)
  return lambda: functools.partial(Fp8DotGeneral(recipe=recipe),
                                   preferred_element_type=jnp.float32)


def _norm(config: ModelConfig, name: str):
  """RMSNorm / LayerNorm computed in f32: x[..., D] -> [..., D] in the compute dtype."""
  cls = nn.RMSNorm if config.norm == "rmsnorm" else nn.LayerNorm
  norm = cls(epsilon=1e-6, dtype=jnp.float32, param_dtype=jnp.dtype(config.param_dtype),
             name=name)
  return lambda x: norm(x.astype(jnp.float32)).astype(jnp.dtype(config.dtype))


def rope_tables(seq_len: int, head_dim: int, base: float):
  """(cos, sin), each f32[T, K/2], for positions 0..T-1."""
  inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
  return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def apply_rope(x, cos, sin):
  """Rotates pairs (first half, second half) of x[B, T, H, K] by position; same dtype."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c, s = cos[None, :, None, :], sin[None, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Embed(nn.Embed):
  """``nn.Embed`` whose lookup is a one-hot GEMM for small vocabularies (<= 4096 ids).

  On GPUs the gradient of a gather is a scatter-add, and with a byte-level vocabulary every
  row collects thousands of tokens' gradients (slow atomics: ~10 ms per 1.3B-config step on
  an H200); the one-hot product's gradient is one small GEMM. Same parameter ("embedding"),
  same values.
  """

  one_hot_max_vocab: int = 4096

  def __call__(self, inputs):
    if self.num_embeddings > self.one_hot_max_vocab:
      return super().__call__(inputs)
    one_hot = jax.nn.one_hot(inputs, self.num_embeddings, dtype=self.dtype)
    return jnp.dot(one_hot, self.embedding.astype(self.dtype))


class Attention(nn.Module):
  """Causal self-attention: x[B, T, D] -> [B, T, D]; projections through the FP8 GEMM."""

  config: ModelConfig
  recipe: Recipe | None

  @nn.compact
  def __call__(self, x, cos, sin):
    cfg = self.config
    std = cfg.d_model ** -0.5
    # Heads first, so a tensor-parallel split of the heads is a contiguous block of the GEMM's
    # output columns (fp8jax.parallel.tensor).
    qkv = _saveable(nn.DenseGeneral((cfg.n_heads, 3, cfg.head_dim), name="qkv",
                                    **_dense_kwargs(cfg, self.recipe, std))(
                                        _saveable_input(x, self.recipe)))  # [B, T, H, 3, K]
    q, k, v = (qkv[:, :, :, i] for i in range(3))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Scores and softmax in f32 (activation x activation: no FP8), output in the compute dtype.
    if cfg.remat and cfg.remat_policy != "full" and cfg.attention_impl == "cudnn":
      o = _saveable(causal_attention_saving_residuals(q, k, v, cfg.attention_impl))
    else:
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                       implementation=cfg.attention_impl)
    out_std = std / np.sqrt(2 * cfg.n_layers)
    return _saveable(nn.DenseGeneral(cfg.d_model, axis=(-2, -1), name="out",
                                     **_dense_kwargs(cfg, self.recipe, out_std))(
                                         _saveable_input(o, self.recipe)))


class MLP(nn.Module):
  """GELU or SwiGLU MLP: x[B, T, D] -> [B, T, D]; projections through the FP8 GEMM."""

  config: ModelConfig
  recipe: Recipe | None

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    std = cfg.d_model ** -0.5
    out_std = cfg.d_ff ** -0.5 / np.sqrt(2 * cfg.n_layers)
    out_kw = _dense_kwargs(cfg, self.recipe, out_std)
    if cfg.mlp == "gelu":
      h = _saveable(nn.Dense(cfg.d_ff, name="fc_in", **_dense_kwargs(cfg, self.recipe, std))(
          _saveable_input(x, self.recipe)))
      if self.recipe is not None and cfg.fuse_gelu_into_fp8_cast:  # GELU inside the FP8 cast
        out_kw["dot_general_cls"] = functools.partial(Fp8DotGeneral, recipe=self.recipe,
                                                      lhs_activation="gelu")
      else:
        h = nn.gelu(h)
    else:  # gate and up projections fused into one GEMM: [B, T, F, 2] (F first: see qkv)
      gu = _saveable(nn.DenseGeneral((cfg.d_ff, 2), name="fc_gate_in",
                                     **_dense_kwargs(cfg, self.recipe, std))(
                                         _saveable_input(x, self.recipe)))
      h = nn.silu(gu[..., 0]) * gu[..., 1]
    return _saveable(nn.Dense(cfg.d_model, name="fc_out", **out_kw)(
        _saveable_input(h, self.recipe)))


class Block(nn.Module):
  """One pre-norm decoder layer, in scan form: (x[B, T, D], (cos, sin)) -> (x, None)."""

  config: ModelConfig
  recipe: Recipe | None
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, rope):
    cfg = self.config
    drop = nn.Dropout(cfg.dropout_rate, deterministic=self.deterministic)
    h = Attention(cfg, self.recipe, name="attn")(_norm(cfg, "norm_attn")(x), *rope)
    x = x + drop(h)
    h = MLP(cfg, self.recipe, name="mlp")(_norm(cfg, "norm_mlp")(x))
    return x + drop(h), None


class GPT(nn.Module):
  """Decoder LM: tokens int[B, T] -> logits f32[B, T, V].

  Attributes:
    config: the model's :class:`ModelConfig`.
    recipe: FP8 recipe of every projection; None runs BF16 GEMMs (level O0).
  """

  config: ModelConfig
  recipe: Recipe | None = None

  @nn.compact
  def __call__(self, tokens, deterministic: bool = True):
    cfg = self.config
    _check_tokens(tokens, cfg)
    dtype = jnp.dtype(cfg.dtype)
    embed = Embed(cfg.vocab_size, cfg.d_model, dtype=dtype,
                     param_dtype=jnp.dtype(cfg.param_dtype),
                     embedding_init=nn.initializers.normal(0.02), name="embed")
    x = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(embed(tokens))
    rope = rope_tables(tokens.shape[1], cfg.head_dim, cfg.rope_base)
    x = self._layer_stack(x, rope, deterministic)
    x = _norm(cfg, "norm_final")(x)
    if cfg.tie_embeddings:
      return embed.attend(x).astype(jnp.float32)
    return self._head(x)

  def _layer_stack(self, x, rope, deterministic: bool):
    """x[B, T, D] through the n_layers blocks: under nn.scan, or (``scan_layers=False``, when
    no collection is being written) unrolled over layer slices of the same stacked variables."""
    writing = self.is_initializing() or any(
        self.is_mutable_collection(c) for c in (HEALTH_COLLECTION, PERTURBATIONS))
    if self.config.scan_layers or writing:
      return self._layers(deterministic)(x, rope)[0]
    return self._unrolled(x, rope, deterministic)

  def _unrolled(self, x, rope, deterministic: bool):
    """The blocks as n_layers calls, each on its layer's slice of the variables nn.scan
    created (same parameters, same math). Residuals the backward keeps are then separate
    buffers, not layer slices of stacked ones that a scan zero-fills, writes and reads back
    with device copies."""
    cfg = self.config
    stacked = {c: v["layers"] for c, v in self.variables.items()
               if isinstance(v, Mapping) and "layers" in v}
    block = Block(cfg, self.recipe, deterministic, parent=None)
    dropout = not deterministic and cfg.dropout_rate > 0
    rngs = jax.random.split(self.make_rng("dropout"), cfg.n_layers) if dropout else None

    def layer(variables, x, rope, rng):
      return block.apply(variables, x, rope, rngs={"dropout": rng} if dropout else None)[0]

    if cfg.remat:  # outside a scan's loop XLA would merge the recomputation into the forward
      layer = jax.checkpoint(layer, prevent_cse=True, policy=remat_policy(cfg))
    for i, variables in enumerate(unstack_layers(stacked, cfg.n_layers)):
      x = layer(variables, x, rope, None if rngs is None else rngs[i])
    return x

  def _layers(self, deterministic: bool) -> nn.Module:
    """The n_layers blocks under nn.scan (and nn.remat when configured)."""
    block = Block
    if self.config.remat:
      block = nn.remat(Block, prevent_cse=False, policy=remat_policy(self.config))
    stacked = {"params": 0, FP8_COLLECTION: 0, HEALTH_COLLECTION: 0, PERTURBATIONS: 0,
               WEIGHT_CAST_COLLECTION: 0}
    scanned = nn.scan(block, variable_axes=stacked,
                      split_rngs={"params": True, "dropout": True},
                      in_axes=nn.broadcast, length=self.config.n_layers)
    return scanned(self.config, self.recipe, deterministic, name="layers")

  def _head(self, x):
    """LM head x[B, T, D] -> f32[B, T, V] (the GEMM writes f32 directly)."""
    cfg = self.config
    kw = _dense_kwargs(cfg, None, cfg.d_model ** -0.5)
    kw["dot_general_cls"] = _f32_out_gemm(self.recipe)
    return nn.Dense(cfg.vocab_size, name="head", **kw)(x).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def unstack_layers(stacked, n_layers: int) -> tuple:
  """The n_layers layer slices of stacked variables (leaves [L, ...] -> L trees of [...]).

  Gradient: the layers' gradients stacked into one buffer (one copy each), behind an
  optimization barrier: without it XLA sums L zero-padded layer gradients and fuses the
  consumers' reductions (the gradient norm) into that sum, which ran 21 ms per 1.3B step."""
  return tuple(jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(n_layers))


def _unstack_fwd(stacked, n_layers):
  return unstack_layers(stacked, n_layers), None


def _unstack_bwd(n_layers, _, grads):
  def stack(*g):
    if g[0].dtype == jax.dtypes.float0:  # integer variables: no gradient
      return np.zeros((n_layers,) + g[0].shape, jax.dtypes.float0)
    return jnp.stack(g)
  return (lax.optimization_barrier(jax.tree.map(stack, *grads)),)


unstack_layers.defvjp(_unstack_fwd, _unstack_bwd)


def remat_policy(config: ModelConfig):
  """The ``jax.checkpoint`` policy of `config`'s remat: the names it saves (None: nothing)."""
  names = ((WEIGHT_CAST_NAME,) if config.remat_save_fp8_weights else ()) + \
      _SAVED_NAMES[config.remat_policy]
  return jax.checkpoint_policies.save_only_these_names(*names) if names else None


def _check_tokens(tokens, cfg: ModelConfig) -> None:
  """Raises ValueError for tokens that are not int[B, T] with 1 <= T <= max_seq_len."""
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"GPT: tokens must be an integer array [batch, seq_len], got "
                     f"{tokens.dtype}{list(tokens.shape)}")
  if not 1 <= tokens.shape[1] <= cfg.max_seq_len:
    raise ValueError(f"GPT: seq_len={tokens.shape[1]} is not allowed; use 1.."
                     f"{cfg.max_seq_len} (ModelConfig.max_seq_len)")


def next_token_loss(logits, targets):
  """Mean cross entropy (nats/token) of logits f32[B, T, V] against int targets[B, T]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.mean(jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1))


def param_count(params) -> int:
  """Number of parameter scalars in `params` (pass ``variables["params"]``)."""
  return int(sum(np.prod(np.shape(a), dtype=np.int64) for a in jax.tree.leaves(params)))


def matmul_param_count(config: ModelConfig) -> int:
  """Weights that take part in a GEMM per token: all projections and the LM head
  (also when tied); not the embedding lookup, norms."""
  d, f = config.d_model, config.d_ff
  mlp = (3 if config.mlp == "swiglu" else 2) * d * f
  return config.n_layers * (4 * d * d + mlp) + d * config.vocab_size


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward, no recomputation), for MFU.

  ``6 * N + 12 * n_layers * d_model * seq_len`` with N = :func:`matmul_param_count`; the
  attention term counts QK^T and AV over the full T x T square (PaLM's convention, no causal
  halving).
  """
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ValueError(f"flops_per_token: seq_len={seq_len!r} is not allowed; use an integer >= 1")
  return float(6 * matmul_param_count(config) + 12 * config.n_layers * config.d_model * seq_len)


def init_model(config: ModelConfig, recipe: Recipe | None, key, batch_size: int,
               seq_len: int) -> dict:
  """Variables of ``GPT(config, recipe)`` for int32[batch_size, seq_len] inputs:
  ``{"params": ...}`` plus ``{FP8_COLLECTION: ...}`` when `recipe` is given. Jitted and
  cached per (config, recipe, shape)."""
  for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"init_model: {name}={value!r} is not allowed; use an integer >= 1")
  return _init(config, recipe, key, int(batch_size), int(seq_len))


@functools.partial(jax.jit, static_argnums=(0, 1, 3, 4))
def _init(config, recipe, key, batch_size, seq_len):
  return GPT(config, recipe).init(key, jnp.zeros((batch_size, seq_len), jnp.int32))
