"""A GPT-style decoder LM written only against fp8jax's public API.

Pre-norm blocks (RMSNorm or LayerNorm, computed in f32), rotary position embeddings, causal
multi-head attention (scores and softmax in f32) and a GELU or SwiGLU MLP. Every projection
of the blocks (fused qkv, attention output, MLP in/gate/out) is an ``nn.Dense`` /
``nn.DenseGeneral`` whose GEMM is :class:`fp8jax.linen.Fp8DotGeneral` when a recipe is given
(the untied LM head too with ``fp8_head``; by default it stays BF16 with f32 output);
embeddings, norms, softmax and the activation x activation attention matmuls stay in the
compute dtype (BF16) / f32, as MS-AMP does. Layers run under ``nn.scan`` (parameters and FP8
state stacked on a leading layer axis) and optionally ``nn.remat`` (which by default keeps
the FP8 weight casts of the forward for the backward, see ``remat_save_fp8_weights``; with
``remat_policy="save_gemm_outputs"`` it also keeps the projection outputs the backward needs
and, with cuDNN attention, the attention's residuals, so only the elementwise work and the FP8
casts are recomputed; ``"save_gemm_io"`` keeps the projections' input casts too). With
``scan_layers=False`` the same stacked variables are used unrolled, one layer slice per call
(:func:`unstack_layers`). The blocks are those of :mod:`fp8jax.models.layers` (shared with
the LLaMA family); their names stay importable from here.

Shapes: B batch, T sequence, D d_model, H heads, K head dim (D / H), F d_ff, V vocab.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from fp8jax import Recipe
from fp8jax.models import layers
from fp8jax.models.layers import (ATTENTION_IMPLS, ATTENTION_RESIDUALS_NAME, DTYPES,
                                  GEMM_INPUT_NAME, GEMM_OUTPUT_NAME, MLP, PARAM_DTYPES,
                                  REMAT_POLICIES, Attention, Block, Embed, apply_rope,
                                  causal_attention_saving_residuals,
                                  remat_policy, rope_tables, unstack_layers)

__all__ = ["ATTENTION_IMPLS", "ATTENTION_RESIDUALS_NAME", "DTYPES", "GEMM_INPUT_NAME",
           "GEMM_OUTPUT_NAME", "GPT", "MLP", "MLPS", "ModelConfig", "NORMS", "PARAM_DTYPES",
           "REMAT_POLICIES", "Attention", "Block", "Embed", "apply_rope",
           "causal_attention_saving_residuals", "flops_per_token", "init_model",
           "matmul_param_count", "remat_policy", "rope_tables",
           "unstack_layers"]

MLPS = ("gelu", "swiglu")
NORMS = ("rmsnorm", "layernorm")
_POSITIVE = ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len")
NORM_EPS = 1e-6


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
      only the norms, RoPE and the activation their backward passes need). "auto" (default):
      chosen with scan_layers by ``fp8jax.train.build.resolve_auto`` (the Trainer) from the
      device's memory; a model given "auto" unresolved runs "full".
    scan_layers: True runs the layers under ``nn.scan``; False unrolls them over layer slices
      of the same stacked variables (same parameters), so the residuals the backward keeps
      are separate buffers rather than slices of stacked ones (no zero-fill, no device copy
      per residual and layer); longer compiles. Applies where no collection is written
      (initialization and FP8-health probes keep the scan); dropout masks differ from the
      scan's. "auto" (default): chosen by ``fp8jax.train.build.resolve_auto``; a model given
      "auto" unresolved scans.
    remat_save_fp8_weights: with remat, keep each FP8 GEMM's weight cast from the forward
      (1 byte per weight, all layers) instead of casting the weights again in the
      recomputation (``fp8jax.dot.SAVE_FP8_WEIGHTS``); bit-identical results. No effect
      without remat or without a recipe.
    fuse_gelu_into_fp8_cast: with a recipe and the GELU MLP, fc_out's FP8 GEMM takes fc_in's
      output and applies GELU inside its input cast (``Fp8DotGeneral(lhs_activation="gelu")``;
      with the fused cast kernel the bf16 activation is never written). GELU is then computed
      in f32 and rounded once (``nn.gelu`` on bf16 rounds its intermediates; on GPUs the
      kernel's tanh is the hardware's approximate one): close to, not bit-identical with, the
      unfused model. "auto" (default): on for the GELU MLP
      (:func:`fp8jax.models.layers.fuses_gelu`).
    dtype: compute dtype name of activations and BF16 GEMMs ("bfloat16", "float32", ...).
    param_dtype: storage dtype name of parameters.
    tie_embeddings: the LM head reuses the embedding matrix (then it is a BF16 GEMM).
    fp8_head: the untied LM head's GEMM in FP8 too when the model has a recipe. False
      (default): the head runs in BF16 with f32 output at every level, as
      ``fp8jax.convert``'s ``keep_head`` keeps it (the logits and their gradient, the
      softmax's output minus the targets, are the tensors a per-tensor FP8 scale serves worst).
    rope_theta: RoPE frequency base.
    dropout_rate: dropout on embeddings and residual branches (training only).
    attention_impl: ``jax.nn.dot_product_attention`` implementation, "xla" or "cudnn";
      "auto" (default): cuDNN flash attention where it runs this shape and dtype on the
      device, else XLA's (:func:`fp8jax.models.layers.attention_impl_for`).
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
  remat_policy: str = "auto"
  scan_layers: bool | str = "auto"
  remat_save_fp8_weights: bool = True
  fuse_gelu_into_fp8_cast: bool | str = "auto"
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  tie_embeddings: bool = False
  fp8_head: bool = False
  rope_theta: float = 10000.0
  dropout_rate: float = 0.0
  attention_impl: str = "auto"

  def __post_init__(self):
    for name in _POSITIVE:
      layers.check_int("ModelConfig", name, getattr(self, name))
    if self.d_model % self.n_heads:
      raise ValueError(f"ModelConfig.d_model={self.d_model} is not divisible by "
                       f"n_heads={self.n_heads}; use a d_model that is a multiple of n_heads")
    if (self.d_model // self.n_heads) % 2:
      raise ValueError(f"ModelConfig head dim d_model/n_heads={self.d_model // self.n_heads} is "
                       "odd; RoPE needs an even head dim")
    for name, allowed in (("mlp", MLPS), ("norm", NORMS), ("dtype", DTYPES),
                          ("param_dtype", PARAM_DTYPES), ("attention_impl", ATTENTION_IMPLS),
                          ("remat_policy", REMAT_POLICIES)):
      layers.check_choice("ModelConfig", name, getattr(self, name), allowed)
    for name in ("remat", "remat_save_fp8_weights", "tie_embeddings", "fp8_head"):
      layers.check_bool("ModelConfig", name, getattr(self, name))
    for name in ("scan_layers", "fuse_gelu_into_fp8_cast"):
      layers.check_bool_or_auto("ModelConfig", name, getattr(self, name))
    layers.check_fp8_head("ModelConfig", self)
    if self.fuse_gelu_into_fp8_cast != layers.AUTO and self.fuse_gelu_into_fp8_cast \
        and self.mlp != "gelu":
      raise ValueError(f"ModelConfig.fuse_gelu_into_fp8_cast=True needs mlp='gelu', got "
                       f"mlp={self.mlp!r} (the SwiGLU MLP applies its activation inside the FP8 "
                       "casts at FP8 levels without this switch)")
    layers.check_float("ModelConfig", "rope_theta", self.rope_theta, lambda v: v > 1,
                       "a number > 1")
    layers.check_float("ModelConfig", "dropout_rate", self.dropout_rate,
                       lambda v: 0 <= v < 1, "a number in [0, 1)")

  @property
  def head_dim(self) -> int:
    """K = d_model // n_heads."""
    return self.d_model // self.n_heads

  @property
  def n_kv_heads(self) -> int:
    """Key/value heads: one per query head (multi-head attention)."""
    return self.n_heads

  @property
  def norm_eps(self) -> float:
    """The norms' epsilon."""
    return NORM_EPS

  def replace(self, **changes) -> "ModelConfig":
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)


class GPT(layers.Decoder):
  """Decoder LM: tokens int[B, T] -> logits f32[B, T, V].

  Attributes:
    config: the model's :class:`ModelConfig`.
    recipe: FP8 recipe of every projection; None runs BF16 GEMMs (level O0).
  """

  config: ModelConfig
  recipe: Recipe | None = None

  def rope(self, seq_len: int):
    """(cos, sin), each f32[seq_len, head_dim / 2], base ``config.rope_theta``."""
    return rope_tables(seq_len, self.config.head_dim, self.config.rope_theta)


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
  return float(6 * matmul_param_count(config) + layers.attention_flops_per_token(config, seq_len))


def init_model(config: ModelConfig, recipe: Recipe | None, key, batch_size: int,
               seq_len: int) -> dict:
  """Variables of ``GPT(config, recipe)`` for int32[batch_size, seq_len] inputs:
  ``{"params": ...}`` plus ``{FP8_COLLECTION: ...}`` when `recipe` is given. Jitted and
  cached per (config, recipe, shape)."""
  layers.check_init_shape(batch_size, seq_len)
  return _init(config, recipe, key, int(batch_size), int(seq_len))


@functools.partial(jax.jit, static_argnums=(0, 1, 3, 4))
def _init(config, recipe, key, batch_size, seq_len):
  return GPT(config, recipe).init(key, jnp.zeros((batch_size, seq_len), jnp.int32))
