"""Hugging Face LLaMA checkpoints <-> :class:`fp8jax.models.llama.Llama` parameters.

A checkpoint is a directory with ``config.json`` (a ``LlamaForCausalLM`` config) and either
``model.safetensors`` or shards listed in ``model.safetensors.index.json``. Reading maps
Hugging Face's names to the Llama module's tree: ``[out, in]`` weights are transposed to
Flax's ``[in, out]`` kernels, q/k/v projections fused into the ``qkv`` kernel
[L, D, KV, G + 2, K] (per key/value head its G query heads, then key, then value: query head h
uses key/value head h // G, as Hugging Face's ``repeat_kv`` does), gate/up into ``fc_gate_in``
[L, D, F, 2], layers stacked on a leading axis. Both use RoPE's rotate-half layout (the
checkpoint's q/k rows are used as they are) and RMSNorm's gain as ``scale``. Writing is the
exact inverse, in float32, float16 or bfloat16, one file or shards with an index.

Unsupported checkpoints (another architecture, activation, biases, a RoPE scaling other than
"llama3", a head dim other than hidden_size / heads, missing or unexpected tensors, wrong
shapes) raise ValueError naming the value and what is allowed.
"""
from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import safetensors.numpy
from safetensors import safe_open

from fp8jax.models.llama import Llama3RopeScaling, LlamaConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
ARCHITECTURE = "LlamaForCausalLM"
EXPORT_DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# LlamaConfig fields a caller may set when loading: numerics and memory, not shapes.
LOAD_OVERRIDES = ("max_seq_len", "dtype", "param_dtype", "remat", "remat_policy",
                  "remat_save_fp8_weights", "scan_layers", "dropout_rate", "attention_impl",
                  "fp8_head")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads")
_SHARD_NAME = re.compile(r"model-\d+-of-\d+\.safetensors$")
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # a buffer some exports still carry


# ----------------------------------------------------------------------------- config

def config_from_hf(hf: Mapping[str, Any], **overrides) -> LlamaConfig:
  """The :class:`LlamaConfig` of a Hugging Face ``config.json`` dict.

  Args:
    hf: the parsed config.json.
    **overrides: fields of :data:`LOAD_OVERRIDES` (e.g. ``dtype="bfloat16"``, ``remat=True``,
      a shorter ``max_seq_len`` than ``max_position_embeddings``); the shape fields are the
      checkpoint's.
  Raises:
    ValueError: an unsupported config or override, naming the key and what is allowed.
  """
  bad = sorted(set(overrides) - set(LOAD_OVERRIDES))
  if bad:
    raise ValueError(f"{bad} are set by the checkpoint's config.json and cannot be overridden; "
                     f"override only {list(LOAD_OVERRIDES)}")
  archs = hf.get("architectures") or [ARCHITECTURE]
  if list(archs) != [ARCHITECTURE]:
    raise ValueError(f"config.json architectures={list(archs)} is not supported; fp8jax reads "
                     f"[{ARCHITECTURE!r}]")
  if hf.get("model_type", "llama") != "llama":
    raise ValueError(f"config.json model_type={hf['model_type']!r} is not supported; use "
                     "'llama'")
  missing = [k for k in _REQUIRED if k not in hf]
  if missing:
    raise ValueError(f"config.json lacks {missing}; a LLaMA config needs {list(_REQUIRED)}")
  # (pretraining_tp > 1 only slices the same products in transformers: accepted)
  for key, allowed in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
    if hf.get(key, allowed) != allowed:
      raise ValueError(f"config.json {key}={hf[key]!r} is not supported; use {allowed!r}")
  if hf.get("attention_dropout", 0.0):
    raise ValueError(f"config.json attention_dropout={hf['attention_dropout']!r} is not "
                     "supported; use 0.0")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim")
  if head_dim is not None and head_dim * heads != hf["hidden_size"]:
    raise ValueError(f"config.json head_dim={head_dim} is not supported with hidden_size="
                     f"{hf['hidden_size']} and num_attention_heads={heads}; use head_dim = "
                     "hidden_size / num_attention_heads")
  fields = dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], d_ff=hf["intermediate_size"],
      n_layers=hf["num_hidden_layers"], n_heads=heads,
      n_kv_heads=hf.get("num_key_value_heads") or heads,
      max_seq_len=hf.get("max_position_embeddings", 2048),
      rope_theta=float(hf.get("rope_theta", 10000.0)),
      rope_scaling=_rope_scaling_from_hf(hf.get("rope_scaling")),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)))
  return LlamaConfig(**{**fields, **overrides})


def _rope_scaling_from_hf(scaling) -> Llama3RopeScaling | None:
  if scaling is None:
    return None
  if not isinstance(scaling, Mapping):
    raise ValueError(f"config.json rope_scaling={scaling!r} is not supported; use null or a "
                     "'llama3' rope_scaling object")
  kind = scaling.get("rope_type", scaling.get("type"))
  if kind == "default":
    return None
  if kind != "llama3":
    raise ValueError(f"config.json rope_scaling type {kind!r} is not supported; use 'llama3' "
                     "or none")
  return Llama3RopeScaling.from_dict(scaling)


def config_to_hf(config: LlamaConfig, dtype: str = "float32") -> dict:
  """The Hugging Face ``config.json`` dict of `config` (``torch_dtype`` `dtype`;
  ``max_position_embeddings`` is ``max_seq_len``)."""
  return {
      "architectures": [ARCHITECTURE], "model_type": "llama",
      "vocab_size": config.vocab_size, "hidden_size": config.d_model,
      "intermediate_size": config.d_ff, "num_hidden_layers": config.n_layers,
      "num_attention_heads": config.n_heads, "num_key_value_heads": config.n_kv_heads,
      "head_dim": config.head_dim, "hidden_act": "silu",
      "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
      "rope_theta": config.rope_theta,
      "rope_scaling": None if config.rope_scaling is None else config.rope_scaling.to_dict(),
      "tie_word_embeddings": config.tie_embeddings, "attention_bias": False,
      "attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1,
      "initializer_range": 0.02, "use_cache": True, "torch_dtype": dtype,
  }


# ----------------------------------------------------------------------------- params

def _layer(i: int, name: str) -> str:
  return f"model.layers.{i}.{name}.weight"


def _expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """Every tensor a checkpoint of `config` holds, with its [out, in] shape."""
  d, f, k, v = config.d_model, config.d_ff, config.head_dim, config.vocab_size
  h, kv = config.n_heads * k, config.n_kv_heads * k
  per_layer = {"input_layernorm": (d,), "self_attn.q_proj": (h, d), "self_attn.k_proj": (kv, d),
               "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, h),
               "post_attention_layernorm": (d,), "mlp.gate_proj": (f, d),
               "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
  shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
  for i in range(config.n_layers):
    shapes.update({_layer(i, name): s for name, s in per_layer.items()})
  if not config.tie_embeddings:
    shapes["lm_head.weight"] = (v, d)
  return shapes


def params_from_hf(tensors: Mapping[str, Any], config: LlamaConfig) -> dict:
  """The ``Llama(config)`` params tree (numpy arrays in ``config.param_dtype``) of Hugging Face
  tensors (name -> [out, in] array). ValueError for missing, unexpected or misshapen tensors;
  ``lm_head.weight`` is ignored when the embeddings are tied (Hugging Face ties it on load)."""
  want = _expected_shapes(config)
  names = {n for n in tensors if not _IGNORED.search(n)}
  if config.tie_embeddings:
    names.discard("lm_head.weight")
  missing, unexpected = sorted(set(want) - names), sorted(names - set(want))
  if missing or unexpected:
    raise ValueError(f"checkpoint tensors do not match the config: missing {missing[:8]}"
                     f"{' ...' if len(missing) > 8 else ''}, unexpected {unexpected[:8]}"
                     f"{' ...' if len(unexpected) > 8 else ''}")
  dtype = jnp.dtype(config.param_dtype)

  def get(name):
    t = np.asarray(tensors[name])
    if tuple(t.shape) != want[name]:
      raise ValueError(f"checkpoint tensor {name} has shape {list(t.shape)}; the config needs "
                       f"{list(want[name])}")
    if not jnp.issubdtype(t.dtype, jnp.floating):
      raise ValueError(f"checkpoint tensor {name} has dtype {t.dtype}; use a float dtype")
    return t.astype(dtype)

  d, k, kv = config.d_model, config.head_dim, config.n_kv_heads
  g = config.n_heads // kv

  def qkv(i):  # [H*K, D], [KV*K, D] x2 -> [D, KV, G+2, K]
    q = get(_layer(i, "self_attn.q_proj")).T.reshape(d, kv, g, k)
    key = get(_layer(i, "self_attn.k_proj")).T.reshape(d, kv, 1, k)
    value = get(_layer(i, "self_attn.v_proj")).T.reshape(d, kv, 1, k)
    return np.concatenate([q, key, value], axis=2)

  def stack(fn):
    return np.stack([fn(i) for i in range(config.n_layers)])

  params = {
      "embed": {"embedding": get("model.embed_tokens.weight")},
      "layers": {
          "norm_attn": {"scale": stack(lambda i: get(_layer(i, "input_layernorm")))},
          "attn": {
              "qkv": {"kernel": stack(qkv)},
              "out": {"kernel": stack(lambda i: get(_layer(i, "self_attn.o_proj")).T.reshape(
                  config.n_heads, k, d))},
          },
          "norm_mlp": {"scale": stack(lambda i: get(_layer(i, "post_attention_layernorm")))},
          "mlp": {
              "fc_gate_in": {"kernel": stack(lambda i: np.stack(
                  [get(_layer(i, "mlp.gate_proj")).T, get(_layer(i, "mlp.up_proj")).T], -1))},
              "fc_out": {"kernel": stack(lambda i: get(_layer(i, "mlp.down_proj")).T)},
          },
      },
      "norm_final": {"scale": get("model.norm.weight")},
  }
  if not config.tie_embeddings:
    params["head"] = {"kernel": get("lm_head.weight").T}
  return params


def params_to_hf(params, config: LlamaConfig, dtype: str | None = None) -> dict[str, np.ndarray]:
  """Hugging Face tensors (name -> contiguous [out, in] numpy array) of a ``Llama(config)``
  params tree (numpy or JAX arrays; at O2/O3 pass the decoded ``TrainState.model_params()``),
  cast to `dtype` (one of :data:`EXPORT_DTYPES`; None: as stored), in Hugging Face's order."""
  if dtype is not None and dtype not in EXPORT_DTYPES:
    raise ValueError(f"export dtype={dtype!r} is not allowed; use one of {list(EXPORT_DTYPES)}")
  host = jax.tree.map(lambda a: np.asarray(jax.device_get(a)), params)
  got, want = _shapes_by_path(host), _shapes_by_path(_abstract_params(config))
  if got != want:
    wrong = sorted(p for p in set(got) | set(want) if got.get(p) != want.get(p))
    raise ValueError(f"params do not match the config's Llama tree at {wrong[:8]}: got "
                     f"{[got.get(p) for p in wrong[:8]]}, the config needs "
                     f"{[want.get(p) for p in wrong[:8]]}")
  lay = host["layers"]
  d, k, kv = config.d_model, config.head_dim, config.n_kv_heads
  g = config.n_heads // kv
  out = {"model.embed_tokens.weight": host["embed"]["embedding"]}
  for i in range(config.n_layers):
    qkv = lay["attn"]["qkv"]["kernel"][i]  # [D, KV, G+2, K]
    gate_up = lay["mlp"]["fc_gate_in"]["kernel"][i]
    out.update({
        _layer(i, "input_layernorm"): lay["norm_attn"]["scale"][i],
        _layer(i, "self_attn.q_proj"): qkv[:, :, :g].reshape(d, kv * g * k).T,
        _layer(i, "self_attn.k_proj"): qkv[:, :, g].reshape(d, kv * k).T,
        _layer(i, "self_attn.v_proj"): qkv[:, :, g + 1].reshape(d, kv * k).T,
        _layer(i, "self_attn.o_proj"): lay["attn"]["out"]["kernel"][i].reshape(-1, d).T,
        _layer(i, "post_attention_layernorm"): lay["norm_mlp"]["scale"][i],
        _layer(i, "mlp.gate_proj"): gate_up[..., 0].T,
        _layer(i, "mlp.up_proj"): gate_up[..., 1].T,
        _layer(i, "mlp.down_proj"): lay["mlp"]["fc_out"]["kernel"][i].T,
    })
  out["model.norm.weight"] = host["norm_final"]["scale"]
  if not config.tie_embeddings:
    out["lm_head.weight"] = host["head"]["kernel"].T
  cast = (lambda a: a) if dtype is None else (lambda a: a.astype(jnp.dtype(dtype)))
  return {name: np.ascontiguousarray(cast(a)) for name, a in out.items()}


def _shapes_by_path(tree) -> dict[str, tuple[int, ...]]:
  return {jax.tree_util.keystr(p): tuple(np.shape(a))
          for p, a in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _abstract_params(config: LlamaConfig) -> dict:
  """``Llama(config)``'s params tree as f32 ShapeDtypeStructs (no computation)."""
  d, f, k, kv, n = (config.d_model, config.d_ff, config.head_dim, config.n_kv_heads,
                    config.n_layers)
  g = config.n_heads // kv
  z = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
  tree = {"embed": {"embedding": z(config.vocab_size, d)},
          "layers": {"norm_attn": {"scale": z(n, d)},
                     "attn": {"qkv": {"kernel": z(n, d, kv, g + 2, k)},
                              "out": {"kernel": z(n, config.n_heads, k, d)}},
                     "norm_mlp": {"scale": z(n, d)},
                     "mlp": {"fc_gate_in": {"kernel": z(n, d, f, 2)},
                             "fc_out": {"kernel": z(n, f, d)}}},
          "norm_final": {"scale": z(d)}}
  if not config.tie_embeddings:
    tree["head"] = {"kernel": z(d, config.vocab_size)}
  return tree


# ----------------------------------------------------------------------------- files

class _Tensors(Mapping):
  """The tensors of a checkpoint directory by name, read from their file when asked."""

  def __init__(self, path: str):
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f).get("weight_map")
      if not isinstance(weight_map, Mapping) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map' of tensor name -> file")
      self._files = {n: os.path.join(path, fname) for n, fname in weight_map.items()}
    elif os.path.exists(os.path.join(path, WEIGHTS_FILE)):
      file = os.path.join(path, WEIGHTS_FILE)
      with safe_open(file, framework="np") as f:
        self._files = {n: file for n in f.keys()}
    else:
      raise ValueError(f"{path} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    self._open: dict[str, Any] = {}

  def __getitem__(self, name: str) -> np.ndarray:
    file = self._files[name]
    if file not in self._open:
      if not os.path.exists(file):
        raise ValueError(f"{file} (listed in {INDEX_FILE} for {name}) does not exist")
      self._open[file] = safe_open(file, framework="np")
    return self._open[file].get_tensor(name)

  def __iter__(self):
    return iter(self._files)

  def __len__(self) -> int:
    return len(self._files)


def read_tensors(path: str) -> Mapping[str, np.ndarray]:
  """The tensors of checkpoint directory `path` (one file or an index of shards) as a
  read-on-access mapping name -> numpy array."""
  return _Tensors(os.fspath(path))


def load_config(path: str, **overrides) -> LlamaConfig:
  """:func:`config_from_hf` of ``path/config.json``."""
  file = os.path.join(os.fspath(path), CONFIG_FILE)
  if not os.path.exists(file):
    raise ValueError(f"{path} has no {CONFIG_FILE}; pass a Hugging Face checkpoint directory")
  with open(file) as f:
    return config_from_hf(json.load(f), **overrides)


def load_pretrained(path: str, **overrides) -> tuple[LlamaConfig, dict]:
  """(config, params) of the Hugging Face LLaMA checkpoint directory `path`: the config of
  its config.json with `overrides` (:data:`LOAD_OVERRIDES`), the params tree of
  ``Llama(config)`` as numpy arrays in ``config.param_dtype`` (place them with
  ``jax.device_put``; ``init_model``'s ``params`` have the same tree and shapes)."""
  config = load_config(path, **overrides)
  return config, params_from_hf(read_tensors(path), config)


def _shards(tensors: Mapping[str, np.ndarray], max_bytes: int) -> list[dict]:
  """Tensors in order, packed into groups of at most `max_bytes` (a larger tensor alone)."""
  shards, current, size = [], {}, 0
  for name, a in tensors.items():
    if current and size + a.nbytes > max_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = a
    size += a.nbytes
  return shards + [current]


def save_pretrained(path: str, config: LlamaConfig, params, *, dtype: str = "float32",
                    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                    extra_config: Mapping[str, Any] | None = None,
                    overwrite: bool = False) -> list[str]:
  """Writes `params` (a ``Llama(config)`` params tree) as a Hugging Face checkpoint.

  Args:
    path: directory (created if needed).
    config, params: the model; at O2/O3 pass the decoded ``TrainState.model_params()``.
    dtype: tensor dtype written, one of :data:`EXPORT_DTYPES` (also config.json's
      ``torch_dtype``).
    max_shard_bytes: above this many bytes of tensors, shards ``model-0000i-of-0000N``
      (each at most this size, a larger tensor alone) plus ``model.safetensors.index.json``;
      else one ``model.safetensors``.
    extra_config: further config.json keys (e.g. ``bos_token_id``); keys fp8jax writes keep
      fp8jax's values.
    overwrite: replace weights files already in `path` (else ValueError).
  Returns:
    the files written (paths).
  """
  if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, (int, np.integer)) \
      or max_shard_bytes < 1:
    raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is not allowed; use an integer >= 1")
  tensors = params_to_hf(params, config, dtype)  # validates dtype and the tree first
  path = os.fspath(path)
  os.makedirs(path, exist_ok=True)
  old = [p for p in glob.glob(os.path.join(path, "model*.safetensors*"))
         if os.path.basename(p) in (WEIGHTS_FILE, INDEX_FILE)
         or _SHARD_NAME.match(os.path.basename(p))]
  if old and not overwrite:
    raise ValueError(f"{path} already holds weights {sorted(map(os.path.basename, old))}; "
                     "pass overwrite=True or choose another directory")
  for p in old:
    os.remove(p)
  shards = _shards(tensors, int(max_shard_bytes))
  names = ([WEIGHTS_FILE] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  written = []
  for fname, shard in zip(names, shards, strict=True):
    written.append(os.path.join(path, fname))
    safetensors.numpy.save_file(shard, written[-1], metadata={"format": "pt"})
  if len(shards) > 1:
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": {n: fname for fname, shard in zip(names, shards) for n in shard}}
    written.append(os.path.join(path, INDEX_FILE))
    with open(written[-1], "w") as f:
      json.dump(index, f, indent=2)
  hf = {**dict(extra_config or {}), **config_to_hf(config, dtype)}
  written.append(os.path.join(path, CONFIG_FILE))
  with open(written[-1], "w") as f:
    json.dump(hf, f, indent=2)
  return written


__all__ = ["ARCHITECTURE", "CONFIG_FILE", "DEFAULT_MAX_SHARD_BYTES", "EXPORT_DTYPES",
           "INDEX_FILE", "LOAD_OVERRIDES", "WEIGHTS_FILE", "config_from_hf", "config_to_hf",
           "load_config", "load_pretrained", "params_from_hf", "params_to_hf", "read_tensors",
           "save_pretrained"]
