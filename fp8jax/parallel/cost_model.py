"""Step-time model of a data-parallel cluster that mixes GPU kinds, uniform vs balanced split.

Every GPU is one data-parallel group with equal microbatch shapes; the uniform split gives
each the same number of microbatches (a batch that does not split equally over the GPUs has no
uniform split: it is infeasible, whatever the order of the cluster's groups), the balanced
split (:mod:`fp8jax.parallel.balance`) gives faster kinds more, and may leave slow GPUs idle
(they still hold their ZeRO shards and take part in the collectives). A step is modelled as

  step = compute makespan + (1 - overlap) x communication + optimizer update

with compute from FLOPs and an MFU calibrated on fp8jax runs (or from measured profiles),
communication from ring-collective bytes over the slowest link, the update from HBM bytes.
Memory per GPU (:func:`device_memory`, the package's one memory model of a train step)
decides the largest microbatch and whether a kind can run the level at all.
Pure Python: no devices are needed. Every modelling constant is a field of
:class:`Assumptions`; GPU facts come from :mod:`fp8jax.hardware`, the model's from a
:class:`ModelShape` (``fp8jax.train.memory.model_shape`` builds one from a model config).
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from fp8jax.hardware import GPU_SPECS, fp8_native, gpu_spec
from fp8jax.parallel import profile as profile_lib
from fp8jax.parallel.balance import KindProfile, balance_counts, makespan, uniform_counts
from fp8jax.recipe import LEVELS, OptLevel, opt_level

GiB = 2**30
STAGES = (0, 1, 2, 3)
PROFILE_FORMAT = profile_lib.FORMAT


# ----------------------------------------------------------------------------- model

REMAT_POLICIES = ("full", "save_gemm_outputs", "save_gemm_io")
ATTENTION_IMPLS = ("cudnn", "xla")


@dataclasses.dataclass(frozen=True)
class ModelShape:
  """The facts of a decoder-only transformer the cost model reads, as plain numbers.

  Attributes:
    n_layers, d_model, d_ff, vocab_size: sizes of the model.
    kernel_params: parameters stored as GEMM kernels (cast to FP8 at O1..O3): the layers'
      projections and the LM head unless it is tied to the embedding.
    other_params: every other parameter (embedding, norms); travels as stored.
    matmul_params: weights taking part in a GEMM per token (the LM head also when tied);
      sets the per-microbatch overhead.
    flops_per_token_fixed, flops_per_position: training FLOPs (forward + backward) per token
      are ``flops_per_token_fixed + flops_per_position * seq_len``.
    remat: layers recomputed in the backward pass (only their inputs are saved).
    layer_kernel_params: GEMM kernel parameters of one layer (0: ``kernel_params /
      n_layers``, which counts an untied LM head into every layer).
    embedding_params: the token embedding's parameters (0: ``vocab_size * d_model``).
    gated_mlp: SwiGLU-style MLP (gate and up projections: 2 x d_ff outputs per token).
    remat_policy: what remat keeps ("full", "save_gemm_outputs", "save_gemm_io"; read only
      with `remat`).
    compute_bytes: bytes per element of the compute dtype (BF16: 2, f32: 4).
    n_heads: attention (query) heads; needed with ``attention_impl="xla"``.
    attention_impl: "cudnn" (flash attention: no T^2 term; ``save_gemm_outputs`` also keeps
      its residuals) or "xla" (one layer's f32 scores and probabilities at a time).
  """

  n_layers: int
  d_model: int
  d_ff: int
  vocab_size: int
  kernel_params: int
  other_params: int
  matmul_params: int
  flops_per_token_fixed: float
  flops_per_position: float
  remat: bool
  layer_kernel_params: int = 0
  embedding_params: int = 0
  gated_mlp: bool = False
  remat_policy: str = "full"
  compute_bytes: int = 2
  n_heads: int = 0
  attention_impl: str = "cudnn"

  def __post_init__(self):
    if self.remat_policy not in REMAT_POLICIES:
      raise ValueError(f"ModelShape.remat_policy={self.remat_policy!r} is not allowed; use one "
                       f"of {list(REMAT_POLICIES)}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"ModelShape.attention_impl={self.attention_impl!r} is not allowed; use "
                       f"one of {list(ATTENTION_IMPLS)}")
    if self.attention_impl == "xla" and (isinstance(self.n_heads, bool) or not isinstance(
        self.n_heads, int) or self.n_heads < 1):
      raise ValueError(f"ModelShape.n_heads={self.n_heads!r} is not allowed with "
                       "attention_impl='xla' (its scores are n_heads x T^2 per sequence); use "
                       "an integer >= 1")
    for name in ("n_layers", "d_model", "d_ff", "vocab_size", "compute_bytes"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ModelShape.{name}={value!r} is not allowed; use an integer >= 1")

  @property
  def params(self) -> int:
    """All parameters."""
    return self.kernel_params + self.other_params

  @property
  def layer_kernels(self) -> int:
    """GEMM kernel parameters of one layer."""
    return self.layer_kernel_params or self.kernel_params // self.n_layers

  @property
  def head_kernels(self) -> int:
    """GEMM kernel parameters outside the layers (an untied LM head; 0 when tied)."""
    return max(self.kernel_params - self.n_layers * self.layer_kernels, 0)

  @property
  def largest_kernel(self) -> int:
    """Parameters of a layer's largest GEMM kernel: d x max(3 d, F'), F' the MLP's output
    width (2 d_ff when gated: the fused gate and up projection)."""
    wide = 2 * self.d_ff if self.gated_mlp else self.d_ff
    return self.d_model * max(3 * self.d_model, wide)

  @property
  def embedding(self) -> int:
    """The token embedding's parameters."""
    return self.embedding_params or self.vocab_size * self.d_model

  @property
  def layer_others(self) -> float:
    """Non-kernel parameters of one layer (norms), the final norm spread over the layers."""
    return max(self.other_params - self.embedding, 0) / self.n_layers

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token at sequence length `seq_len`."""
    return self.flops_per_token_fixed + self.flops_per_position * seq_len


# ----------------------------------------------------------------------------- cluster

class ClusterSpec(NamedTuple):
  """GPU groups as (kind, count) in mesh order; bandwidths bytes/s per GPU per direction."""

  groups: tuple[tuple[str, int], ...]
  gpus_per_node: int = 8
  inter_node_bw: float = 50e9  # 400 Gb/s, one NIC per GPU

  @property
  def gpus(self) -> int:
    """Data-parallel GPUs in all."""
    return sum(n for _, n in self.groups)

  def kinds(self) -> tuple[str, ...]:
    """The kind of every GPU, in mesh order."""
    return tuple(k for k, n in self.groups for _ in range(n))

  def describe(self) -> str:
    """The cluster as parse_cluster reads it, e.g. "8xA100-80GB+8xH100-SXM"."""
    return "+".join(f"{n}x{k}" for k, n in self.groups)


_GROUP = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\S.*?)\s*$")


def parse_cluster(text: str, gpus_per_node: int = 8, inter_node_bw: float = 50e9) -> ClusterSpec:
  """ClusterSpec of "8xA100-80GB+8xH100-SXM" (groups joined by "+", each COUNTxKIND)."""
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"cluster {text!r} is empty; use e.g. '8xA100-80GB+8xH100-SXM'")
  if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
    raise ValueError(f"gpus_per_node={gpus_per_node!r} is not allowed; use an integer >= 1")
  if not (inter_node_bw > 0 and math.isfinite(inter_node_bw)):
    raise ValueError(f"inter_node_bw={inter_node_bw!r} is not allowed; use bytes/s > 0")
  groups = []
  for part in text.split("+"):
    match = _GROUP.match(part)
    if not match:
      raise ValueError(f"cluster group {part.strip()!r} in {text!r} is not COUNTxKIND; use "
                       f"e.g. '8xH100-SXM' (kinds: {sorted(GPU_SPECS)})")
    count = int(match.group(1))
    if count < 1:
      raise ValueError(f"cluster group {part.strip()!r} has count {count}; use a count >= 1")
    groups.append((gpu_spec(match.group(2)).name, count))
  return ClusterSpec(tuple(groups), gpus_per_node, float(inter_node_bw))


# ----------------------------------------------------------------------------- assumptions

_OVERHEAD_KIND = "H200"  # where Assumptions.microbatch_overhead_s_per_param was measured

class Assumptions(NamedTuple):
  """Modelling constants; each names the fp8jax measurement or the guess behind it."""

  # BF16 MFU of the FLOP-proportional part of a microbatch (model FLOPs, remat not counted):
  # fp8jax 1.3B (configs/gpt_1_3b.yaml, B8 x T2048, remat, cuDNN attention) O0 on one H200,
  # 282.8 ms/step, minus the per-microbatch overhead below (26.7 ms): 8.459e9 FLOP/token x
  # 16384 tokens / 0.2561 s / 989e12 = 0.547. Taken to hold for every kind and size.
  bf16_mfu: float = 0.547
  # Per-microbatch cost that does not scale with its tokens (weight casts, launches, small-M
  # GEMM inefficiency), seconds per GEMM parameter at 4.8 TB/s, scaled by 4.8 TB/s / the kind's
  # HBM bandwidth: the H200 1.3B O2 profile (benchmarks/RESULTS.md) fits 38.0 ms + 26.0 ms per
  # sequence for 4..16 sequences; 38.0 ms minus the 11.3 ms optimizer update = 26.7 ms over
  # 1.208e9 GEMM parameters = 2.21e-11 s.
  microbatch_overhead_s_per_param: float = 2.21e-11
  # Step speedup of native FP8 (O1..O3) over BF16, measured on H200: 1.16x at d_model 2048
  # (1.3B, O1 step) and 1.36x at d_model 4096 (7B layer shape, SwiGLU d_ff 11008); linear in
  # d_model between, constant outside.
  fp8_speedup_small: float = 1.16
  fp8_speedup_small_d: int = 2048
  fp8_speedup_large: float = 1.36
  fp8_speedup_large_d: int = 4096
  # Kinds without FP8 tensor cores (A100) run FP8 GEMMs as exact BF16 upcasts + BF16 GEMMs:
  # step time x this factor vs BF16 (O0). Measured on H200 with the emulated path forced
  # (benchmarks/hetero_gpu.py emulation, 1.3B, B8): 253.9 / 286.0 ms = 0.888 (FP8 activations
  # halve the saved-activation traffic). Not measured on an A100.
  emulated_fp8_overhead: float = 0.888
  # Optimizer update as HBM traffic: optax adamw, 2^30 f32 params, 8.0 ms on H200 (4.8 TB/s)
  # moves 28 bytes/param -> 28 x 2^30 / 8.0 ms / 4.8e12 = 0.78 of peak bandwidth.
  hbm_efficiency: float = 0.78
  # fp8jax's O2 update of the same params took 9.3 ms for ~11 bytes/param: 0.265 of peak
  # (several fusions re-read the moments, see benchmarks/RESULTS.md "Optimizer update").
  fp8_optimizer_hbm_efficiency: float = 0.265
  # Ring collectives reach this fraction of the link bandwidth (assumption; nccl-tests busbw
  # is typically 0.75-0.85 of the per-direction link rate).
  comm_efficiency: float = 0.8
  # Fraction of communication hidden behind compute: 0 = none (conservative).
  overlap: float = 0.0
  # Memory kept free for workspaces, fragmentation and the runtime: fraction of HBM.
  workspace_reserve: float = 0.10
  # At O2/O3 the step decodes the FP16 master weights to the compute dtype once (BF16, bytes
  # per parameter; fp8jax.train.step matrix_dtype): whole below ZeRO-3, the shards at 3. (The
  # per-group step decodes to f32: device_memory counts 4 there.)
  fp8_working_copy_bytes: float = 2.0
  # Temporaries of the optimizer update, bytes per parameter it updates (the GPU's shard from
  # ZeRO stage 1). O2/O3 (the composed FP16-master update, which every sharded run takes):
  # 3 GiB for 2^30 parameters on H200 (benchmarks/RESULTS.md "Optimizer update"); O0/O1
  # (optax adamw): 0 there. XLA's CPU backend keeps ~8 (tests/integration/test_simulate.py).
  update_temp_bytes: float = 3.0
  update_temp_bytes_f32: float = 0.0
  # An all-reduce of the gradients (ZeRO 0/1 over several GPUs) writes them to a second
  # buffer: bytes per parameter (f32). Fits the H200 ZeRO-1 peaks of the 7B layer shape on
  # 2 and 4 GPUs (benchmarks/RESULTS.md "Scaling"); XLA's CPU backend reduces in place (0).
  all_reduce_copy_bytes: float = 4.0
  # ZeRO-3 gathers each layer's weights where the layer runs (fp8jax.fsdp): this many layers'
  # gathered weights are alive at once (the running layer and the next one's gather, which
  # XLA may start early; tests/integration/test_fsdp.py bounds the peak by 2).
  layers_in_flight: float = 2.0
  # Kinds without FP8 tensor cores multiply an FP8 weight after widening it: bytes per
  # parameter of one layer's widened weights (BF16 on an A100; XLA's CPU backend: f32, 4).
  emulated_weight_bytes: float = 2.0
  # The model has no per-microbatch overhead (MFU does not depend on the microbatch), so it
  # would pick tiny microbatches for finer balancing: take the largest microbatch whose step
  # is within this fraction of the fastest one.
  microbatch_tolerance: float = 0.02

  def check(self) -> "Assumptions":
    """Self, after checking every value's range (ValueError naming the bad one)."""
    positive = ("bf16_mfu", "fp8_speedup_small", "fp8_speedup_large", "emulated_fp8_overhead",
                "microbatch_overhead_s_per_param", "hbm_efficiency",
                "fp8_optimizer_hbm_efficiency", "comm_efficiency")
    for name in positive:
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise ValueError(f"Assumptions.{name}={value!r} is not allowed; use a number > 0")
    for name in ("bf16_mfu", "hbm_efficiency", "fp8_optimizer_hbm_efficiency",
                 "comm_efficiency"):
      if getattr(self, name) > 1:
        raise ValueError(f"Assumptions.{name}={getattr(self, name)!r} is not allowed; use a "
                         "fraction in (0, 1]")
    if not 0 <= self.overlap <= 1:
      raise ValueError(f"Assumptions.overlap={self.overlap!r} is not allowed; use a fraction "
                       "in [0, 1]")
    if not 0 <= self.microbatch_tolerance < math.inf:
      raise ValueError(f"Assumptions.microbatch_tolerance={self.microbatch_tolerance!r} is "
                       "not allowed; use a fraction >= 0")
    for name in ("fp8_working_copy_bytes", "update_temp_bytes", "update_temp_bytes_f32",
                 "all_reduce_copy_bytes", "layers_in_flight", "emulated_weight_bytes"):
      value = getattr(self, name)
      if not (isinstance(value, (int, float)) and 0 <= value < math.inf):
        raise ValueError(f"Assumptions.{name}={value!r} is not allowed; use a number >= 0")
    if not 0 <= self.workspace_reserve < 1:
      raise ValueError(f"Assumptions.workspace_reserve={self.workspace_reserve!r} is not "
                       "allowed; use a fraction in [0, 1)")
    if not self.fp8_speedup_small_d < self.fp8_speedup_large_d:
      raise ValueError(f"Assumptions.fp8_speedup_small_d={self.fp8_speedup_small_d} must be "
                       f"below fp8_speedup_large_d={self.fp8_speedup_large_d}")
    return self

  def describe(self) -> list[str]:
    """One line per assumption, for printing above a table."""
    a = self
    return [
        f"BF16 MFU {a.bf16_mfu:.3f} of the token-proportional work plus "
        f"{a.microbatch_overhead_s_per_param * 1e12:.1f} ps per GEMM parameter per microbatch "
        "at 4.8 TB/s (fp8jax 1.3B on H200: O0 step 282.8 ms, O2 profile 38 ms + 26 ms/seq)",
        f"native FP8 step speedup {a.fp8_speedup_small:.2f}x at d_model<={a.fp8_speedup_small_d}"
        f", {a.fp8_speedup_large:.2f}x at d_model>={a.fp8_speedup_large_d}, linear between "
        "(H200 measurements)",
        f"emulated FP8 (no FP8 tensor cores, e.g. A100): {a.emulated_fp8_overhead:.3f}x BF16 "
        "step time (measured on H200 with the emulated path forced; not on an A100)",
        f"optimizer HBM efficiency {a.hbm_efficiency:.2f} (O0/O1, 28 B/param) and "
        f"{a.fp8_optimizer_hbm_efficiency:.3f} (O2/O3, 11 B/param) (H200 measurements)",
        f"collectives: ring, {a.comm_efficiency:.2f} of link bandwidth, overlap "
        f"{a.overlap:.2f}; memory reserve {a.workspace_reserve:.0%}; largest microbatch within "
        f"{a.microbatch_tolerance:.0%} of the fastest step",
        f"memory: optimizer update temporaries {a.update_temp_bytes:g} B/param (O2/O3) and "
        f"{a.update_temp_bytes_f32:g} (O0/O1) of the updated shard (H200 measurements), a "
        f"gradient all-reduce's output {a.all_reduce_copy_bytes:g} B/param (ZeRO 0/1); "
        f"ZeRO-3 holds {a.layers_in_flight:g} layers' gathered weights at once",
    ]


# ----------------------------------------------------------------------------- per-param bytes

def _check_level(level: str) -> str:
  key = str(level).upper()
  if key not in LEVELS:
    raise ValueError(f"level {level!r} is not allowed; use one of {list(LEVELS)}")
  return key


def _level(level: str) -> OptLevel:
  return opt_level(_check_level(level))


def _bytes(dtype) -> int:
  return int(np.dtype(dtype).itemsize)


def _check_stage(level: str, stage: int) -> int:
  if isinstance(stage, bool) or stage not in STAGES:
    raise ValueError(f"ZeRO stage {stage!r} is not allowed; use one of {list(STAGES)}")
  if _level(level).zero_stage > stage:
    raise ValueError(f"ZeRO stage {stage} is not allowed at {level} (it shards); use stage "
                     f"{_level(level).zero_stage} or above")
  return stage


def state_bytes_per_param(level: str) -> dict[str, float]:
  """Bytes per parameter by role: master (stored weights), grads (the step's gradients and
  accumulators: f32 at every level, fp8jax.train.step sums, reduces and clips in f32), m, v
  (Adam moments)."""
  lv = _level(level)
  return {"master": _bytes(lv.master_dtype), "grads": 4, "m": _bytes(lv.mu_dtype),
          "v": _bytes(lv.nu_dtype)}


GRAD_COMMS = ("native", "fp8")


def grad_comm_bytes(level: str, grad_comm: str = "native") -> int:
  """Bytes per parameter of gradients on the wire: f32 (4) with native reductions (every
  level: the step reduces its f32 gradients), E4M3 (1) with ``parallel.grad_comm: fp8`` at
  O1..O3."""
  if grad_comm not in GRAD_COMMS:
    raise ValueError(f"grad_comm={grad_comm!r} is not allowed; use one of {list(GRAD_COMMS)}")
  return 1 if grad_comm == "fp8" and _level(level).fp8_gemms else 4


def master_bytes(level: str) -> int:
  """Bytes per parameter of the stored (master) weights: f32 at O0/O1, FP16 at O2/O3."""
  return _bytes(_level(level).master_dtype)


def wire_bytes(level: str, compute_bytes: int = 2) -> int:
  """Bytes per parameter of a GEMM kernel in a ZeRO-3 all-gather: E4M3 (1) at O1..O3, the
  compute dtype at O0 (fp8jax.fsdp)."""
  return 1 if _level(level).fp8_gemms else compute_bytes


def gather_bytes(level: str, kernel_params: float, other_params: float,
                 compute_bytes: int = 2) -> float:
  """Bytes of one ZeRO-3 weight all-gather of `kernel_params` GEMM kernels
  (:func:`wire_bytes`) and `other_params` other parameters (the embedding, a GEMM weight,
  in the compute dtype; norms, few, counted alike)."""
  return wire_bytes(level, compute_bytes) * kernel_params + compute_bytes * other_params


def optimizer_bytes_per_param(level: str) -> int:
  """HBM bytes one update touches per parameter. O0/O1 (optax adamw, f32): read p, g, m, v,
  write p, m, v = 28. O2/O3: read FP16 master 2, FP8 grad 1, E4M3 m 1, FP16 v 2, write
  master 2, m 1, v 2 = 11."""
  return 11 if _level(level).scaled_master else 28


# ----------------------------------------------------------------------------- time

def fp8_speedup(d_model: int, a: Assumptions) -> float:
  """Native FP8 step speedup over BF16 at this width (linear between the measured widths)."""
  lo, hi = a.fp8_speedup_small_d, a.fp8_speedup_large_d
  t = min(max((d_model - lo) / (hi - lo), 0.0), 1.0)
  return a.fp8_speedup_small + t * (a.fp8_speedup_large - a.fp8_speedup_small)


def level_speedup(level: str, kind: str, d_model: int, a: Assumptions) -> float:
  """Step speedup over BF16 of `level` on `kind`: 1 at O0; FP8's where native; < 1 emulated."""
  if not _level(level).fp8_gemms:
    return 1.0
  return fp8_speedup(d_model, a) if fp8_native(kind) else 1.0 / a.emulated_fp8_overhead


def microbatch_seconds(model: ModelShape, seq_len: int, microbatch: int, level: str, kind: str,
                       a: Assumptions) -> float:
  """Seconds of one microbatch (`microbatch` sequences x `seq_len`) forward+backward."""
  spec = gpu_spec(kind)
  flops = model.flops_per_token(seq_len) * microbatch * seq_len
  compute = flops / (spec.bf16_flops * a.bf16_mfu) / level_speedup(level, kind, model.d_model,
                                                                   a)
  overhead = a.microbatch_overhead_s_per_param * model.matmul_params * \
      GPU_SPECS[_OVERHEAD_KIND].hbm_bw / spec.hbm_bw
  return compute + overhead


# ----------------------------------------------------------------------------- memory

SCHEDULES = ("1f1b", "gpipe")


class Layout(NamedTuple):
  """How the GPUs training one model split it: `data` data-parallel ranks (the ZeRO shards)
  x `tensor` tensor-parallel ranks x `pipeline` stages; `schedule` of the pipeline
  (:mod:`fp8jax.parallel.pipeline`): "1f1b" (lockstep: a stage holds at most 2 x `pipeline`
  - 1 microbatches' inputs) or "gpipe" (all of them)."""

  data: int = 1
  tensor: int = 1
  pipeline: int = 1
  schedule: str = "1f1b"

  @property
  def gpus(self) -> int:
    return self.data * self.tensor * self.pipeline

  def check(self) -> "Layout":
    """Self, after checking the values (ValueError naming the bad one)."""
    for name in ("data", "tensor", "pipeline"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Layout.{name}={value!r} is not allowed; use an integer >= 1")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"Layout.schedule={self.schedule!r} is not allowed; use one of "
                       f"{list(SCHEDULES)}")
    return self


def activation_bytes(model: ModelShape, seq_len: int, microbatch: int, level: str = "O0",
                     tensor: int = 1, layers: int | None = None, in_flight: int = 1,
                     logits: bool = True) -> float:
  """Activation bytes on one GPU: `in_flight` microbatches of `microbatch` sequences x
  `seq_len` tokens saved for the backward of `layers` layers (default all), one layer's
  working set, and (`logits`) the f32 logits with their gradient, n V x 8.

  n tokens per microbatch, c compute bytes, F' the MLP's output width (2 d_ff when gated).
  With remat, per layer and token: the layer input d c; ``save_gemm_outputs`` adds the qkv,
  attention-out and MLP-in outputs (4 d + F') c and, with cuDNN attention, its residuals
  d c; ``save_gemm_io`` also (3 d + d_ff) FP8 input casts (c each at O0); all three split over
  `tensor` ranks. Working set (16 d + 3 F') c: one layer recomputed and differentiated, its
  part beyond 4 d split over `tensor` ranks. Without remat 34 d bytes per token per layer
  (Korthikanti et al. 2022), (10 + 24 / tensor) d with tensor parallelism. XLA attention
  (``model.attention_impl``) adds its f32 scores and probabilities, m (H / tensor) T^2 x 8
  bytes per layer: one layer's in the working set, and every layer's without remat; cuDNN's
  flash attention keeps none.
  """
  n = microbatch * seq_len
  d, c = model.d_model, model.compute_bytes
  wide = 2 * model.d_ff if model.gated_mlp else model.d_ff
  layers = model.n_layers if layers is None else layers
  xla = model.attention_impl == "xla"
  scores = microbatch * model.n_heads / tensor * seq_len * seq_len * 8 if xla else 0.0
  if model.remat:
    saved = n * d * c
    if model.remat_policy != "full":
      saved += n * (4 * d + wide + (0 if xla else d)) * c / tensor
    if model.remat_policy == "save_gemm_io":
      saved += n * (3 * d + model.d_ff) * (1 if _level(level).fp8_gemms else c) / tensor
    working = n * (4 * d + (12 * d + 3 * wide) / tensor) * c + scores
  else:
    saved, working = n * (10 + 24 / tensor) * d + scores, 0.0
  head = n * model.vocab_size * 8 if logits else 0
  return in_flight * layers * saved + working + head


class DeviceMemory(NamedTuple):
  """Bytes on one GPU by term: `state` lives between steps; `backward` (the forward and
  backward of the microbatches) and `update` (the optimizer) are the step's two phases,
  which do not overlap. :attr:`peak` is what the GPU must hold."""

  state: dict
  backward: dict
  update: dict

  @property
  def peak(self) -> float:
    """State + the larger phase."""
    return sum(self.state.values()) + max(sum(self.backward.values()),
                                          sum(self.update.values()))

  @property
  def idle_peak(self) -> float:
    """The peak of a GPU that runs no microbatch: state and update, and the backward's terms
    that do not scale with its microbatches (gradients, decoded and gathered weights: a
    layer-major step gathers each layer on every group)."""
    held = sum(v for k, v in self.backward.items() if k != "activations")
    return sum(self.state.values()) + max(sum(self.update.values()), held)


def fp8_meta_bytes(level: str, gemms: int) -> int:
  """Bytes of the FP8 state of `gemms` GEMMs: per operand role (input, weight, gradient) an
  f32 scale and the amax history of the default recipe."""
  recipe = _level(level).recipe
  return 0 if recipe is None else gemms * 3 * (recipe.amax_history_len + 1) * 4


def device_memory(model: ModelShape, level: str, stage: int, seq_len: int, microbatch: int,
                  microbatches: int = 1, layout: Layout = Layout(),
                  a: Assumptions = Assumptions(), emulated: bool = False,
                  local_grads: bool = False, fused_update: bool | None = None,
                  slots: int | None = None) -> DeviceMemory:
  """Bytes on the fullest GPU of `layout` training `model` at `level` and ZeRO `stage`
  (sharded over ``layout.data``), `microbatches` microbatches of `microbatch` sequences x
  `seq_len` tokens per step. The one memory model of a train step: ``fp8jax simulate``,
  :mod:`fp8jax.parallel.sizing` and ``fp8jax.train.memory`` (the "auto" remat policy) read it.

  Per GPU: the layers of one pipeline stage (``ceil(n_layers / pipeline)``; the first
  stage also holds the embedding and the most in-flight microbatches, the last the LM head
  and the logits; the larger of the two is returned), their kernels split over ``tensor``.
  State: master weights (/N at stage 3), Adam moments (/N from stage 1), FP8 meta. Backward:
  f32 gradients (/N at stage 3: each layer's are reduce-scattered as its backward makes
  them), an f32 accumulator with several microbatches (/N from stage 2), the master decoded
  to the compute dtype (O2/O3; /N at stage 3), FP8 weight casts (below stage 3), at stage 3
  `a.layers_in_flight` layers' gathered kernels (:func:`wire_bytes`) and the f32 gradient of
  the largest kernel (:attr:`ModelShape.largest_kernel`) before its reduce-scatter, that
  kernel widened where FP8 is `emulated`, and :func:`activation_bytes`. Update: the f32
  gradients (/N from stage 2), the update's temporaries (/N from stage 1) and, where an
  all-reduce reduces them (stages 0/1 over several GPUs), its output.

  Args:
    local_grads: the per-group step (``fp8jax.train.step.GroupLoop``: a balanced split or
      FP8 gradient communication). Below stage 3 its loop keeps an f32 accumulator of whole
      gradients, reduced once after the loop. At stage 3 it runs layer-major
      (``fp8jax.parallel.layer_major``): the parameters enter as shards (the FP16 master
      decoded to f32 shards), each layer's kernels are gathered (:func:`wire_bytes`) once
      forward and once backward, its f32 gradients summed over the GPU's microbatches
      (one layer's in flight) and reduce-scattered once into the f32 gradient shards; the
      activations are every microbatch's input to every layer plus the last layer's output
      and its gradient (``slots x (layers + 2)`` of n d c), one layer's working set and
      one microbatch's logits. Leaves ZeRO cannot split stay whole (norm scales of widths
      not divisible by N; not counted).
    slots: microbatches the busiest GPU runs in a layer-major step (default `microbatches`).
    fused_update: whether the step takes the fused O2 update (no update temporaries; with
      one microbatch of the uniform step it reads the BF16 kernel gradients as they come;
      ``fp8jax.train.build.fused_update_fn``); None: where it does by default, one GPU at a
      level with a fused update, stage 0.
  """
  level = _check_level(level)
  stage = _check_stage(level, stage)
  layout = layout.check()
  lv = _level(level)
  per, c = state_bytes_per_param(level), model.compute_bytes
  n, t, pp = layout.data, layout.tensor, layout.pipeline
  layers = -(-model.n_layers // pp)
  layer_kernels, largest = model.layer_kernels / t, model.largest_kernel / t
  layer_major = local_grads and stage == 3
  slots = microbatches if slots is None else slots
  shard3 = n if stage == 3 else 1
  if fused_update is None:  # as fp8jax.train.build.fused_update_fn takes it on GPUs
    fused_update = lv.fused_update and layout.gpus == 1 and stage == 0
  # the fused update reads one microbatch's BF16 kernel gradients as they come (uniform step)
  narrow = fused_update and microbatches == 1 and not local_grads
  out = None
  # in flight on the first stage: the lockstep 1F1B at most 2P - 1, GPipe every microbatch
  in_flight = 1 if pp == 1 else microbatches if layout.schedule == "gpipe" else min(
      microbatches, 2 * pp - 1)
  for first, last in ((True, True),) if pp == 1 else ((True, False), (False, True)):
    kernels = layers * layer_kernels + (model.head_kernels if last else 0)
    others = layers * model.layer_others + (model.embedding if first else 0)
    params = kernels + others
    gemms = layers * (5 if model.gated_mlp else 4) + (1 if last else 0)
    state = {"master weights": per["master"] * params / (n if stage == 3 else 1),
             "Adam moments": (per["m"] + per["v"]) * params / (n if stage >= 1 else 1),
             "FP8 meta": float(fp8_meta_bytes(level, gemms))}
    grads = c * kernels + per["grads"] * others if narrow else per["grads"] * params
    backward = {"gradients": grads / shard3}
    if (microbatches > 1 or local_grads) and not layer_major:
      backward["accumulator"] = per["grads"] * params / (
          shard3 if local_grads else n if stage >= 2 else 1)
    if lv.scaled_master:
      decoded = per["grads"] if local_grads else a.fp8_working_copy_bytes  # f32 / BF16
      backward["decoded weights"] = decoded * params / shard3
    if lv.fp8_gemms and stage < 3:
      backward["FP8 weight casts"] = 1.0 * kernels
    if stage == 3:
      backward["gathered weights"] = a.layers_in_flight * layer_kernels * wire_bytes(level, c)
      backward["weight gradient in flight"] = per["grads"] * (
          layer_kernels if local_grads else largest)
    if emulated and lv.fp8_gemms:
      backward["widened FP8 weight"] = a.emulated_weight_bytes * largest
    if layer_major:  # layer boundaries of every slot, then one layer and head at a time
      backward["activations"] = slots * (layers + 2) * microbatch * seq_len * model.d_model * c \
          + activation_bytes(model, seq_len, microbatch, level, t, 0, 1, last)
    else:
      backward["activations"] = activation_bytes(
          model, seq_len, microbatch, level, t, layers, in_flight if first else 1, last)
    temp = a.update_temp_bytes if lv.scaled_master else a.update_temp_bytes_f32
    update = {"gradients": grads / (n if stage >= 2 else 1),
              "update temporaries": 0.0 if fused_update else temp * params / (
                  n if stage >= 1 else 1)}
    if stage <= 1 and n > 1:
      update["all-reduce output"] = a.all_reduce_copy_bytes * params
    mem = DeviceMemory(state, backward, update)
    if out is None or mem.peak > out.peak:
      out = mem
  return out


def usable_bytes(kind: str, a: Assumptions) -> float:
  """HBM bytes left after the workspace reserve."""
  return gpu_spec(kind).hbm_bytes * (1 - a.workspace_reserve)


def max_microbatch(kind: str, model: ModelShape, seq_len: int, level: str, stage: int,
                   gpus: int, a: Assumptions = Assumptions(), local_grads: bool = False,
                   limit: int = 2**20, microbatches: int = 1) -> int:
  """Largest power of two of sequences (<= `limit`) whose microbatch fits one GPU of `kind`
  (data parallel over `gpus`, :func:`device_memory`; `local_grads`: the balanced per-group
  step); 0 when not even one sequence fits."""
  level = _check_level(level)
  emulated = _level(level).fp8_gemms and not fp8_native(kind)
  fits = lambda m: device_memory(model, level, stage, seq_len, m, microbatches,
                                 Layout(data=gpus), a, emulated, local_grads
                                 ).peak <= usable_bytes(kind, a)
  best, m = 0, 1
  while m <= limit and fits(m):
    best, m = m, 2 * m
  return best


# ----------------------------------------------------------------------------- communication

def link_bandwidth(cluster: ClusterSpec) -> float:
  """Bytes/s per GPU of the ring: NVLink (slowest kind) within one node, else inter-node."""
  if cluster.gpus <= cluster.gpus_per_node:
    return min(gpu_spec(k).nvlink_bw for k, _ in cluster.groups)
  return cluster.inter_node_bw


def ring_seconds(nbytes: float, gpus: int, bw: float, a: Assumptions) -> float:
  """One reduce-scatter or all-gather of `nbytes` (whole buffer) over a ring of `gpus`."""
  if gpus <= 1:
    return 0.0
  return (gpus - 1) / gpus * nbytes / (bw * a.comm_efficiency)


def comm_bytes(level: str, stage: int, kernels: float, others: float, loops: int,
               balanced: bool, grad_comm: str = "native",
               compute_bytes: int = 2) -> dict[str, float]:
  """Ring payloads per step (bytes, whole buffers; an all-reduce counts 2x) by collective.

  `loops`: accumulation iterations of the step (of the busiest GPU with `balanced`, the
  per-group step). Gradients travel as :func:`grad_comm_bytes`. Stage 0/1: one gradient
  all-reduce; stage 1/2 add an all-gather of the updated weights (stored dtype). Stage 2:
  the uniform step reduce-scatters every microbatch's gradients, the balanced one once after
  its loop. Stage 3: each layer's weights gathered twice (forward, and backward or its
  recomputation) as :func:`gather_bytes` and its gradients reduce-scattered: per microbatch
  in the uniform step (fp8jax.fsdp), once per step in the `balanced` (per-group,
  layer-major: fp8jax.parallel.layer_major) step.
  """
  params = kernels + others
  grads = params * grad_comm_bytes(level, grad_comm)
  once = 1 if balanced else loops  # per-group steps reduce once after (or per layer across)
  if stage <= 1:
    out = {"grad all-reduce": 2 * grads}
  else:
    out = {"grad reduce-scatter": once * grads}
  if stage in (1, 2):
    out["weight all-gather"] = params * master_bytes(level)
  if stage == 3:
    out["weight all-gather"] = 2 * once * gather_bytes(level, kernels, others, compute_bytes)
  return out


# ----------------------------------------------------------------------------- prediction

class Split(NamedTuple):
  """One way to run the step (uniform or balanced). Seconds per step; bytes per GPU."""

  feasible: bool
  reason: str                        # why not feasible ("" when it is)
  microbatch: int | None             # sequences per microbatch
  counts: tuple[int, ...] | None     # microbatches per GPU, mesh order
  microbatch_seconds: dict           # {kind: seconds of one microbatch}
  memory: dict                       # {kind: peak bytes per GPU}
  compute_s: float | None
  comm_s: float | None               # before overlap
  optimizer_s: float | None
  step_s: float | None
  tokens_per_s: float | None
  mfu: float | None                  # model FLOPs / sum of BF16 peaks
  idle: tuple[str, ...] = ()         # kinds none of whose GPUs gets a microbatch


class Prediction(NamedTuple):
  """Uniform vs balanced step of one cluster, level and ZeRO stage."""

  cluster: str
  kinds: tuple[str, ...]             # the kind of every GPU, mesh order
  level: str
  zero_stage: int
  seq_len: int
  global_batch: int
  params: int
  emulated: tuple[str, ...]          # kinds whose FP8 GEMMs are emulated at this level
  uniform: Split
  balanced: Split
  speedup: float | None              # uniform step / balanced step
  assumptions: Assumptions


def _kind_seconds(model, seq_len, m, level, kind, a, profiles) -> float | None:
  """Seconds of a microbatch of `m` on `kind`: measured (scaled linearly in m from the
  nearest measured size) when a profile is given, else the FLOP estimate; None: no fit."""
  prof = (profiles or {}).get(kind)
  if prof is None:
    return microbatch_seconds(model, seq_len, m, level, kind, a)
  if m in prof.seconds:
    return prof.seconds[m] if prof.admits(m) else None
  fitting = [s for s in prof.seconds if prof.admits(s)]
  if not fitting or m > max(fitting):
    return None
  near = min(fitting, key=lambda s: (abs(math.log(s / m)), -s))
  return prof.seconds[near] * m / near


def _infeasible(reason: str, seconds=None, memory=None, microbatch=None) -> Split:
  return Split(False, reason, microbatch, None, seconds or {}, memory or {}, None, None, None,
               None, None, None)


def _evaluate(ctx: dict, m: int, balanced: bool) -> Split:
  """The split for microbatch size `m`, or an infeasible Split saying why."""
  model, a, cluster, kinds = ctx["model"], ctx["a"], ctx["cluster"], ctx["kind_list"]
  seconds = {k: _kind_seconds(model, ctx["seq_len"], m, ctx["level"], k, a, ctx["profiles"])
             for k in ctx["kinds"]}
  unmeasured = [k for k in ctx["kinds"] if seconds[k] is None]
  total = ctx["batch"] // m
  counts = None
  if not unmeasured:
    per_gpu = [seconds[k] for k in kinds]
    counts = balance_counts(per_gpu, total) if balanced else uniform_counts(len(kinds), total)
  loops = 2 if total > cluster.gpus else 1  # (an accumulator from 2 on)
  usage = {k: device_memory(model, ctx["level"], ctx["stage"], ctx["seq_len"], m, loops,
                            Layout(data=cluster.gpus), a, k in ctx["emulated"], balanced,
                            slots=max((c for g, c in zip(kinds, counts or ()) if g == k),
                                      default=loops))
           for k in ctx["kinds"]}
  memory = {k: u.peak for k, u in usage.items()}
  too_big = [k for k in ctx["kinds"] if memory[k] > usable_bytes(k, a)]
  if too_big:
    need = ", ".join(f"{k} {memory[k] / GiB:.0f} > {usable_bytes(k, a) / GiB:.0f} GiB"
                     for k in too_big)
    return _infeasible(f"microbatch {m} does not fit: {need}", seconds, memory, m)
  if unmeasured:
    return _infeasible(f"profiles of {unmeasured} do not admit microbatch {m}", seconds,
                       memory, m)
  if counts is None:
    return _infeasible(uniform_reason(ctx["batch"], cluster.gpus, m), seconds, memory, m)
  busy = {k for k, c in zip(kinds, counts) if c > 0}
  idle = tuple(k for k in ctx["kinds"] if k not in busy)
  for k in idle:  # their ZeRO shards only: no microbatch, no activations
    memory[k] = usage[k].idle_peak
  compute = makespan(counts, per_gpu)
  payload = comm_bytes(ctx["level"], ctx["stage"], ctx["kernels"], ctx["others"], max(counts),
                       balanced, compute_bytes=model.compute_bytes)
  comm = sum(ring_seconds(b, cluster.gpus, ctx["bw"], a) for b in payload.values())
  step = compute + (1 - a.overlap) * comm + ctx["optimizer_s"]
  tokens = ctx["batch"] * ctx["seq_len"] / step
  mfu = ctx["flops_per_token"] * tokens / sum(gpu_spec(k).bf16_flops for k in kinds)
  return Split(True, "", m, tuple(counts), seconds, memory, compute, comm, ctx["optimizer_s"],
               step, tokens, mfu, idle)


def uniform_reason(global_batch: int, gpus: int, microbatch: int | None = None) -> str | None:
  """Why `global_batch` sequences have no uniform split over `gpus` GPUs (in microbatches of
  `microbatch`, default: any size), or None when they have one."""
  if global_batch % gpus:
    return (f"the global batch of {global_batch} sequences does not split equally over "
            f"{gpus} GPUs (the uniform split needs a multiple of {gpus} sequences)")
  if microbatch is not None and (global_batch // microbatch) % gpus:
    return (f"{global_batch // microbatch} microbatches of {microbatch} do not split equally "
            f"over {gpus} GPUs")
  return None


def optimizer_seconds(level: str, stage: int, params: int, cluster: ClusterSpec,
                      a: Assumptions) -> float:
  """Update seconds on the slowest-HBM kind; stage >= 1 updates 1/gpus of the params."""
  eff = a.fp8_optimizer_hbm_efficiency if _level(level).scaled_master else a.hbm_efficiency
  bw = min(gpu_spec(k).hbm_bw for k, _ in cluster.groups)
  shard = cluster.gpus if stage >= 1 else 1
  return optimizer_bytes_per_param(level) * params / shard / (bw * eff)


def _candidates(batch: int, microbatch: int | None) -> list[int]:
  """Microbatch sizes to try, largest first: `microbatch`, or powers of two dividing batch."""
  if microbatch is not None:
    if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1 or \
        batch % microbatch:
      raise ValueError(f"microbatch={microbatch!r} is not allowed; use an integer >= 1 that "
                       f"divides the global batch of {batch} sequences")
    return [microbatch]
  return [2**i for i in range(int(math.log2(batch)), -1, -1) if batch % 2**i == 0]


def _best(ctx: dict, sizes: Sequence[int], balanced: bool) -> Split:
  """The largest feasible microbatch whose step is within the tolerance of the fastest."""
  splits = [_evaluate(ctx, m, balanced) for m in sizes]
  ok = [s for s in splits if s.feasible]
  if not ok:
    return splits[-1]  # the smallest size: its reason says what does not fit
  fastest = min(s.step_s for s in ok)
  near = [s for s in ok if s.step_s <= fastest * (1 + ctx["a"].microbatch_tolerance)]
  return max(near, key=lambda s: s.microbatch)


def predict(cluster: ClusterSpec, model: ModelShape, seq_len: int, global_batch: int,
            level: str, zero_stage: int, assumptions: Assumptions = Assumptions(),
            profiles: Mapping[str, KindProfile] | None = None,
            microbatch: int | None = None) -> Prediction:
  """Predicted uniform and balanced step of `cluster` training `model`.

  Args:
    seq_len: tokens per sequence. global_batch: sequences per optimizer step.
    level: "O0".."O3". zero_stage: 0..3 (sharded over all GPUs).
    profiles: {kind: KindProfile} of measured seconds per microbatch; they replace the FLOP
      estimate for that kind (keys: :data:`fp8jax.hardware.GPU_SPECS` names or device
      kinds).
    microbatch: sequences per microbatch, common to all kinds; default: among the powers of
      two that divide the batch and fit every kind, the largest whose step is within
      `assumptions.microbatch_tolerance` of the fastest (chosen for each split).
  A kind that cannot hold the state gives infeasible splits (with the reason), not an error;
  so does the uniform split of a batch that does not divide by the GPU count
  (:func:`uniform_reason`). The prediction does not depend on the order of the cluster's groups.
  """
  level = _check_level(level)
  stage = _check_stage(level, zero_stage)
  a = assumptions.check()
  for name, value in (("seq_len", seq_len), ("global_batch", global_batch)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} is not allowed; use an integer >= 1")
  kernels, others = model.kernel_params, model.other_params
  profiles = {gpu_spec(k).name: p for k, p in (profiles or {}).items()}
  ctx = dict(model=model, a=a, cluster=cluster, kind_list=cluster.kinds(),
             kinds=[k for k, _ in cluster.groups], level=level, stage=stage, kernels=kernels,
             others=others, seq_len=seq_len, batch=global_batch, profiles=profiles,
             bw=link_bandwidth(cluster), flops_per_token=model.flops_per_token(seq_len),
             optimizer_s=optimizer_seconds(level, stage, kernels + others, cluster, a),
             emulated={k for k, _ in cluster.groups
                       if _level(level).fp8_gemms and not fp8_native(k)})
  sizes = _candidates(global_batch, microbatch)
  uneven = uniform_reason(global_batch, cluster.gpus)
  uniform = _infeasible(uneven) if uneven else _best(ctx, sizes, False)
  balanced = _best(ctx, sizes, True)
  speedup = uniform.step_s / balanced.step_s if uniform.feasible and balanced.feasible else None
  emulated = tuple(k for k in ctx["kinds"] if _level(level).fp8_gemms and not fp8_native(k))
  return Prediction(cluster.describe(), ctx["kind_list"], level, stage, seq_len, global_batch,
                    kernels + others, emulated, uniform, balanced, speedup, a)


# ----------------------------------------------------------------------------- profiles

def read_profile(path: str | os.PathLike) -> dict:
  """The JSON written by `fp8jax profile` (checked by :func:`fp8jax.parallel.profile.read`),
  whose device kind must be one of :data:`fp8jax.hardware.GPU_SPECS`."""
  data = profile_lib.read(os.fspath(path))
  gpu_spec(data["device_kind"])
  return data


def load_profile(path: str | os.PathLike) -> KindProfile:
  """KindProfile (kind: the :data:`fp8jax.hardware.GPU_SPECS` name) of a profile JSON;
  seconds per microbatch."""
  data = read_profile(path)
  prof = profile_lib.to_kind_profile(data)
  return KindProfile(gpu_spec(data["device_kind"]).name, dict(prof.seconds), dict(prof.fits))


# ----------------------------------------------------------------------------- table

def _per_kind(values: Mapping, fmt) -> str:
  return " ".join(f"{k}:{fmt(v)}" for k, v in values.items())


def _counts_by_kind(p: Prediction, split: Split) -> dict:
  out: dict = {}
  for k, c in zip(p.kinds, split.counts):
    lo, hi = out.get(k, (c, c))
    out[k] = (min(lo, c), max(hi, c))
  return {k: (str(lo) if lo == hi else f"{lo}-{hi}") + (" (idle)" if k in split.idle else "")
          for k, (lo, hi) in out.items()}


def _row(p: Prediction, name: str, split: Split) -> str:
  """One markdown row of the table."""
  head = f"| {p.level} | {p.zero_stage} | {name} "
  if not split.feasible:
    return head + f"| - | - | - | - | - | - | - | - | infeasible: {split.reason} |"
  gib = _per_kind(split.memory, lambda b: f"{b / GiB:.0f}")
  counts = _per_kind(_counts_by_kind(p, split), str)
  speed = f"{p.speedup:.2f}x" if name == "balanced" and p.speedup else ""
  return (head + f"| {split.microbatch} | {counts} | {split.compute_s:.2f} | {split.comm_s:.2f} "
          f"| {split.optimizer_s:.3f} | {split.step_s:.2f} | {split.tokens_per_s:,.0f} | "
          f"{split.mfu:.3f} | {gib} | {speed} |")


def format_table(predictions: Sequence[Prediction]) -> str:
  """Markdown table of one cluster's predictions (uniform and balanced rows), with the
  assumptions of the first listed above."""
  if not predictions:
    raise ValueError("format_table needs at least one Prediction")
  first = predictions[0]
  emulated = sorted({k for p in predictions for k in p.emulated})
  lines = [f"cluster {first.cluster}: {first.params / 1e9:.2f}B params, batch "
           f"{first.global_batch} x {first.seq_len} tokens; predictions, not measurements"]
  lines += [f"- {line}" for line in first.assumptions.describe()]
  if emulated:
    lines.append(f"- FP8 emulated on {', '.join(emulated)} (no FP8 tensor cores)")
  lines += ["", "| level | ZeRO | split | mb | microbatches/GPU | compute s | comm s | optim s "
            "| step s | tokens/s | MFU (BF16 peak) | GiB/GPU | speedup |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in predictions:
    lines += [_row(p, "uniform", p.uniform), _row(p, "balanced", p.balanced)]
  if any(s.idle for p in predictions for s in (p.uniform, p.balanced)):
    lines += ["", "(idle): GPUs of that kind get no microbatch (the others finish sooner); "
              "they hold their ZeRO shards and take part in the collectives (and the gathers of "
              "each layer), so their GiB/GPU has no activations"]
  return "\n".join(lines)
