"""Analytic estimate of a train step's peak device memory under remat, per remat policy.

:func:`step_bytes` adds the run's state and one microbatch's activations on one device,
from the config alone (no tracing, no compile). ``fp8jax.train.build.resolve_auto`` compares
it with the device's memory to choose ``model.remat_policy``. The terms (P_k: parameters of
GEMM kernels, split over the tensor-parallel ranks; P_o: the others; N ZeRO shards: the
devices of the run over the tensor-parallel size; c: bytes of the compute dtype; n tokens of
s sequences of T tokens per device and microbatch; D, F, L, V, H: width, MLP width, layers,
vocabulary, heads; F' = F for GELU, 2F for SwiGLU's fused gate and up projection):

state, bytes per parameter
  master weights       master dtype (f32 4, FP16 2);            / N at ZeRO stage 3
  Adam m, v            their dtypes (f32 4 + 4, E4M3 1 + FP16 2); / N at stage >= 1
  gradients            f32 4 (O0, O1); O2/O3: the kernels' compute-dtype copy and its
                       gradient c + c, the others' f32 gradient 4
  accumulator          f32 4 with more than one microbatch;       / N at stage >= 2
  FP8 weight casts     1 per kernel weight (levels with FP8 GEMMs)
  gathered model       stage 3: kernels in the compute dtype, the others as stored

activations (remat on)
  layer inputs         L n D c
  working set          n (16 D + 3 F') c: one layer recomputed and differentiated
  save_gemm_outputs    + L n (4 D + F') c: the qkv, attention-out and MLP-in outputs; with
                       cuDNN attention its residuals, + L n D c
  save_gemm_io         + L n (3 D + F) bytes of FP8 input casts (c per element at O0)
  XLA attention        + s H T^2 x 8: one layer's f32 scores and probabilities
  logits               n V x 8: f32 logits and their gradient

The terms are meant to err high: a wrong estimate should cost a less saving policy, not an
out-of-memory step.
"""
from __future__ import annotations

import math

import numpy as np

from fp8jax.models.family import family_of
from fp8jax.models.layers import REMAT_POLICIES

GiB = 2**30
# Against the peaks of benchmarks/RESULTS.md (one H200, jax 0.11.2, cuDNN attention, B8 x T2048)
# the estimate is 1-16% above at the 1.3B shape (O0 full 21.0 GiB, O0 saved 33.8, O2 full 12.5,
# saved 24.8, io 30.1, io B16 50.1, io B32 90.8), ~1% above for the full 7B config with full
# remat (O0 103.8, O2 67.7), 8% (O0 saved) and 37% (O2 io) above at the 7B layer shape.


def _itemsize(dtype) -> int:
  return int(np.dtype(dtype).itemsize)


def _shape(model):
  """The family config of a config's model section (itself when already one)."""
  return model.model_config() if hasattr(model, "model_config") else model


def param_counts(model) -> tuple[int, int]:
  """(GEMM kernel parameters, other parameters) of a built-in family's config (``ModelConfig``,
  ``LlamaConfig``) or a config's model section: projections and the untied LM head;
  embedding and norms."""
  model = _shape(model)
  d, v = model.d_model, model.vocab_size
  kernels = family_of(model).matmul_param_count(model) - (d * v if model.tie_embeddings else 0)
  return kernels, v * d + (2 * model.n_layers + 1) * d


def state_bytes(config, devices: int = 1) -> float:
  """Bytes per device of `config`'s train state and gradients (see the module docstring)
  on a run over `devices` devices."""
  level, model, p = config.level(), _shape(config.model), config.parallel
  tensor = p.tensor_parallel_size
  shards = max(devices // tensor, 1)
  stage = config.zero_stage()
  kernels, others = param_counts(model)
  kernels = kernels / tensor
  params = kernels + others
  c = _itemsize(model.dtype)
  total = params * _itemsize(level.master_dtype) / (shards if stage >= 3 else 1)
  total += params * (_itemsize(level.mu_dtype) + _itemsize(level.nu_dtype)) / (
      shards if stage >= 1 else 1)
  total += 2 * c * kernels + 4 * others if level.scaled_master else 4 * params
  if config.train.microbatches > 1:
    total += 4 * params / (shards if stage >= 2 else 1)
  if level.fp8_gemms:
    total += kernels
  if stage >= 3:
    total += c * kernels + _itemsize(level.master_dtype) * others
  return float(total)


def activation_bytes(config, remat_policy: str, attention_impl: str,
                     sequences: int) -> float:
  """Bytes of one microbatch's activations on one device under remat with `remat_policy`
  (not "auto") and `attention_impl` ("xla" or "cudnn"), `sequences` sequences of
  ``config.data.seq_len`` tokens (see the module docstring)."""
  if remat_policy not in REMAT_POLICIES or remat_policy == "auto":
    raise ValueError(f"remat_policy={remat_policy!r} is not allowed; use one of "
                     f"{[p for p in REMAT_POLICIES if p != 'auto']}")
  if attention_impl not in ("xla", "cudnn"):
    raise ValueError(f"attention_impl={attention_impl!r} is not allowed; use 'xla' or 'cudnn'")
  m, t = _shape(config.model), config.data.seq_len
  d, f, layers = m.d_model, m.d_ff, m.n_layers
  f_out = 2 * f if m.mlp == "swiglu" else f
  c = _itemsize(m.dtype)
  n = sequences * t
  per_layer = d * c  # the layer's input
  if remat_policy != "full":
    per_layer += (4 * d + f_out) * c + (d * c if attention_impl == "cudnn" else 0)
  if remat_policy == "save_gemm_io":
    per_layer += (3 * d + f) * (1 if config.level().fp8_gemms else c)
  total = layers * n * per_layer + n * (16 * d + 3 * f_out) * c + n * m.vocab_size * 8
  if attention_impl == "xla":
    total += sequences * m.n_heads * t * t * 8
  return float(total)


def device_sequences(config, devices: int = 1) -> int:
  """Sequences one device runs per microbatch: the microbatch split over the data-parallel
  ranks (devices / tensor-parallel size), or whole with ``parallel.device_map``."""
  if config.parallel.device_map is not None:
    return config.train.microbatch_size
  ranks = max(devices // config.parallel.tensor_parallel_size, 1)
  return math.ceil(config.train.microbatch_size / ranks)


def step_bytes(config, remat_policy: str, attention_impl: str, devices: int = 1) -> float:
  """Estimated peak bytes per device of `config`'s train step under remat with
  `remat_policy` and `attention_impl`, on a run over `devices` devices:
  :func:`state_bytes` + :func:`activation_bytes`."""
  return state_bytes(config, devices) + activation_bytes(
      config, remat_policy, attention_impl, device_sequences(config, devices))
