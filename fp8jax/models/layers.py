"""Building blocks shared by the decoder families (:mod:`fp8jax.models.gpt`,
:mod:`fp8jax.models.llama`), written only against fp8jax's public API.

Every projection is an ``nn.Dense`` / ``nn.DenseGeneral`` whose GEMM is
:class:`fp8jax.linen.Fp8DotGeneral` when a recipe is given; embeddings, norms, softmax and the
activation x activation attention matmuls stay in the compute dtype (BF16) / f32, as MS-AMP
does. :class:`Decoder` is the whole LM: embedding, the layers under ``nn.scan`` (or unrolled
over the scan's stacked variables), the final norm and the LM head; :class:`DecoderParts`
(``Decoder.parts()``) is the same LM cut into those pieces for pipeline parallelism.

A family's config is a frozen dataclass with (as fields or properties): vocab_size, d_model,
n_layers, n_heads, n_kv_heads (dividing n_heads), head_dim, d_ff, max_seq_len, mlp ("gelu" |
"swiglu"), norm ("rmsnorm" | "layernorm"), norm_eps, remat, remat_policy,
remat_save_fp8_weights, scan_layers, fuse_gelu_into_fp8_cast, dtype, param_dtype,
tie_embeddings, fp8_head, dropout_rate, attention_impl. attention_impl, remat_policy and scan_layers
may be "auto": the attention then resolves for this process's device when traced
(:func:`attention_impl_for`), the remat policy runs "full" and the layers the scan, unless
``fp8jax.train.build.resolve_auto`` resolved them for a run first.

Parameter tree (L layers stacked on a leading axis; G = n_heads / n_kv_heads): ``embed``
{embedding [V, D]}, ``layers`` {``norm_attn``, ``attn`` {``qkv`` kernel [L, D, n_kv_heads, G + 2,
K], ``out`` kernel [L, n_heads, K, D]}, ``norm_mlp``, ``mlp`` {``fc_in`` [L, D, F] or
``fc_gate_in`` [L, D, F, 2], ``fc_out`` [L, F, D]}}, ``norm_final``, ``head`` {kernel [D, V]}
unless tied. The fused qkv kernel holds, per key/value head, its G query heads, then its key
and its value head, so a tensor-parallel split over the key/value heads is a contiguous block
of the GEMM's output columns; query head h attends with key/value head h // G.

Shapes: B batch, T sequence, D d_model, H heads, K head dim, F d_ff, V vocab.
"""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, Callable, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp8jax import FP8_COLLECTION, Recipe, fsdp
from fp8jax.dot import GEMM_OUTPUT_NAME, INPUT_CAST_NAME, WEIGHT_CAST_NAME
from fp8jax.hardware import DeviceReport, cudnn_attention_head_dim, local_report
from fp8jax.kernels.cast_transpose import activate
from fp8jax.linen import (CALIBRATION_COLLECTION, HEALTH_COLLECTION, PERTURBATIONS,
                          WEIGHT_CAST_COLLECTION, DotGeneral, Fp8DotGeneral, dense_mlp,
                          dense_mlp_reason)
from fp8jax.models.stack_parts import merge_stack, split_stack

DTYPES = ("bfloat16", "float32", "float16")
PARAM_DTYPES = ("float32", "bfloat16")
AUTO = "auto"
ATTENTION_IMPLS = (AUTO, "xla", "cudnn")
REMAT_POLICIES = (AUTO, "full", "save_gemm_outputs", "save_gemm_io")
CUDNN_DTYPES = ("bfloat16", "float16")  # compute dtypes cuDNN flash attention takes
# checkpoint_names that remat_policy="save_gemm_outputs" saves: every projection's output and
# the attention's backward residuals (causal_attention_saving_residuals); "save_gemm_io" also
# every projection's input: its FP8 cast (fp8jax.dot.INPUT_CAST_NAME) with a recipe, else the
# bf16 input itself (GEMM_INPUT_NAME).
GEMM_INPUT_NAME = "fp8jax_gemm_input"
ATTENTION_RESIDUALS_NAME = "fp8jax_attention_residuals"
_SAVED_NAMES = {
    "full": (),
    "save_gemm_outputs": (GEMM_OUTPUT_NAME, ATTENTION_RESIDUALS_NAME),
    "save_gemm_io": (GEMM_OUTPUT_NAME, ATTENTION_RESIDUALS_NAME, GEMM_INPUT_NAME,
                     INPUT_CAST_NAME),
}


# ----------------------------------------------------------------------------- validation

def check_int(owner: str, name: str, value: Any) -> None:
  """Raises ValueError unless `value` is an integer >= 1 (`owner`: the config class name)."""
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    raise ValueError(f"{owner}.{name}={value!r} is not allowed; use an integer >= 1")


def check_choice(owner: str, name: str, value: Any, allowed: tuple) -> None:
  """Raises ValueError unless `value` is one of `allowed`."""
  if value not in allowed:
    raise ValueError(f"{owner}.{name}={value!r} is not allowed; use one of {list(allowed)}")


def check_float(owner: str, name: str, value: Any, ok: Callable[[float], bool],
                allowed: str) -> None:
  """Raises ValueError unless `value` is a finite real number with ``ok(value)``."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
      or not np.isfinite(value) or not ok(value):
    raise ValueError(f"{owner}.{name}={value!r} is not allowed; use {allowed}")


def check_bool(owner: str, name: str, value: Any) -> None:
  """Raises ValueError unless `value` is a bool."""
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{owner}.{name}={value!r} is not allowed; use True or False")


def check_bool_or_auto(owner: str, name: str, value: Any) -> None:
  """Raises ValueError unless `value` is True, False or "auto"."""
  if not (isinstance(value, (bool, np.bool_)) or value == AUTO):
    raise ValueError(f"{owner}.{name}={value!r} is not allowed; use True, False or {AUTO!r}")


def check_fp8_head(owner: str, config) -> None:
  """Raises ValueError for ``fp8_head=True`` with ``tie_embeddings=True`` (the tied head is
  the embedding's BF16 GEMM: the switch would do nothing)."""
  if config.fp8_head and config.tie_embeddings:
    raise ValueError(f"{owner}.fp8_head=True has no effect with tie_embeddings=True (the tied "
                     "LM head is the embedding's BF16 GEMM); set fp8_head False or untie the "
                     "embeddings")


def check_tokens(tokens, cfg, owner: str) -> None:
  """Raises ValueError for tokens that are not int[B, T] with 1 <= T <= cfg.max_seq_len."""
  if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{owner}: tokens must be an integer array [batch, seq_len], got "
                     f"{tokens.dtype}{list(tokens.shape)}")
  if not 1 <= tokens.shape[1] <= cfg.max_seq_len:
    raise ValueError(f"{owner}: seq_len={tokens.shape[1]} is not allowed; use 1.."
                     f"{cfg.max_seq_len} ({type(cfg).__name__}.max_seq_len)")


# ----------------------------------------------------------------------------- "auto" settings

def cudnn_attention_reason(config, device: DeviceReport) -> str | None:
  """None when cuDNN flash attention runs `config`'s causal attention on `device`
  (:func:`fp8jax.hardware.cudnn_attention_head_dim`: a CUDA GPU of compute capability >= 8.0;
  compute dtype bfloat16 or float16; head dim a multiple of 8 within the device's limit),
  else why not."""
  if device.platform != "gpu":
    return f"no cuDNN on {device.platform}"
  k_max = cudnn_attention_head_dim(device)
  if k_max is None:
    return (f"no cuDNN flash attention on {device.device_kind!r} (compute capability "
            f"{device.compute_capability}; it needs a CUDA GPU of 8.0 or later)")
  if config.dtype not in CUDNN_DTYPES:
    return f"compute dtype {config.dtype} (cuDNN attention: {' or '.join(CUDNN_DTYPES)})"
  k = config.head_dim
  if k % 8 or k > k_max:
    return f"head dim {k} (cuDNN attention: a multiple of 8, at most {k_max})"
  return None


@functools.cache
def local_device() -> DeviceReport:
  """This process's first local device, as a :class:`fp8jax.hardware.DeviceReport`."""
  return local_report(jax.local_devices()[:1])


def attention_impl_for(config, device: DeviceReport | None = None) -> str:
  """`config`'s attention implementation: "xla" or "cudnn" as configured; for "auto",
  "cudnn" where :func:`cudnn_attention_reason` finds none on `device` (default:
  :func:`local_device`), else "xla"."""
  if config.attention_impl != AUTO:
    return config.attention_impl
  device = local_device() if device is None else device
  return "xla" if cudnn_attention_reason(config, device) else "cudnn"


def remat_policy_name(config) -> str:
  """`config`'s remat policy; "auto" left unresolved (``fp8jax.train.build.resolve_auto``
  resolves it) is "full"."""
  return "full" if config.remat_policy == AUTO else config.remat_policy


def scans_layers(config) -> bool:
  """Whether `config`'s layers run under ``nn.scan``; "auto" left unresolved is True."""
  return config.scan_layers == AUTO or bool(config.scan_layers)


def fuses_gelu(config) -> bool:
  """Whether an FP8 model of `config` applies its MLP's GELU inside fc_out's FP8 input cast:
  ``fuse_gelu_into_fp8_cast`` True, or "auto" with the GELU MLP (on GPUs the fused cast kernel
  then never writes the activation: one pass over the F-wide hidden state fewer per layer,
  ``benchmarks/RESULTS.md``)."""
  value = config.fuse_gelu_into_fp8_cast
  return config.mlp == "gelu" and (value == AUTO or bool(value))


# ----------------------------------------------------------------------------- pieces

def saveable(y):
  """A projection's output, named for remat (see the configs' remat_policy)."""
  return checkpoint_name(y, GEMM_OUTPUT_NAME)


def saveable_input(x, recipe: Recipe | None):
  """A projection's bf16 input, named for remat when the GEMM is BF16 (with a recipe the FP8
  dot names its own cast of x: fp8jax.dot.INPUT_CAST_NAME)."""
  return checkpoint_name(x, GEMM_INPUT_NAME) if recipe is None else x


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def causal_attention_saving_residuals(q, k, v, implementation: str):
  """``jax.nn.dot_product_attention(q, k, v, is_causal=True)`` whose backward residuals (for
  cuDNN: q, k, v, the output and the softmax statistics) are named
  ``ATTENTION_RESIDUALS_NAME``, so a remat policy that saves that name does not run the
  attention forward again. (With implementation="xla" the residuals include the T x T
  probabilities: use it for tests.)"""
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def _attention_fwd(q, k, v, implementation):
  o, vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation=implementation), q, k, v)
  return o, jax.tree.map(lambda r: checkpoint_name(r, ATTENTION_RESIDUALS_NAME), vjp)


def _attention_bwd(implementation, vjp, g):
  del implementation
  return vjp(g)


causal_attention_saving_residuals.defvjp(_attention_fwd, _attention_bwd)


def dense_kwargs(config, recipe: Recipe | None, std: float, norm=None) -> dict:
  """Common nn.Dense/DenseGeneral arguments: dtypes, init N(0, std), the GEMM (FP8 with a
  recipe; both gather a ZeRO-3 weight at use); `norm` (with a recipe): the GEMM's
  ``lhs_norm`` (:func:`norm_in_cast`)."""
  kw = dict(use_bias=False, dtype=jnp.dtype(config.dtype),
            param_dtype=jnp.dtype(config.param_dtype),
            kernel_init=nn.initializers.normal(std))
  kw["dot_general_cls"] = DotGeneral if recipe is None else functools.partial(
      Fp8DotGeneral, recipe=recipe, lhs_norm=norm)
  return kw


def f32_out_gemm(recipe: Recipe | None):
  """dot_general_cls whose GEMM (FP8 when `recipe` is given, else BF16) writes f32."""
  if recipe is None:
    return lambda: functools.partial(DotGeneral(), preferred_element_type=jnp.float32)
  return lambda: functools.partial(Fp8DotGeneral(recipe=recipe),
                                   preferred_element_type=jnp.float32)


def gathered(cls, config, methods: tuple[str, ...] = ("__call__",)):
  """Module class `cls`, or under an active ``fp8jax.fsdp.WeightGather`` (ZeRO-3) `cls` whose
  `methods` read its parameters gathered (``fsdp.gather_tree``; GEMM weights in the model's
  compute dtype ``config.dtype``, FP8 kernels left to their GEMM)."""
  gather = fsdp.active()
  if gather is None:
    return cls
  trans = functools.partial(fsdp.gather_tree, gather=gather, matrix_dtype=jnp.dtype(config.dtype))
  return nn.map_variables(cls, "params", trans_in_fn=trans, methods=list(methods))


def norm_module(config, gather: bool = False, **kwargs) -> nn.Module:
  """The RMSNorm / LayerNorm module (``config.norm``, epsilon ``config.norm_eps``) computing
  in f32; `gather`: its gain is gathered at use (:func:`gathered`)."""
  cls = nn.RMSNorm if config.norm == "rmsnorm" else nn.LayerNorm
  if gather:
    cls = gathered(cls, config)
  return cls(epsilon=config.norm_eps, dtype=jnp.float32,
             param_dtype=jnp.dtype(config.param_dtype), **kwargs)


def norm(config, name: str, gather: bool = False):
  """RMSNorm / LayerNorm (:func:`norm_module`) computed in f32: x[..., D] -> [..., D] in the
  compute dtype. `gather`: its gain is gathered at use (:func:`gathered`; inside a layer the
  layer gathers it)."""
  layer = norm_module(config, gather, name=name)
  return lambda x: layer(x.astype(jnp.float32)).astype(jnp.dtype(config.dtype))


class _NormGain(nn.Module):
  """The gain ("scale" [features]) of the ``nn.RMSNorm`` of the same name, not applied."""

  features: int
  param_dtype: Any

  @nn.compact
  def __call__(self):
    return self.param("scale", nn.initializers.ones, (self.features,), self.param_dtype)


def norm_in_cast(module: nn.Module, config, recipe: Recipe | None, name: str, x):
  """``(gain, eps)`` of `module`'s RMSNorm child `name` when the GEMMs it feeds normalize x
  inside their FP8 input cast (``fp8jax.linen.Fp8DotGeneral(lhs_norm=...)``: on GPUs the
  normed tensor is never stored): FP8 GEMMs, ``config.norm == "rmsnorm"``, x in the compute
  dtype, not while initializing (the norm creates its gain). Else None: call :func:`norm`
  first. Same values either way (in bf16 up to XLA keeping a residual sum unrounded where it
  fuses it into a norm it computes itself)."""
  if (recipe is None or config.norm != "rmsnorm" or module.is_initializing()
      or x.dtype != jnp.dtype(config.dtype)):
    return None
  gain = _NormGain(x.shape[-1], jnp.dtype(config.param_dtype), name=name)()
  return gain, float(config.norm_eps)


def rope_frequencies(head_dim: int, base: float) -> np.ndarray:
  """float64[K/2]: RoPE's inverse frequencies ``base ** (-2i / K)``, i = 0..K/2-1."""
  return base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)


def rope_tables(seq_len: int, head_dim: int, base: float,
                scale_frequencies: Callable[[np.ndarray], np.ndarray] | None = None):
  """(cos, sin), each f32[T, K/2], for positions 0..T-1; `scale_frequencies` (optional)
  maps the inverse frequencies (float64[K/2]) to the ones used (e.g. LLaMA-3's scaling)."""
  inv_freq = rope_frequencies(head_dim, base)
  if scale_frequencies is not None:
    inv_freq = np.asarray(scale_frequencies(inv_freq), np.float64)
  angles = np.arange(seq_len, dtype=np.float64)[:, None] * inv_freq[None, :]
  return jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)


def apply_rope(x, cos, sin):
  """Rotates pairs (first half, second half) of x[B, T, H, K] by position; same dtype."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  c, s = cos[None, :, None, :], sin[None, :, None, :]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(x.dtype)


class Embed(nn.Embed):
  """``nn.Embed`` whose lookup is a one-hot GEMM for vocabularies of at most
  `one_hot_max_vocab` ids (4096), a gather above: inputs int[...] -> [..., features] in
  `dtype`.

  The one-hot product's gradient is one small GEMM instead of a gather's scatter-add, in which
  every row of a small vocabulary collects thousands of tokens' gradients (atomics on GPUs;
  the measured cost: benchmarks/RESULTS.md, "First measurements at default settings"). Same
  parameter ("embedding"), same values.
  """

  one_hot_max_vocab: int = 4096

  def __call__(self, inputs):
    if self.num_embeddings > self.one_hot_max_vocab:
      return super().__call__(inputs)
    one_hot = jax.nn.one_hot(inputs, self.num_embeddings, dtype=self.dtype)
    return jnp.dot(one_hot, self.embedding.astype(self.dtype))


# ----------------------------------------------------------------------------- modules

class Attention(nn.Module):
  """Causal self-attention with grouped key/value heads: x[B, T, D] -> [B, T, D];
  projections through the FP8 GEMM (one fused qkv GEMM, one output GEMM)."""

  config: Any
  recipe: Recipe | None

  @nn.compact
  def __call__(self, x, cos, sin, norm=None):
    """`norm`: None, or :func:`norm_in_cast`'s (gain, eps): x is then the norm's input,
    normalized inside the qkv GEMM's FP8 input cast."""
    cfg = self.config
    h, kv, k_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    g = h // kv
    std = cfg.d_model ** -0.5
    # Key/value heads first, so a tensor-parallel split of them is a contiguous block of the
    # GEMM's output columns (fp8jax.parallel.tensor).
    qkv = saveable(nn.DenseGeneral((kv, g + 2, k_dim), name="qkv",
                                   **dense_kwargs(cfg, self.recipe, std, norm))(
                                       saveable_input(x, self.recipe)))  # [B, T, KV, G+2, K]
    # One split: its gradient is one concatenation (three indexings would give three padded
    # copies summed). Query head h = key/value head h // G, as dot_product_attention groups.
    q, k, v = jnp.split(qkv, (g, g + 1), axis=3)
    q = q.reshape(*qkv.shape[:2], h, k_dim)
    k, v = k[:, :, :, 0], v[:, :, :, 0]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    # Scores and softmax in f32 (activation x activation: no FP8), output in the compute dtype.
    impl = attention_impl_for(cfg)
    if cfg.remat and remat_policy_name(cfg) != "full" and impl == "cudnn":
      o = saveable(causal_attention_saving_residuals(q, k, v, impl))
    else:
      o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl)
    out_std = std / np.sqrt(2 * cfg.n_layers)
    return saveable(nn.DenseGeneral(cfg.d_model, axis=(-2, -1), name="out",
                                    **dense_kwargs(cfg, self.recipe, out_std))(
                                        saveable_input(o, self.recipe)))


class MLP(nn.Module):
  """GELU or SwiGLU MLP: x[B, T, D] -> [B, T, D]; projections through the FP8 GEMM. At FP8
  levels the SwiGLU MLP, and the GELU MLP with the GELU inside the FP8 cast (``fuses_gelu``),
  run their two Dense layers as one op where ``fp8jax.linen.dense_mlp`` can (same variables;
  not while initializing, probing FP8 health, gathering ZeRO-3 weights, or inside
  ``shard_map``): the activation inside the hidden state's FP8 cast, its derivative inside
  the cast of the gradient entering the first GEMM. SwiGLU is computed in f32 and rounded once
  (``fp8jax.kernels.cast_transpose.activate``) on either path."""

  config: Any
  recipe: Recipe | None

  @nn.compact
  def __call__(self, x, norm=None):
    """`norm`: None, or :func:`norm_in_cast`'s (gain, eps): x is then the norm's input,
    normalized inside the first GEMM's FP8 input cast."""
    cfg = self.config
    std = cfg.d_model ** -0.5
    out_std = cfg.d_ff ** -0.5 / np.sqrt(2 * cfg.n_layers)
    out_kw = dense_kwargs(cfg, self.recipe, out_std)
    in_kw = dense_kwargs(cfg, self.recipe, std, norm)
    fused_gelu = cfg.mlp == "gelu" and self.recipe is not None and fuses_gelu(cfg)
    if fused_gelu and dense_mlp_reason(self, x) is None:
      # Both GEMMs as one op on the Dense layers' variables: GELU inside the hidden state's
      # FP8 cast, its derivative inside the cast of the gradient entering fc_in.
      return saveable(dense_mlp(self, x, self.recipe, "gelu", jnp.dtype(cfg.dtype),
                                norm=norm))
    swiglu_names = ("fc_gate_in", "fc_out")
    if (cfg.mlp == "swiglu" and self.recipe is not None
        and dense_mlp_reason(self, x, swiglu_names, "swiglu") is None):
      return saveable(dense_mlp(self, x, self.recipe, "swiglu", jnp.dtype(cfg.dtype),
                                swiglu_names, norm))
    if cfg.mlp == "gelu":
      h = saveable(nn.Dense(cfg.d_ff, name="fc_in", **in_kw)(
          saveable_input(x, self.recipe)))
      if fused_gelu:  # GELU inside the FP8 cast
        out_kw["dot_general_cls"] = functools.partial(Fp8DotGeneral, recipe=self.recipe,
                                                      lhs_activation="gelu")
      else:
        h = nn.gelu(h)
    else:  # gate and up projections fused into one GEMM: [B, T, F, 2] (F first: see qkv)
      gu = saveable(nn.DenseGeneral((cfg.d_ff, 2), name="fc_gate_in", **in_kw)(
                                        saveable_input(x, self.recipe)))
      h = activate(gu.reshape(*gu.shape[:-2], -1), "swiglu")  # interleaved (gate, up) pairs
    return saveable(nn.Dense(cfg.d_model, name="fc_out", **out_kw)(
        saveable_input(h, self.recipe)))


class Block(nn.Module):
  """One pre-norm decoder layer, in scan form: (x[B, T, D], (cos, sin)) -> (x, None)."""

  config: Any
  recipe: Recipe | None
  deterministic: bool = True

  @nn.compact
  def __call__(self, x, rope):
    cfg = self.config
    drop = nn.Dropout(cfg.dropout_rate, deterministic=self.deterministic)
    # Each norm inside its GEMMs' FP8 input cast where it can be, else before them.
    fused = norm_in_cast(self, cfg, self.recipe, "norm_attn", x)
    attn = Attention(cfg, self.recipe, name="attn")
    h = attn(x, *rope, norm=fused) if fused else attn(norm(cfg, "norm_attn")(x), *rope)
    x = x + drop(h)
    fused = norm_in_cast(self, cfg, self.recipe, "norm_mlp", x)
    mlp = MLP(cfg, self.recipe, name="mlp")
    h = mlp(x, norm=fused) if fused else mlp(norm(cfg, "norm_mlp")(x))
    return x + drop(h), None


class Decoder(nn.Module):
  """Decoder LM: tokens int[B, T] -> logits f32[B, T, V]. A family subclasses it and says
  how its rotary tables are made (:meth:`rope`).

  Attributes:
    config: the family's config (see the module docstring for the fields read).
    recipe: FP8 recipe of every projection (and of the untied LM head with
      ``config.fp8_head``); None runs BF16 GEMMs (level O0).
  """

  # Under an active fp8jax.fsdp.WeightGather (ZeRO-3) it gathers every sharded parameter
  # where it uses it (the uniform loop); the per-group loop runs its parts() layer-major.
  layer_stacks: ClassVar[tuple[str, ...]] = ("layers",)  # scanned: stacked along dimension 0
  config: Any
  recipe: Recipe | None = None

  def rope(self, seq_len: int):
    """(cos, sin), each f32[seq_len, head_dim / 2]."""
    raise NotImplementedError

  @nn.compact
  def __call__(self, tokens, deterministic: bool = True):
    cfg = self.config
    check_tokens(tokens, cfg, type(self).__name__)
    embed = gathered(Embed, cfg, ("__call__", "attend"))(**embed_kwargs(cfg), name="embed")
    x = nn.Dropout(cfg.dropout_rate, deterministic=deterministic)(embed(tokens))
    x = self._layer_stack(x, self.rope(tokens.shape[1]), deterministic)
    x = norm(cfg, "norm_final", gather=True)(x)
    if cfg.tie_embeddings:
      return embed.attend(x).astype(jnp.float32)
    return self._head(x)

  def _layer_stack(self, x, rope, deterministic: bool):
    """x[B, T, D] through the n_layers blocks: under nn.scan, or (``scan_layers=False``, when
    no collection is being written) unrolled over layer slices of the same stacked variables."""
    writing = self.is_initializing() or any(
        self.is_mutable_collection(c)
        for c in (HEALTH_COLLECTION, PERTURBATIONS, CALIBRATION_COLLECTION))
    gather = fsdp.active()
    if gather is not None and self.config.remat:  # the recomputation gathers the weights
      gather = dataclasses.replace(gather, keep_gathered=True)  # again: its GEMMs keep them
    with fsdp.gathering(gather):
      if scans_layers(self.config) or writing:
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
    gather = fsdp.active()

    def layer(variables, x, rope, rng):
      params = fsdp.gather_tree(variables["params"], gather, matrix_dtype=jnp.dtype(cfg.dtype))
      return block.apply({**variables, "params": params}, x, rope,
                         rngs={"dropout": rng} if dropout else None)[0]

    if cfg.remat:  # outside a scan's loop XLA would merge the recomputation into the forward
      layer = jax.checkpoint(layer, prevent_cse=True, policy=remat_policy(cfg))
    for i, variables in enumerate(unstack_layers(stacked, cfg.n_layers)):
      x = layer(variables, x, rope, None if rngs is None else rngs[i])
    return x

  def _layers(self, deterministic: bool) -> nn.Module:
    """The n_layers blocks under nn.scan (and nn.remat when configured); each gathers its
    layer's parameters inside the loop (ZeRO-3, :func:`gathered`)."""
    block = Block if self.is_initializing() else gathered(Block, self.config)
    if self.config.remat:
      block = nn.remat(block, prevent_cse=False, policy=remat_policy(self.config))
    stacked = {"params": 0, FP8_COLLECTION: 0, HEALTH_COLLECTION: 0, PERTURBATIONS: 0,
               WEIGHT_CAST_COLLECTION: 0, CALIBRATION_COLLECTION: 0}
    scanned = nn.scan(block, variable_axes=stacked,
                      split_rngs={"params": True, "dropout": True},
                      in_axes=nn.broadcast, length=self.config.n_layers)
    return scanned(self.config, self.recipe, deterministic, name="layers")

  def _head(self, x):
    """LM head x[B, T, D] -> f32[B, T, V] (the GEMM writes f32 directly)."""
    cfg = self.config
    return gathered(nn.Dense, cfg)(**head_kwargs(cfg, self.recipe), name="head")(x).astype(
        jnp.float32)

  def parts(self) -> "DecoderParts":
    """This decoder cut into embedding, layer stack and head (:class:`DecoderParts`)."""
    return DecoderParts(self)


def embed_kwargs(config) -> dict:
  """The token embedding's :class:`Embed` arguments."""
  return dict(num_embeddings=config.vocab_size, features=config.d_model,
              dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
              embedding_init=nn.initializers.normal(0.02))


def head_kwargs(config, recipe: Recipe | None) -> dict:
  """The untied LM head's ``nn.Dense`` arguments: its GEMM (FP8 with `recipe` when
  ``config.fp8_head``, else BF16) writes f32."""
  kw = dense_kwargs(config, None, config.d_model ** -0.5)
  kw["dot_general_cls"] = f32_out_gemm(recipe if config.fp8_head else None)
  return dict(features=config.vocab_size, **kw)


def _sub(variables, name: str) -> dict:
  """{collection: its `name` subtree} over the collections of `variables` that have one."""
  return {c: v[name] for c, v in variables.items() if isinstance(v, Mapping) and name in v}


@dataclasses.dataclass(frozen=True)
class DecoderParts:
  """A :class:`Decoder` cut into embedding, layer stack and head, applied to explicit
  variables with the modules and math of :meth:`Decoder.__call__` (dropout off; under an
  active ``fp8jax.fsdp.WeightGather`` each part gathers its parameters at use, as the model
  does): ``logits(shared, layers(stacked, embed(shared, tokens)))`` is the model's forward.
  For pipeline parallelism (``fp8jax.parallel.pipeline``).

  Variables (the model's ``{collection: tree}``) split into ``stacked`` ({collection: its
  "layers" subtree}: leaves [L', ...] for any L' consecutive layers) and ``shared``
  ({collection: everything else}).
  """

  model: Decoder

  @property
  def recipe(self) -> Recipe | None:
    """The FP8 recipe of the model's GEMMs (None: BF16)."""
    return self.model.recipe

  @property
  def compute_dtype(self):
    """The dtype the model computes its GEMMs in."""
    return jnp.dtype(self.model.config.dtype)

  @property
  def n_layers(self) -> int:
    """The layers of the stack."""
    return self.model.config.n_layers

  def split(self, variables) -> tuple[dict, dict]:
    """(stacked, shared) of `variables` (``fp8jax.models.stack_parts.split_stack``)."""
    return split_stack(variables)

  def merge(self, stacked, shared) -> dict:
    """The variables (or gradients) tree of a (stacked, shared) pair: :meth:`split`'s
    inverse."""
    return merge_stack(stacked, shared)

  def embed(self, shared, tokens) -> jax.Array:
    """tokens int[B, T] -> x[B, T, D] in the compute dtype."""
    cfg = self.model.config
    check_tokens(tokens, cfg, type(self.model).__name__)
    return self._embed().apply(_sub(shared, "embed"), tokens)

  def _embed(self) -> nn.Module:
    return gathered(Embed, self.model.config, ("__call__", "attend"))(
        **embed_kwargs(self.model.config))

  def layers(self, stacked, x) -> jax.Array:
    """x[B, T, D] through the stacked layers' blocks in order (a scan over their leading
    axis; each block under ``jax.checkpoint`` with the config's remat policy when remat is
    on). Under an active ``fp8jax.fsdp.WeightGather`` (ZeRO-3) each layer's parameters are
    gathered inside the scan where that layer runs (GEMM kernels by their GEMM)."""
    cfg = self.model.config
    rope = self.model.rope(x.shape[1])
    block = Block(cfg, self.model.recipe, True, parent=None)
    gather = fsdp.active()
    if gather is not None and cfg.remat:  # the recomputation gathers the weights again
      gather = dataclasses.replace(gather, keep_gathered=True)

    def layer(x, variables):
      with fsdp.gathering(gather):
        params = fsdp.gather_tree(variables["params"], gather,
                                  matrix_dtype=jnp.dtype(cfg.dtype))
        return block.apply({**variables, "params": params}, x, rope)[0], None
    if cfg.remat:
      layer = jax.checkpoint(layer, policy=remat_policy(cfg))
    return lax.scan(layer, x, stacked)[0]

  def logits(self, shared, x) -> jax.Array:
    """x[B, T, D] -> final norm -> LM head (the embedding when tied) -> f32[B, T, V]."""
    cfg = self.model.config
    x = norm_module(cfg, gather=True).apply(_sub(shared, "norm_final"),
                                            x.astype(jnp.float32))
    x = x.astype(jnp.dtype(cfg.dtype))
    if cfg.tie_embeddings:
      return self._embed().apply(_sub(shared, "embed"), x, method="attend").astype(
          jnp.float32)
    head = gathered(nn.Dense, cfg)(**head_kwargs(cfg, self.model.recipe))
    return head.apply(_sub(shared, "head"), x).astype(jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def unstack_layers(stacked, n_layers: int) -> tuple:
  """The n_layers layer slices of stacked variables (leaves [L, ...] -> L trees of [...]).

  Gradient: the layers' gradients stacked into one buffer [L, ...] (one copy each), behind an
  optimization barrier, so XLA cannot turn the stacking into a sum of L zero-padded layer
  gradients with the consumers' reductions (the gradient norm) fused into it (a slow fusion:
  benchmarks/RESULTS.md, "Where the step time goes on the best settings"). Integer leaves
  get float0 zeros."""
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


def remat_policy(config):
  """The ``jax.checkpoint`` policy of `config`'s remat: the names it saves (None: nothing)."""
  names = ((WEIGHT_CAST_NAME,) if config.remat_save_fp8_weights else ()) + \
      _SAVED_NAMES[remat_policy_name(config)]
  return jax.checkpoint_policies.save_only_these_names(*names) if names else None


# ----------------------------------------------------------------------------- counting

def attention_flops_per_token(config, seq_len: int) -> float:
  """Training FLOPs per token of the attention's QK^T and AV (forward + backward):
  ``12 * n_layers * n_heads * head_dim * seq_len``, the full T x T square (PaLM's convention,
  no causal halving)."""
  if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 1:
    raise ValueError(f"flops_per_token: seq_len={seq_len!r} is not allowed; use an integer >= 1")
  return float(12 * config.n_layers * config.n_heads * config.head_dim * seq_len)


def check_init_shape(batch_size: int, seq_len: int) -> None:
  """Raises ValueError unless both are integers >= 1 (init_model's arguments)."""
  for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"init_model: {name}={value!r} is not allowed; use an integer >= 1")
