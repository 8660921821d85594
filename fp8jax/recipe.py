"""FP8 recipes and the MS-AMP optimization levels O0..O3.

A :class:`Recipe` says how tensors are cast to FP8 (formats, how the per-tensor scale is
chosen). An :class:`OptLevel` says which parts of training run in low precision: the GEMMs'
recipe, the master weight and Adam moment dtypes (``fp8jax.optim``) and the lowest ZeRO stage
(``fp8jax.parallel``); ``fp8jax.train`` builds a run's step from them.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2

_FORMAT_NAMES = {"e4m3": E4M3, "e5m2": E5M2}
_FWD_FORMATS = (E4M3,)
_BWD_FORMATS = (E5M2, E4M3)
AMAX_COMPUTE_ALGOS = ("max", "most_recent")
SCALINGS = ("delayed", "current")
GRANULARITIES = ("tensor", "rowwise")


def _as_fp8_format(field: str, value: Any, allowed: tuple) -> Any:
  """Resolves "e4m3"/"e5m2" or a dtype to a jnp FP8 dtype; raises naming `field`."""
  short = {np.dtype(v): k for k, v in _FORMAT_NAMES.items()}
  allowed_names = [f"{short[np.dtype(d)]!r} ({np.dtype(d).name})" for d in allowed]
  dtype = _FORMAT_NAMES.get(value, value) if isinstance(value, str) else value
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype is None or dtype not in [np.dtype(d) for d in allowed]:
    raise ValueError(f"Recipe.{field}={value!r} is not allowed; use one of "
                     f"{', '.join(allowed_names)}")
  return dtype.type


@dataclasses.dataclass(frozen=True)
class Recipe:
  """How tensors of one FP8 GEMM are scaled and cast.

  Attributes:
    fwd_format: FP8 type of forward operands (activations, weights). Only E4M3: an E5M2
      forward operand would make the input-gradient GEMM E5M2 x E5M2, which is illegal.
    bwd_format: FP8 type of the output gradient (E5M2 by default, "HYBRID" in TE's words).
    amax_history_len: number of past amax values kept per tensor (>= 1).
    amax_compute_algo: "max" (max over the history) or "most_recent".
    margin: scale headroom in powers of two: amax maps to fp8_max / 2**margin (>= 0).
    scaling: "delayed" (scale from past amaxes, one pass over the tensor) or "current"
      (just-in-time: scale from this tensor's own amax, one extra reduction).
    power_of_two_scales: round every scale up to a power of two (MS-AMP), so that scaling
      is exact in binary floating point.
    bwd_fast_accumulation: which backward FP8 GEMMs accumulate in the tensor cores'
      reduced precision too (forward GEMMs always do): False (neither: input and weight
      gradients accumulate in exact f32, the default), True (both), or "dgrad" (the
      input-gradient GEMM only, whose contraction runs over the output features; the
      weight-gradient GEMM, contracting over every token, stays exact).
    fused_cast_transpose: cast activations and output gradients with one fused Pallas
      (Triton) pass that also writes the transposed FP8 copy and the amax
      (:mod:`fp8jax.kernels.cast_transpose`); the weight-gradient GEMM then reads both
      operands K-major. GPU-only, native FP8 only; elsewhere (and for shapes the kernel does
      not tile) the XLA path runs. Same FP8 values either way (up to XLA's excess-precision
      fusion of a producer into its own cast).
    calibrated: every FP8 state this recipe casts with has observed a tensor already (the
      Trainer's first step, or a restored run). Delayed casts then use the stored scale with
      no just-in-time fallback for a never-observed state, so a cast no longer waits for its
      own tensor's amax and XLA computes both in one pass over the tensor instead of two. A
      never-observed state would cast with its initial scale of 1. Ignored by current
      scaling.
    granularity: "tensor" (one scale per tensor) or "rowwise" (one scale per row of each
      GEMM operand along the axis that GEMM contracts: activations and output gradients per
      token row, weights per output column in the forward; :mod:`fp8jax.rowwise`). Row-wise
      is current scaling only (each row's own amax: `scaling` must be "current"); its GEMMs
      run with unit scales and the row scales are applied to the GEMM's output. Not with
      ZeRO-3 weight gathers or weights cast outside the GEMM; `fused_cast_transpose` and
      the activation / RMSNorm inside the cast fall back to XLA ops.
  """

  fwd_format: Any = E4M3
  bwd_format: Any = E5M2
  amax_history_len: int = 16
  amax_compute_algo: str = "max"
  margin: int = 0
  scaling: str = "delayed"
  power_of_two_scales: bool = False
  bwd_fast_accumulation: bool | str = False
  fused_cast_transpose: bool = False
  calibrated: bool = False
  granularity: str = "tensor"

  def __post_init__(self):
    object.__setattr__(self, "fwd_format", _as_fp8_format("fwd_format", self.fwd_format, _FWD_FORMATS))
    object.__setattr__(self, "bwd_format", _as_fp8_format("bwd_format", self.bwd_format, _BWD_FORMATS))
    if not isinstance(self.amax_history_len, (int, np.integer)) or isinstance(self.amax_history_len, bool) \
        or self.amax_history_len < 1:
      raise ValueError(f"Recipe.amax_history_len={self.amax_history_len!r} is not allowed; use an integer >= 1")
    if self.amax_compute_algo not in AMAX_COMPUTE_ALGOS:
      raise ValueError(f"Recipe.amax_compute_algo={self.amax_compute_algo!r} is not allowed; "
                       f"use one of {list(AMAX_COMPUTE_ALGOS)}")
    if isinstance(self.margin, bool) or not isinstance(self.margin, (int, float, np.integer, np.floating)) \
        or not np.isfinite(self.margin) or self.margin < 0:
      raise ValueError(f"Recipe.margin={self.margin!r} is not allowed; use a finite number >= 0")
    if self.scaling not in SCALINGS:
      raise ValueError(f"Recipe.scaling={self.scaling!r} is not allowed; use one of {list(SCALINGS)}")
    if not (isinstance(self.bwd_fast_accumulation, (bool, np.bool_))
            or self.bwd_fast_accumulation == "dgrad"):
      raise ValueError(f"Recipe.bwd_fast_accumulation={self.bwd_fast_accumulation!r} is not "
                       "allowed; use True, False or \"dgrad\"")
    for flag in ("power_of_two_scales", "fused_cast_transpose", "calibrated"):
      if not isinstance(getattr(self, flag), (bool, np.bool_)):
        raise ValueError(f"Recipe.{flag}={getattr(self, flag)!r} is not allowed; use True or False")
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"Recipe.granularity={self.granularity!r} is not allowed; use one of "
                       f"{list(GRANULARITIES)}")
    if self.granularity == "rowwise" and self.scaling != "current":
      raise ValueError(f"Recipe.scaling={self.scaling!r} is not allowed with "
                       "granularity='rowwise' (each row is scaled by its own amax, current "
                       "scaling); use scaling='current'")

  @property
  def rowwise(self) -> bool:
    """True when GEMM operands are scaled per row (``granularity="rowwise"``)."""
    return self.granularity == "rowwise"

  @property
  def dgrad_fast(self) -> bool:
    """True when the input-gradient GEMM accumulates in reduced precision."""
    return bool(self.bwd_fast_accumulation)  # True or "dgrad"

  @property
  def wgrad_fast(self) -> bool:
    """True when the weight-gradient GEMM accumulates in reduced precision."""
    return self.bwd_fast_accumulation is True or self.bwd_fast_accumulation is np.True_

  def replace(self, **changes) -> "Recipe":
    """A copy with `changes` applied (validated again)."""
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class OptLevel:
  """One MS-AMP optimization level (the level table of docs/architecture.md).

  Attributes:
    name: "O0".."O3".
    recipe: FP8 recipe of the GEMMs; None means BF16 GEMMs (O0).
    master_dtype: dtype of master weights (O2/O3 keep FP16 with a per-tensor scale).
    mu_dtype, nu_dtype: Adam first/second moment storage dtypes.
    zero_stage: lowest ZeRO stage the level runs at (O3: 1, it always shards; the others
      run at the configured stage). Ask :meth:`zero_stage_for` for a run's stage.
  """

  name: str
  recipe: Recipe | None
  master_dtype: Any
  mu_dtype: Any
  nu_dtype: Any
  zero_stage: int = 0

  @property
  def fp8_gemms(self) -> bool:
    """True when the level's GEMMs run in FP8 (then its weight gradients are FP8 too and
    may travel between devices in FP8); False: BF16 GEMMs (O0)."""
    return self.recipe is not None

  @property
  def scaled_master(self) -> bool:
    """True when master weights are stored narrower than f32 (`master_dtype`, FP16) with a
    per-tensor scale (``fp8jax.optim.master``); False: plain f32 parameters (O0, O1)."""
    return np.dtype(self.master_dtype).itemsize < 4

  @property
  def scaled_moments(self) -> bool:
    """True when Adam's moments are stored narrower than f32 (`mu_dtype` / `nu_dtype` with a
    scale, ``fp8jax.optim.adamw``); False: f32 moments (optax's AdamW)."""
    return np.dtype(self.mu_dtype).itemsize < 4 or np.dtype(self.nu_dtype).itemsize < 4

  @property
  def fused_update(self) -> bool:
    """True when the one-kernel AdamW + master-weight update (``fp8jax.optim.fused``) can
    serve this level: scaled master weights and moments, and no sharding the level itself
    asks for (the kernel runs on unsharded arrays). O2 only."""
    return self.scaled_master and self.scaled_moments and self.zero_stage == 0

  def zero_stage_for(self, configured: int) -> int:
    """The ZeRO stage a run at this level uses when `configured` (0..3) is asked for: at
    least the level's own `zero_stage`."""
    return max(configured, self.zero_stage)


# torchao's row-wise training recipe (Float8LinearRecipeName.ROWWISE): every operand of the
# three GEMMs scaled per row along its contraction, E4M3 for the output gradient too,
# power-of-two scales, fast accumulation in all three GEMMs.
ROWWISE = Recipe(granularity="rowwise", scaling="current", bwd_format=E4M3,
                 power_of_two_scales=True, bwd_fast_accumulation=True)

O0 = OptLevel("O0", None, jnp.float32, jnp.float32, jnp.float32)
O1 = OptLevel("O1", Recipe(), jnp.float32, jnp.float32, jnp.float32)
O2 = OptLevel("O2", Recipe(), jnp.float16, E4M3, jnp.float16)
O3 = OptLevel("O3", Recipe(), jnp.float16, E4M3, jnp.float16, zero_stage=1)
LEVELS = {lvl.name: lvl for lvl in (O0, O1, O2, O3)}


def format_name(dtype: Any) -> str:
  """The short name ("e4m3", "e5m2") that :class:`Recipe` accepts for FP8 type `dtype`."""
  names = {np.dtype(v): k for k, v in _FORMAT_NAMES.items()}
  return names[np.dtype(dtype)]


def opt_level(name: str) -> OptLevel:
  """Looks a level up by name ("O0".."O3", case-insensitive)."""
  key = str(name).upper()
  if key not in LEVELS:
    raise ValueError(f"opt level {name!r} is not allowed; use one of {sorted(LEVELS)}")
  return LEVELS[key]
