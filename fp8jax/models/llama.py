"""The LLaMA family (LLaMA 2/3 architecture) written only against fp8jax's public API.

Pre-norm blocks with RMSNorm (f32), rotary position embeddings in the rotate-half layout
(optionally with LLaMA-3's frequency scaling), causal attention with grouped key/value heads
(GQA: ``n_kv_heads`` dividing ``n_heads``), a SwiGLU MLP, no biases, tied or untied
embeddings. The blocks, FP8 GEMM wiring, LM head, scanned / unrolled layers and remat
policies are those of :mod:`fp8jax.models.layers`, shared with the GPT family: every
projection (fused qkv, attention output, fused gate/up, down, the LM head unless tied) is an
FP8 GEMM when a recipe is given. Hugging Face checkpoints convert to and from this module's
parameters with :mod:`fp8jax.interop.hf`.

Shapes: B batch, T sequence, D d_model, H heads, KV key/value heads, K head dim (D / H),
F d_ff, V vocab.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import Recipe
from fp8jax.models import layers
from fp8jax.models.layers import ATTENTION_IMPLS, DTYPES, PARAM_DTYPES, REMAT_POLICIES
from fp8jax.parallel.layout_rules import tensor_message
from fp8jax.parallel.tensor import Rule

_POSITIVE = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff",
             "max_seq_len")
ROPE_SCALING_TYPES = ("llama3",)

# Tensor-parallel rules (fp8jax.parallel.tensor's format: path piece, dimension from the end,
# the kernel's rank): the fused qkv kernel [.., D, KV, G+2, K] splits its key/value heads
# (with their query heads), the output kernel [.., H, K, D] its heads (column, then row
# parallel); the fused gate/up kernel [.., D, F, 2] and the down kernel [.., F, D] split F.
LLAMA_RULES: tuple[Rule, ...] = (
    ("['attn']['qkv']['kernel']", -3, 4),
    ("['attn']['out']['kernel']", -3, 3),
    ("['mlp']['fc_gate_in']['kernel']", -2, 3),
    ("['mlp']['fc_out']['kernel']", -2, 2),
)


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
  """LLaMA-3's RoPE frequency scaling (Hugging Face ``rope_type: "llama3"``).

  With wavelength ``w = 2 pi / f`` of an inverse frequency f, ``lo = original / low_freq_factor``
  and ``hi = original / high_freq_factor``: f stays where ``w < hi``, becomes ``f / factor``
  where ``w > lo``, and in between ``(1 - s) f / factor + s f`` with
  ``s = (original / w - low_freq_factor) / (high_freq_factor - low_freq_factor)``.

  Attributes:
    factor: how much longer the context is than the original one (>= 1).
    low_freq_factor, high_freq_factor: band edges, 0 < low < high.
    original_max_position_embeddings: the context length the frequencies were trained for.
  """

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    owner = "LlamaConfig.rope_scaling"
    layers.check_float(owner, "factor", self.factor, lambda v: v >= 1, "a number >= 1")
    layers.check_float(owner, "low_freq_factor", self.low_freq_factor, lambda v: v > 0,
                       "a number > 0")
    layers.check_float(owner, "high_freq_factor", self.high_freq_factor,
                       lambda v: v > self.low_freq_factor,
                       f"a number > low_freq_factor={self.low_freq_factor}")
    layers.check_int(owner, "original_max_position_embeddings",
                     self.original_max_position_embeddings)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Llama3RopeScaling":
    """From a mapping of the attributes, optionally with ``rope_type`` (or its older name
    ``type``) "llama3" as Hugging Face writes it; any other key is refused."""
    d = dict(d)
    kind = d.pop("rope_type", d.pop("type", "llama3"))
    if kind not in ROPE_SCALING_TYPES:
      raise ValueError(f"LlamaConfig.rope_scaling type {kind!r} is not supported; use one of "
                       f"{list(ROPE_SCALING_TYPES)} or no scaling (None)")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(names))
    if unknown:
      raise ValueError(f"LlamaConfig.rope_scaling keys {unknown} are not allowed; use "
                       f"{names} (and rope_type='llama3')")
    return cls(**d)

  def to_dict(self) -> dict:
    """Hugging Face's form: the attributes and ``rope_type: "llama3"``."""
    return {**dataclasses.asdict(self), "rope_type": "llama3"}

  def __call__(self, inv_freq: np.ndarray) -> np.ndarray:
    """The scaled inverse frequencies (float64, same shape)."""
    inv_freq = np.asarray(inv_freq, np.float64)
    wavelen = 2 * np.pi / inv_freq
    old = self.original_max_position_embeddings
    s = (old / wavelen - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
    mid = (1 - s) * inv_freq / self.factor + s * inv_freq
    out = np.where(wavelen > old / self.low_freq_factor, inv_freq / self.factor, mid)
    return np.where(wavelen < old / self.high_freq_factor, inv_freq, out)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
  """Shape and numerics of a :class:`Llama`. Field names are those of
  ``fp8jax.models.gpt.ModelConfig`` where the meaning is the same.

  Attributes:
    vocab_size: number of token ids.
    d_model, n_layers, n_heads, d_ff: widths and depth (d_ff: the SwiGLU hidden width);
      d_model % n_heads == 0 and the head dim d_model / n_heads must be even (RoPE).
    n_kv_heads: key/value heads (GQA); must divide n_heads (n_heads: multi-head attention,
      1: multi-query attention).
    max_seq_len: longest sequence accepted.
    rope_theta: RoPE frequency base.
    rope_scaling: None, or LLaMA-3's frequency scaling (:class:`Llama3RopeScaling`; a mapping
      of its fields, optionally with ``rope_type: llama3``, is converted).
    norm_eps: RMSNorm epsilon.
    tie_embeddings: the LM head reuses the embedding matrix (then it is a BF16 GEMM).
    fp8_head, remat, remat_policy, remat_save_fp8_weights, scan_layers, dtype, param_dtype,
    dropout_rate, attention_impl: as in ``fp8jax.models.gpt.ModelConfig``.
  """

  vocab_size: int = 256
  d_model: int = 256
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 4
  d_ff: int = 768
  max_seq_len: int = 256
  rope_theta: float = 10000.0
  rope_scaling: Llama3RopeScaling | None = None
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  fp8_head: bool = False
  remat: bool = False
  remat_policy: str = "auto"
  scan_layers: bool | str = "auto"
  remat_save_fp8_weights: bool = True
  dtype: str = "bfloat16"
  param_dtype: str = "float32"
  dropout_rate: float = 0.0
  attention_impl: str = "auto"

  def __post_init__(self):
    owner = "LlamaConfig"
    for name in _POSITIVE:
      layers.check_int(owner, name, getattr(self, name))
    if self.d_model % self.n_heads:
      raise ValueError(f"LlamaConfig.d_model={self.d_model} is not divisible by "
                       f"n_heads={self.n_heads}; use a d_model that is a multiple of n_heads")
    if (self.d_model // self.n_heads) % 2:
      raise ValueError(f"LlamaConfig head dim d_model/n_heads={self.d_model // self.n_heads} "
                       "is odd; RoPE needs an even head dim")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"LlamaConfig.n_kv_heads={self.n_kv_heads} does not divide "
                       f"n_heads={self.n_heads}; use a divisor of n_heads")
    for name, allowed in (("dtype", DTYPES), ("param_dtype", PARAM_DTYPES),
                          ("attention_impl", ATTENTION_IMPLS),
                          ("remat_policy", REMAT_POLICIES)):
      layers.check_choice(owner, name, getattr(self, name), allowed)
    for name in ("remat", "remat_save_fp8_weights", "tie_embeddings", "fp8_head"):
      layers.check_bool(owner, name, getattr(self, name))
    layers.check_bool_or_auto(owner, "scan_layers", self.scan_layers)
    layers.check_fp8_head(owner, self)
    layers.check_float(owner, "rope_theta", self.rope_theta, lambda v: v > 1, "a number > 1")
    layers.check_float(owner, "norm_eps", self.norm_eps, lambda v: 0 < v < 1,
                       "a number in (0, 1)")
    layers.check_float(owner, "dropout_rate", self.dropout_rate, lambda v: 0 <= v < 1,
                       "a number in [0, 1)")
    if isinstance(self.rope_scaling, Mapping):
      object.__setattr__(self, "rope_scaling", Llama3RopeScaling.from_dict(self.rope_scaling))
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
      raise ValueError(f"LlamaConfig.rope_scaling={self.rope_scaling!r} is not allowed; use "
                       "None, a Llama3RopeScaling or a mapping of its fields")

  @property
  def head_dim(self) -> int:
    """K = d_model // n_heads."""
    return self.d_model // self.n_heads

  @property
  def mlp(self) -> str:
    """Always "swiglu"."""
    return "swiglu"

  @property
  def norm(self) -> str:
    """Always "rmsnorm"."""
    return "rmsnorm"

  @property
  def fuse_gelu_into_fp8_cast(self) -> bool:
    """Always False (no GELU)."""
    return False

  def replace(self, **changes) -> "LlamaConfig":
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)


class Llama(layers.Decoder):
  """LLaMA decoder LM: tokens int[B, T] -> logits f32[B, T, V].

  Attributes:
    config: the model's :class:`LlamaConfig`.
    recipe: FP8 recipe of every projection; None runs BF16 GEMMs (level O0).
  """

  config: LlamaConfig
  recipe: Recipe | None = None

  def rope(self, seq_len: int):
    """(cos, sin), each f32[seq_len, head_dim / 2]: base ``rope_theta``, frequencies scaled
    by ``rope_scaling`` when set."""
    cfg = self.config
    return layers.rope_tables(seq_len, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def matmul_param_count(config: LlamaConfig) -> int:
  """Weights that take part in a GEMM per token: all projections and the LM head
  (also when tied); not the embedding lookup, norms."""
  d, f, k = config.d_model, config.d_ff, config.head_dim
  attn = d * (config.n_heads + 2 * config.n_kv_heads) * k + config.n_heads * k * d
  return config.n_layers * (attn + 3 * d * f) + d * config.vocab_size


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
  """Training FLOPs per token (forward + backward, no recomputation), for MFU.

  ``6 * N + 12 * n_layers * n_heads * head_dim * seq_len`` with N =
  :func:`matmul_param_count` (grouped key/value heads make N smaller, not the attention
  term); the attention term counts QK^T and AV over the full T x T square (PaLM's
  convention, no causal halving).
  """
  return float(6 * matmul_param_count(config) + layers.attention_flops_per_token(config, seq_len))


def tensor_splits(config: LlamaConfig) -> tuple[tuple[str, int], ...]:
  """The sizes LLaMA's tensor rules split over "tensor": the key/value heads (and with them
  the query heads, a multiple of them) and the MLP width."""
  return (("model.n_kv_heads", config.n_kv_heads), ("model.d_ff", config.d_ff))


def check_tensor_parallel(config: LlamaConfig, tensor: int) -> None:
  """Raises ValueError when `config` does not split `tensor` ways (:func:`tensor_splits`
  must divide)."""
  message = tensor_message(tensor_splits(config), tensor)
  if message:
    raise ValueError(message)


def init_model(config: LlamaConfig, recipe: Recipe | None, key, batch_size: int,
               seq_len: int) -> dict:
  """Variables of ``Llama(config, recipe)`` for int32[batch_size, seq_len] inputs:
  ``{"params": ...}`` plus ``{FP8_COLLECTION: ...}`` when `recipe` is given. Jitted and
  cached per (config, recipe, shape)."""
  layers.check_init_shape(batch_size, seq_len)
  return _init(config, recipe, key, int(batch_size), int(seq_len))


@functools.partial(jax.jit, static_argnums=(0, 1, 3, 4))
def _init(config, recipe, key, batch_size, seq_len):
  return Llama(config, recipe).init(key, jnp.zeros((batch_size, seq_len), jnp.int32))
