"""What the step-time and memory models read: the model's shape, the modelling constants, and
bytes per parameter by level.

:class:`ModelShape` holds a decoder-only transformer's facts as plain numbers
(``fp8jax.train.memory.model_shape`` builds one from a model config); :class:`Assumptions`
holds every modelling constant of :mod:`fp8jax.parallel.cost_model` (step time) and
:mod:`fp8jax.parallel.step_memory` (bytes per GPU), each with the measurement or guess behind
it; the per-parameter byte counts follow the levels of :mod:`fp8jax.recipe`. Pure Python: no
devices are needed.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

from fp8jax.recipe import LEVELS, OptLevel, opt_level

STAGES = (0, 1, 2, 3)


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



# ----------------------------------------------------------------------------- assumptions

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

