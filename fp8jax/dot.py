"""FP8 dot_general with delayed or current scaling (a ``jax.custom_vjp``).

Forward: both operands cast to the recipe's forward format (E4M3) and fed *as FP8 arrays*
to ``lax.dot_general`` (XLA rewrites exactly that into a cuBLASLt FP8 GEMM on sm_89+).
Backward: the output gradient cast to the backward format (E5M2); input gradient
``g x w^T`` and weight gradient ``x^T g`` are E5M2 x E4M3 FP8 GEMMs (never E5M2 x E5M2).
The FP8 operands are the residuals, so saved activations take 1 byte per element. The
weight's cast (FP8 payload, scale, amax) is tagged ``checkpoint_name(.., WEIGHT_CAST_NAME)``:
under ``jax.checkpoint`` / ``nn.remat`` with a policy that saves that name (see
:data:`SAVE_FP8_WEIGHTS`) the backward's recomputation reuses it instead of casting again.
The activation's cast (its FP8 residual, scale, amax) is tagged ``INPUT_CAST_NAME`` the same
way.

A weight that lives sharded (ZeRO-3, ``weight_shardings``, :mod:`fp8jax.fsdp`) is cast as its
shard with the tensor's scale (the replicated state's delayed scale, or the global amax) and
its E4M3 bytes are all-gathered for the GEMM; the residual is the cast shard (tagged
``WEIGHT_CAST_NAME``), gathered again in the backward, and the weight gradient is summed
over the devices in f32 into the shards. Any ``dot_general`` layout is brought to one
[B?, M, K] @ [B?, K, N] matmul, its weight's shardings with it (:mod:`fp8jax.dot_layout`).

With ``Recipe(fused_cast_transpose=True)`` (GPU, native FP8) activations and output gradients
are cast by one fused kernel (:mod:`fp8jax.kernels.cast_transpose`) that also writes their
transposed FP8 copies and amaxes; the residual is the transposed activation, and the weight
gradient contracts the last axes of both transposed operands (cuBLASLt's "TN" layout).

:func:`fp8_mlp_chained` runs an MLP's two GEMMs as one custom VJP: its activation inside the
second GEMM's input cast, the activation's derivative inside the cast of the gradient entering
the first (one kernel pass each with the fused kernel).

With ``Recipe(granularity="rowwise")`` the GEMM runs :func:`fp8jax.rowwise.matmul` instead:
one scale per row of each operand along its GEMM's contraction, unit-scale FP8 GEMMs whose
f32 outputs the scales multiply; an activation or RMSNorm of the lhs, and the MLP op, run as
XLA ops around row-wise GEMMs (no fused kernel, no weight cast outside, no ZeRO-3 gather).

The updated :class:`Fp8DotMeta` comes back from the backward pass as the cotangent of the
meta argument (the overwrite-with-gradient convention): ``jax.grad`` with respect to the meta
returns the new meta. :func:`fp8_dot_general_chained` also returns the meta unchanged as a
second output; a later call that consumes it passes its own update back through it, and the
two updates combine by max, so a layer that is called twice never sums its FP8 state.

Where FP8 GEMMs cannot run (a device without FP8 tensor cores, or a shape cuBLASLt refuses)
the identical quantized math runs with FP8 values upcast exactly (BF16 on GPUs, F32 on CPUs)
and f32 accumulation ("emulated"). The per-process decision is
:func:`fp8jax.hardware.native_fp8_reason` (re-exported here): by default from the run's
devices, or the plan all processes agreed on (:mod:`fp8jax.parallel.capability`). Emulation
is logged once per reason; a reason that comes from an installed plan is left to whoever
installed it (the Trainer prints the plan), so a run reports it once.
"""
from __future__ import annotations

import functools
import logging
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from fp8jax import fsdp, rowwise, scaling
from fp8jax.dot_layout import agree_on_vma, canonical_dims, explicit_shardings, to_vma, \
    vma_of, weight_gather
from fp8jax.hardware import active_plan, native_fp8_reason
from fp8jax.kernels import cast_transpose as ct
from fp8jax.recipe import Recipe
from fp8jax.scaling import Fp8Meta

logger = logging.getLogger("fp8jax")
_LOGGED: set[str] = set()
_NATIVE_OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# checkpoint_name of each GEMM's weight cast: FP8 payload (1 byte per weight), scale, amax.
WEIGHT_CAST_NAME = "fp8jax_weight"
# checkpoint_name of each GEMM's activation cast: the FP8 residual of the weight gradient
# (q_x_t with the fused kernel), its scale and amax. Saved (model.remat_policy "save_gemm_io")
# together with the GEMM's output, the recomputation casts no activation again.
INPUT_CAST_NAME = "fp8jax_input_cast"
# checkpoint_name of a projection's output (the models name theirs; fp8_mlp names its hidden
# pre-activation): saved by the remat policies that keep GEMM outputs.
GEMM_OUTPUT_NAME = "fp8jax_gemm_output"
# Remat policy that saves the weight casts and recomputes everything else.
SAVE_FP8_WEIGHTS = jax.checkpoint_policies.save_only_these_names(WEIGHT_CAST_NAME)


class WeightCast(NamedTuple):
  """A GEMM weight already cast to the forward format (see :func:`cast_weight`).

  q: the FP8 payload, shaped like the weight; scale, amax: f32[] (the cast's scale and the
  weight's amax, which updates the kernel's FP8 state).
  """

  q: jax.Array
  scale: jax.Array
  amax: jax.Array


def cast_weight(w, meta: Fp8Meta, recipe: Recipe, amax_axes: Sequence[str] = ()) -> WeightCast:
  """The forward cast of weight `w` with its FP8 state `meta`: exactly what
  :func:`fp8_dot_general` computes for its rhs, so a cast done once (e.g. before a loop over
  microbatches) and passed as ``weight_cast`` gives bit-identical results."""
  amax = scaling.compute_amax(w, amax_axes)
  scale = scaling.scale_for_cast(meta, amax, recipe, recipe.fwd_format)
  return WeightCast(scaling.quantize(w, scale, recipe.fwd_format), scale, amax)


class Fp8DotMeta(NamedTuple):
  """FP8 state of one GEMM: one :class:`Fp8Meta` per tensor role."""

  input: Fp8Meta
  kernel: Fp8Meta
  output_grad: Fp8Meta


def init_dot_meta(recipe: Recipe = Recipe()) -> Fp8DotMeta:
  """Fresh state for one FP8 GEMM under `recipe`."""
  m = scaling.init_meta(recipe.amax_history_len)
  return Fp8DotMeta(m, m, m)


def log_once(message: str, level: int = logging.WARNING) -> None:
  """Logs `message` (at `level`, WARNING by default) the first time it is seen in this
  process."""
  if message not in _LOGGED:
    _LOGGED.add(message)
    logger.log(level, message)


def _gemm_reason(m: int, k: int, n: int, out_dtype) -> str | None:
  """None when cuBLASLt takes an FP8 GEMM of this shape and output dtype."""
  if any(d % 16 for d in (m, k, n)):
    return f"GEMM shape (M={m}, K={k}, N={n}) is not a multiple of 16"
  if np.dtype(out_dtype) not in [np.dtype(d) for d in _NATIVE_OUT_DTYPES]:
    return f"output dtype {np.dtype(out_dtype).name} is not bf16/f16/f32"
  return None


class _Config(NamedTuple):
  """Static (hashable) arguments of the canonical FP8 matmul."""

  recipe: Recipe
  out_dtype: Any
  native: bool
  amax_axes: tuple[str, ...]
  x_dtype: Any
  w_dtype: Any
  meta_vma: frozenset = frozenset()  # manual mesh axes the meta varies over (shard_map)
  x_sharding: Any = None  # explicit-mode shardings for the backward GEMMs' outputs
  w_sharding: Any = None
  fused: bool = False  # activations / output gradients cast by the fused cast+transpose kernel
  weight_cast: bool = False  # the weight arrives cast (a WeightCast)
  activation: str | None = None  # x arrives before this activation (applied in the cast)
  norm_eps: float | None = None  # x arrives before RMSNorm (this epsilon; its gain an operand)
  # (home, gathered, keep) for the canonical w: w lives sharded (home), its E4M3 cast is
  # all-gathered for the GEMM and again in the backward (unless keep: the gathered bytes are
  # the residual), its gradient reduce-scattered
  w_gather: Any = None


def _emulation_dtype():
  """BF16 on GPUs (tensor-core GEMMs with f32 accumulation: pre-Ada GPUs emulate at BF16
  speed), F32 elsewhere (CPUs have no fast BF16 GEMM)."""
  return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def _mm(a, b, contract: tuple[int, int], scale, out_dtype, native: bool, fast_accum: bool,
        out_sharding=None):
  """scale * (a @ b) contracting a's axis contract[0] with b's contract[1]; axis 0 batched
  when both are 3-D.

  Native: the FP8 arrays go straight to dot_general. `fast_accum` (Precision.DEFAULT) lets
  cuBLASLt accumulate in the tensor cores' reduced precision, which is fine for forward
  GEMMs; backward GEMMs (long contractions over tokens) ask for HIGHEST, i.e. exact f32
  accumulation, unless the recipe sets `bwd_fast_accumulation`. The GEMM writes bf16/f32
  directly and the scale is applied in that dtype (f16 goes through f32: unscaled sums can
  exceed its range).
  """
  batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
  dn = (((contract[0],), (contract[1],)), batch)
  if not native:  # FP8 values are exact in BF16 (and F32): the products are the same
    wide = _emulation_dtype()
    exact = lax.Precision.DEFAULT if wide == jnp.bfloat16 else lax.Precision.HIGHEST
    y = lax.dot_general(a.astype(wide), b.astype(wide), dn,
                        precision=exact, preferred_element_type=jnp.float32,
                        out_sharding=out_sharding)
    return (y * scale).astype(out_dtype)
  precision = lax.Precision.DEFAULT if fast_accum else lax.Precision.HIGHEST
  gemm_dtype = jnp.float32 if np.dtype(out_dtype) == np.dtype(jnp.float16) else out_dtype
  y = lax.dot_general(a, b, dn, precision=precision, preferred_element_type=gemm_dtype,
                      out_sharding=out_sharding)
  return (y * scale.astype(gemm_dtype)).astype(out_dtype)


def _scale_before_cast(x, meta: Fp8Meta, recipe: Recipe, fmt, amax_axes, activation=None,
                       activation_input=None, norm=None):
  """scaling.scale_for_cast of ``ct.cast_operand(x, activation, activation_input, norm)``
  without the amax pass where delayed scaling does not need it: the tensor's amax is computed
  first only for current scaling or a never-observed meta."""
  cur = lambda: scaling.scale_for_cast(meta, scaling.compute_amax(
      ct.cast_operand(x, activation, activation_input, norm), amax_axes), recipe, fmt)
  if recipe.scaling == "current":
    return cur()
  if recipe.calibrated:
    return meta.scale
  return lax.cond(jnp.max(meta.amax_history) <= 0, cur, lambda: meta.scale)


def _fused_cast(x, meta: Fp8Meta, recipe: Recipe, fmt, amax_axes, activation=None,
                activation_input=None, norm=None):
  """(q, q_t, amax, scale) of x[B?, M, K] (or of ``ct.cast_operand(x, activation,
  activation_input, norm)``) in one pass of the fused kernel; same values as scale_for_cast +
  quantize + compute_amax."""
  scale = _scale_before_cast(x, meta, recipe, fmt, amax_axes, activation, activation_input,
                             norm)
  q, q_t, amax = ct.cast_transpose_amax(x, scale, fmt, interpret=jax.default_backend() != "gpu",
                                        activation=activation, activation_input=activation_input,
                                        norm=norm)
  if amax_axes:
    amax = lax.pmax(amax, tuple(amax_axes))
  return q, q_t, amax, scale


def _fused_reason(x_shape, x_dtype, g_shape, g_dtype, recipe: Recipe, native: bool,
                  activation: str | None = None, grad_activation: str | None = None
                  ) -> str | None:
  """None when Recipe.fused_cast_transpose can use the kernel for this GEMM, else why not.
  `activation`: applied in x's cast (x_shape: its input); `grad_activation`: the derivative
  applied in the output gradient's cast (g_shape: that of the GEMM's output)."""
  if not native and jax.default_backend() == "gpu":
    return "FP8 GEMMs are emulated on this GPU"
  if jax.device_count() > 1 and not ct.interpreting_anywhere():
    return ("more than one device: a Pallas call has no partitioning rule, XLA would gather "
            "sharded operands around it")
  return (ct.kernel_reason(x_shape, x_dtype, recipe.fwd_format, activation=activation)
          or ct.kernel_reason(g_shape, g_dtype, recipe.bwd_format, activation=grad_activation))


def _native_reason(m: int, k: int, n: int, out_dtype) -> str | None:
  """Why an [M, K] @ [K, N] GEMM is emulated (None: native FP8), logged once per reason."""
  reason = native_fp8_reason() or _gemm_reason(m, k, n, out_dtype)
  if reason and not (active_plan() is not None and reason == native_fp8_reason()):
    # (an installed plan's reason is reported by whoever installed it: the Trainer prints it)
    log_once(f"fp8jax: FP8 GEMMs emulated (same quantized math in f32): {reason}")
  return reason


def _uses_fused_kernel(x_shape, x_dtype, g_shape, g_dtype, recipe: Recipe, native: bool,
                       in_shard_map: bool, activation: str | None = None,
                       grad_activation: str | None = None) -> bool:
  """Whether the GEMM casts with the fused kernel (Recipe.fused_cast_transpose, where it runs);
  the reason it does not is logged once (a speed note: same values either way)."""
  if not recipe.fused_cast_transpose:
    return False
  why = _fused_reason(x_shape, x_dtype, g_shape, g_dtype, recipe, native, activation,
                      grad_activation)
  if why is None and in_shard_map:
    why = "inside shard_map (the kernel is not checked there yet)"
  if why:
    log_once(f"fp8jax: fused cast+transpose kernel not used, XLA casts instead: {why}",
             logging.INFO)
  return why is None


def _name_cast(name: str, *arrays):
  """`arrays` tagged for remat (:func:`fp8jax.scaling.checkpoint_named`)."""
  return scaling.checkpoint_named(name, *arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _fp8_matmul(x, w, meta: Fp8DotMeta, wc: WeightCast | None, gain, cfg: _Config):
  """x[B?, M, K] @ w[B?, K, N] in FP8; returns (y[B?, M, N], meta). `wc`: w's cast, already
  done (w itself then only receives the weight gradient), or None. With ``cfg.norm_eps`` the
  GEMM multiplies ``ct.rms_norm(x, gain, cfg.norm_eps)`` (gain [K]); else gain is None."""
  return _fp8_matmul_fwd(x, w, meta, wc, gain, cfg)[0]


def _fp8_matmul_fwd(x, w, meta: Fp8DotMeta, wc: WeightCast | None, gain, cfg: _Config):
  r = cfg.recipe
  # The activation's / norm's backward needs its input.
  x_pre = x if cfg.activation or cfg.norm_eps is not None else None
  norm = None if cfg.norm_eps is None else (ct.rms_norm_rstd(x, cfg.norm_eps), gain)
  if cfg.fused:
    qx, qx_saved, ax, sx = _fused_cast(x, meta.input, r, r.fwd_format, cfg.amax_axes,
                                       cfg.activation, norm=norm)
  else:
    x = ct.cast_operand(x, cfg.activation, norm=norm)
    ax = scaling.compute_amax(x, cfg.amax_axes)
    sx = scaling.scale_for_cast(meta.input, ax, r, r.fwd_format)
    qx = qx_saved = scaling.quantize(x, sx, r.fwd_format)
  qx_saved, sx, ax = _name_cast(INPUT_CAST_NAME, qx_saved, sx, ax)
  if wc is None and cfg.w_gather is not None:  # cast the shard, gather its E4M3 bytes
    qw, sw, aw = cast_weight(w, meta.kernel, r, cfg.amax_axes)
    qw_saved, sw, aw = _name_cast(WEIGHT_CAST_NAME, fsdp.constrain_bits(qw, cfg.w_gather[0]),
                                  sw, aw)
    qw = fsdp.constrain_bits(qw_saved, cfg.w_gather[1])
    if cfg.w_gather[2]:
      qw_saved = qw
  elif wc is None:
    qw, sw, aw = _name_cast(WEIGHT_CAST_NAME, *cast_weight(w, meta.kernel, r, cfg.amax_axes))
    qw_saved = qw
  else:  # cast once outside (an input: nothing to save or recompute)
    qw, sw, aw = wc
    qw_saved = qw
  k_axis = x.ndim - 1
  y = _mm(qx, qw, (k_axis, k_axis - 1), sx * sw, cfg.out_dtype, cfg.native, True)
  # Fused: the residual is x's transposed copy q_x_t[.., K, M], ready for the TN wgrad GEMM.
  # Gathered weights keep only their shard; the backward gathers it again.
  res = (qx_saved, qw_saved, sx, sw, meta, ax, aw, x_pre, gain)
  return (y, meta), res


def _fp8_matmul_bwd(cfg: _Config, res, cts):
  return _matmul_bwd(cfg, res, *cts)


def _matmul_bwd(cfg: _Config, res, g, meta_ct, out_activation: str | None = None,
                out_activation_input=None, through_activation: bool = True):
  """The backward of :func:`_fp8_matmul`. With `out_activation`, g is the cotangent of
  ``activate(y, out_activation)`` for this GEMM's output y = `out_activation_input`: the
  activation's derivative is applied in the gradient's cast. ``through_activation=False``
  returns the cotangent of the activated lhs (cfg.activation's derivative left to the
  caller). Returns the cotangents of (x, w, meta, wc, gain)."""
  qx, qw, sx, sw, meta, ax, aw, x_pre, gain = res  # fused: qx is q_x_t[.., K, M]
  r = cfg.recipe
  g = scaling.dense_cotangent(g)
  if cfg.fused:
    qg, qg_t, ag, sg = _fused_cast(g, meta.output_grad, r, r.bwd_format, cfg.amax_axes,
                                   out_activation, out_activation_input)
  else:
    g = ct.cast_operand(g, out_activation, out_activation_input)
    ag = scaling.compute_amax(g, cfg.amax_axes)
    sg = scaling.scale_for_cast(meta.output_grad, ag, r, r.bwd_format)
    qg = scaling.quantize(g, sg, r.bwd_format)
  if cfg.w_gather is not None and not cfg.w_gather[2]:  # gathered again, once g is here
    qw = fsdp.constrain_bits(qw, cfg.w_gather[1], qg)
  m_axis = g.ndim - 2
  # dgrad: g[.., M, N] . w[.., K, N] over N -> [.., M, K]; wgrad: x[.., M, K] . g[.., M, N]
  # over M -> [.., K, N]. Both are E5M2 x E4M3.
  dx = _mm(qg, qw, (m_axis + 1, m_axis + 1), sg * sw, cfg.x_dtype, cfg.native, r.dgrad_fast,
           cfg.x_sharding)
  # A gathered weight's gradient is summed over the devices in f32 (reduce-scattered to the
  # shards), then rounded once to w's dtype, as one device's GEMM output is.
  w_out = jnp.float32 if cfg.w_gather is not None else cfg.w_dtype
  if cfg.fused:  # TN: q_x_t[.., K, M] . q_g_t[.., N, M] over M (both last) -> [.., K, N]
    dw = _mm(qx, qg_t, (m_axis + 1, m_axis + 1), sx * sg, w_out, cfg.native, r.wgrad_fast,
             cfg.w_sharding)
  else:
    dw = _mm(qx, qg, (m_axis, m_axis), sx * sg, w_out, cfg.native, r.wgrad_fast,
             cfg.w_sharding)
  if cfg.w_gather is not None:
    dw = fsdp.sum_into(dw, cfg.w_gather[0], cfg.w_dtype)
  if cfg.activation and through_activation:  # recomputed from its input (elementwise)
    dx = ct.activation_grad(dx, x_pre, cfg.activation)
  d_gain = None
  if cfg.norm_eps is not None:  # RMSNorm's backward, recomputed from its input
    dx, d_gain = jax.vjp(lambda v, g: ct.rms_norm(v, g, cfg.norm_eps), x_pre, gain)[1](
        dx.astype(x_pre.dtype))
  # The three delayed updates (x's and w's amaxes from the forward, g's) as one.
  new_meta = Fp8DotMeta(*scaling.update_metas(
      meta, (ax, aw, ag), r, (r.fwd_format, r.fwd_format, r.bwd_format)))
  new_meta = jax.tree.map(lambda a: to_vma(a, cfg.meta_vma), new_meta)
  wc_ct = WeightCast(jnp.zeros_like(qw), jnp.zeros_like(sw), jnp.zeros_like(sw)) \
      if cfg.weight_cast else None  # a cast is not differentiated (w gets the weight gradient)
  return dx, dw, scaling.combine_cotangent(new_meta, meta_ct), wc_ct, d_gain


# (symbolic zeros: a single call's unused meta passthrough costs no combine in the backward)
_fp8_matmul.defvjp(scaling.primal_values_fwd(_fp8_matmul_fwd, (5,)), _fp8_matmul_bwd,
                   symbolic_zeros=True)


def _check_weight_cast(wc, rhs, recipe: Recipe, vma: frozenset) -> None:
  """Raises for a weight_cast that is not a WeightCast of rhs in the recipe's format."""
  if not isinstance(wc, WeightCast):
    raise TypeError(f"weight_cast must be an fp8jax.dot.WeightCast, got {type(wc).__name__}; "
                    "use fp8jax.dot.cast_weight(rhs, meta.kernel, recipe)")
  if wc.q.shape != rhs.shape or np.dtype(wc.q.dtype) != np.dtype(recipe.fwd_format):
    raise ValueError(f"weight_cast.q is {np.dtype(wc.q.dtype).name}{list(wc.q.shape)}; the rhs "
                     f"needs {np.dtype(recipe.fwd_format).name}{list(rhs.shape)}")
  if any(jnp.shape(a) != () for a in wc[1:]):
    raise ValueError(f"weight_cast scale and amax must be scalars, got shapes "
                     f"{[jnp.shape(a) for a in wc[1:]]}")
  if vma:
    raise ValueError("weight_cast inside shard_map is not supported; let the GEMM cast its "
                     "weight (amaxes agreed over amax_axes)")


def _check_lhs_norm(lhs_norm, lhs, dimension_numbers, lhs_activation):
  """(gain, eps) of a valid ``lhs_norm`` (or (None, None) without one); ValueError/TypeError
  saying what is wrong otherwise."""
  if lhs_norm is None:
    return None, None
  try:
    gain, eps = lhs_norm
  except (TypeError, ValueError):
    raise TypeError(f"lhs_norm must be (gain, eps), got {type(lhs_norm).__name__}") from None
  gain = jnp.asarray(gain)
  (lc, _), (lb, _) = dimension_numbers
  k = jnp.shape(lhs)[-1] if jnp.ndim(lhs) else None
  if tuple(int(a) for a in lc) != (jnp.ndim(lhs) - 1,) or tuple(lb):
    raise ValueError(f"lhs_norm normalizes lhs's last axis, which must be its one contracting "
                     f"axis (no batch axes); got dimension_numbers {dimension_numbers} for lhs "
                     f"{list(jnp.shape(lhs))}")
  if gain.shape != (k,) or not jnp.issubdtype(gain.dtype, jnp.floating):
    raise ValueError(f"lhs_norm's gain must be a float [{k}] (lhs's last axis), got "
                     f"{gain.dtype}{list(gain.shape)}")
  if not float(eps) > 0:
    raise ValueError(f"lhs_norm's eps must be > 0, got {eps}")
  if lhs_activation is not None:
    raise ValueError("lhs_norm with lhs_activation is not supported (a norm feeds the GEMM "
                     "directly)")
  return gain, float(eps)


def fp8_dot_general_chained(lhs, rhs, dimension_numbers, meta: Fp8DotMeta,
                            recipe: Recipe = Recipe(), *, preferred_element_type=None,
                            amax_axes: Sequence[str] = (), weight_cast: WeightCast | None = None,
                            lhs_activation: str | None = None, weight_shardings=None,
                            keep_gathered_weight: bool = False, lhs_norm=None):
  """FP8 ``lax.dot_general``; returns ``(out, meta_passthrough)``.

  `meta_passthrough` equals `meta`; hand it to the next call of the same layer so both
  calls' FP8 updates combine by max in the backward pass (see the module docstring).
  Args:
    lhs: activations, any float dtype; rhs: weights.
    dimension_numbers: as for ``lax.dot_general`` (any contracting/batch layout).
    meta: the GEMM's :class:`Fp8DotMeta` (its gradient is the updated meta).
    recipe: formats and scaling rules.
    preferred_element_type: output dtype (default: the promoted input dtype).
    amax_axes: mesh axis names (inside ``shard_map``) to agree amaxes over with pmax.
    weight_cast: rhs already cast, ``cast_weight(rhs, meta.kernel, recipe)`` (e.g. once per
      optimizer step for all microbatches); rhs then only receives its gradient. Not inside
      ``shard_map``.
    lhs_activation: multiply ``activate(lhs, lhs_activation)`` ("gelu": GELU's tanh form in
      f32, rounded to lhs's dtype) instead of lhs; with ``Recipe.fused_cast_transpose`` the
      fused kernel applies it while casting, so the activation is never stored in bf16. The
      gradient goes to lhs through the activation.
    weight_shardings: None, or ``(home, gathered)`` NamedShardings of rhs (ZeRO-3, see
      :mod:`fp8jax.fsdp`): rhs lives as `home` (split over the ZeRO axes); its shard is cast
      to the forward format with the tensor's scale and the FP8 bytes are all-gathered to
      `gathered` for the GEMM (again in the backward, from the kept shard); rhs's gradient is
      summed in f32 into the `home` layout, then rounded to rhs's dtype. Not with
      `weight_cast`, not inside ``shard_map``.
    keep_gathered_weight: with `weight_shardings`, keep the gathered FP8 weight for the
      backward instead of its shard (for a GEMM under remat: ``fsdp.WeightGather``).
    lhs_norm: None, or ``(gain, eps)``: multiply RMSNorm's output
      ``fp8jax.kernels.cast_transpose.rms_norm(lhs, gain, eps)`` (flax's ``nn.RMSNorm`` in
      f32, rounded to lhs's dtype; gain [K] over lhs's last axis, which must be its one
      contracting axis) instead of lhs; with ``Recipe.fused_cast_transpose`` the fused kernel
      normalizes while casting, so the normed tensor is never stored. lhs and gain get their
      gradients through the norm (inside ``shard_map``, lhs's last axis must be whole on
      each device). Not with `lhs_activation`.
  With a row-wise `recipe` (``granularity="rowwise"``, :mod:`fp8jax.rowwise`) the activation
  or norm runs as XLA ops before the GEMM, and `weight_cast` / `weight_shardings` raise.
  """
  ct.check_activation(lhs_activation)
  gain, norm_eps = _check_lhs_norm(lhs_norm, lhs, dimension_numbers, lhs_activation)
  if lhs_activation in ct.GATED:
    raise ValueError(f"lhs_activation={lhs_activation!r} is gated (it halves the lhs's last "
                     "axis); fp8_mlp_chained runs it between an MLP's two GEMMs")
  if not isinstance(meta, Fp8DotMeta):
    raise TypeError(f"meta must be an Fp8DotMeta, got {type(meta).__name__}; use "
                    "fp8jax.init_dot_meta(recipe)")
  if not isinstance(recipe, Recipe):
    raise TypeError(f"recipe must be an fp8jax.Recipe, got {type(recipe).__name__}")
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  for name, arr in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(arr.dtype, jnp.floating):
      raise TypeError(f"fp8_dot_general: {name} must be a float array, got {arr.dtype}")
  out_dtype = preferred_element_type or jnp.result_type(lhs.dtype, rhs.dtype)
  lperm, rperm, (b, m, k, n), batched, out_shape = canonical_dims(lhs.shape, rhs.shape,
                                                                 dimension_numbers)
  if recipe.rowwise:
    rowwise.check_call(weight_cast, weight_shardings)
    if recipe.fused_cast_transpose:
      log_once("fp8jax: fused cast+transpose kernel not used, XLA casts instead: row-wise "
               "scaling", logging.INFO)
  w_gather = None
  if weight_shardings is not None:
    if weight_cast is not None:
      raise ValueError("weight_cast with weight_shardings is not supported: a weight cast "
                       "outside is already whole; pass one or the other")
    w_gather = weight_gather(weight_shardings, rhs.shape, dimension_numbers, rperm,
                             vma_of(lhs) | vma_of(rhs), keep_gathered_weight)
    if w_gather is None:  # no canonical layout for them: gathered as it is, then cast
      rhs = fsdp.gather_array(rhs, *weight_shardings)
  x = jnp.transpose(lhs, lperm).reshape((b, m, k) if batched else (m, k))
  w = jnp.transpose(rhs, rperm).reshape((b, k, n) if batched else (k, n))
  reason = _native_reason(m, k, n, out_dtype)
  x, w = agree_on_vma(x, w, amax_axes)
  if gain is not None:  # inside shard_map: varying like x, so its gradient is summed over them
    gain = to_vma(gain, vma_of(x))
  meta_vma = frozenset().union(*(vma_of(a) for a in jax.tree.leaves(meta)))
  if recipe.rowwise:  # the activation or RMSNorm by XLA ops, then the row-wise GEMM
    x = ct.activate(x, lhs_activation) if gain is None else ct.rms_norm(x, gain, norm_eps)
    cfg = rowwise.Config(recipe, np.dtype(out_dtype).type, reason is None, tuple(amax_axes),
                         np.dtype(lhs.dtype).type, np.dtype(rhs.dtype).type, meta_vma,
                         *explicit_shardings(x, w), INPUT_CAST_NAME, WEIGHT_CAST_NAME)
    y, meta_out = rowwise.matmul(x, w, meta, cfg)
    return y.reshape(out_shape), meta_out
  if weight_cast is not None:
    _check_weight_cast(weight_cast, rhs, recipe, vma_of(x) | meta_vma)
    q = jnp.transpose(weight_cast.q, rperm).reshape(w.shape)
    weight_cast = WeightCast(q, *(jnp.asarray(a, jnp.float32) for a in weight_cast[1:]))
  fused = _uses_fused_kernel(x.shape, x.dtype, (b, m, n) if batched else (m, n), out_dtype,
                             recipe, reason is None, bool(vma_of(x) or meta_vma), lhs_activation)
  cfg = _Config(recipe, np.dtype(out_dtype).type, reason is None, tuple(amax_axes),
                np.dtype(lhs.dtype).type, np.dtype(rhs.dtype).type, meta_vma,
                *explicit_shardings(x, w), fused=fused, weight_cast=weight_cast is not None,
                activation=lhs_activation, norm_eps=norm_eps, w_gather=w_gather)
  y, meta_out = _fp8_matmul(x, w, meta, weight_cast, gain, cfg)
  return y.reshape(out_shape), meta_out


def fp8_dot_general(lhs, rhs, dimension_numbers, meta: Fp8DotMeta, recipe: Recipe = Recipe(),
                    precision=None, preferred_element_type=None, *, amax_axes: Sequence[str] = ()):
  """FP8 ``lax.dot_general``: like :func:`fp8_dot_general_chained`, returning only the output.

  `precision` is accepted for signature compatibility and ignored: FP8 GEMMs accumulate
  in f32.
  """
  del precision
  return fp8_dot_general_chained(lhs, rhs, dimension_numbers, meta, recipe,
                                 preferred_element_type=preferred_element_type,
                                 amax_axes=amax_axes)[0]


def _plain_config(x_shape, x_dtype, w, out_dtype, recipe: Recipe,
                  activation: str | None = None, weight_cast: bool = False,
                  grad_activation: str | None = None, norm_eps: float | None = None
                  ) -> _Config:
  """The _Config of an activate(x)[M, K] @ w[K, N] GEMM outside shard_map (as
  fp8_dot_general_chained builds it for such a call; logs the same notes); x_shape is x's
  (before `activation` or the RMSNorm of epsilon `norm_eps`), `grad_activation` the
  derivative applied in the output gradient's cast."""
  m, n = x_shape[0], w.shape[1]
  reason = _native_reason(m, w.shape[0], n, out_dtype)
  fused = _uses_fused_kernel(x_shape, x_dtype, (m, n), out_dtype, recipe, reason is None, False,
                             activation, grad_activation)
  return _Config(recipe, np.dtype(out_dtype).type, reason is None, (), np.dtype(x_dtype).type,
                 np.dtype(w.dtype).type, fused=fused, weight_cast=weight_cast,
                 activation=activation, norm_eps=norm_eps)


def mlp_op_reason(x, w_in, w_out, meta_in: Fp8DotMeta, meta_out: Fp8DotMeta) -> str | None:
  """None when :func:`fp8_mlp_chained` can run on these operands, else why it cannot (inside
  ``shard_map``, or on a mesh with Explicit axes: two ``fp8_dot_general_chained`` calls do)."""
  if vma_of(x) | vma_of(w_in) | vma_of(w_out) or any(
      vma_of(a) for a in jax.tree.leaves((meta_in, meta_out))):
    return "inside shard_map (amaxes agreed over mesh axes) it is not supported"
  if any(s is not None for s in explicit_shardings(x, w_in) + explicit_shardings(x, w_out)):
    return "on a mesh with Explicit axes it is not supported"
  return None


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _fp8_mlp(x, w_in, w_out, meta_in: Fp8DotMeta, meta_out: Fp8DotMeta,
             wc_in: WeightCast | None, wc_out: WeightCast | None, gain, cfg_in: _Config,
             cfg_out: _Config):
  return _fp8_mlp_fwd(x, w_in, w_out, meta_in, meta_out, wc_in, wc_out, gain, cfg_in,
                      cfg_out)[0]


def _fp8_mlp_fwd(x, w_in, w_out, meta_in, meta_out, wc_in, wc_out, gain, cfg_in, cfg_out):
  (h, _), res_in = _fp8_matmul_fwd(x, w_in, meta_in, wc_in, gain, cfg_in)
  h = checkpoint_name(h, GEMM_OUTPUT_NAME)  # the activation's input: kept by saving policies
  (y, _), res_out = _fp8_matmul_fwd(h, w_out, meta_out, wc_out, None, cfg_out)
  return (y, meta_in, meta_out), (res_in, res_out)


def _fp8_mlp_bwd(cfg_in, cfg_out, res, cts):
  res_in, res_out = res
  g, meta_in_ct, meta_out_ct = cts
  # The second GEMM hands back the cotangent of the activated hidden state; the first applies
  # the activation's derivative (at h, the second GEMM's saved input) inside its gradient cast.
  dh, dw_out, new_out, wc_out_ct, _ = _matmul_bwd(cfg_out, res_out, g, meta_out_ct,
                                                  through_activation=False)
  x_pre_out = res_out[7]  # the second GEMM's input before its activation: the hidden state
  dx, dw_in, new_in, wc_in_ct, d_gain = _matmul_bwd(cfg_in, res_in, dh, meta_in_ct,
                                                    cfg_out.activation, x_pre_out)
  return dx, dw_in, dw_out, new_in, new_out, wc_in_ct, wc_out_ct, d_gain


_fp8_mlp.defvjp(scaling.primal_values_fwd(_fp8_mlp_fwd, (8, 9)), _fp8_mlp_bwd,
                symbolic_zeros=True)


def fp8_mlp_chained(x, w_in, w_out, meta_in: Fp8DotMeta, meta_out: Fp8DotMeta,
                    recipe: Recipe = Recipe(), activation: str = "gelu", *,
                    preferred_element_type=None, weight_cast_in: WeightCast | None = None,
                    weight_cast_out: WeightCast | None = None, norm=None):
  """An MLP's two FP8 GEMMs in one differentiated op: ``y = activate(x @ w_in) @ w_out``
  (:func:`fp8jax.kernels.cast_transpose.activate`); returns ``(y, meta_in_passthrough,
  meta_out_passthrough)``, the passthroughs as for :func:`fp8_dot_general_chained`.

  The same quantized math as two :func:`fp8_dot_general_chained` calls (the second with
  ``lhs_activation``), except where the activation's derivative is applied: here inside the
  cast of the gradient entering the first GEMM, which with ``Recipe.fused_cast_transpose`` is
  one kernel pass (the bf16 gradient of the hidden pre-activation is never written), as the
  activation itself is inside the second GEMM's input cast. The hidden pre-activation is
  tagged ``GEMM_OUTPUT_NAME`` for remat policies. A gated activation ("swiglu") takes the
  first GEMM's output as interleaved (gate, up) pairs: w_in [D, 2F] is an
  ``nn.DenseGeneral((F, 2))`` kernel [D, F, 2] reshaped, and its gradient comes back in that
  layout.

  Args:
    x: activations [..., D], any float dtype; w_in [D, F] (gated: [D, 2F]); w_out [F, N].
    meta_in, meta_out: the two GEMMs' :class:`Fp8DotMeta` (their gradients are the updated
      metas).
    recipe: formats and scaling rules of both GEMMs.
    activation: one of ``fp8jax.kernels.cast_transpose.ACTIVATIONS``.
    preferred_element_type: dtype of the hidden state and of y (default: promoted inputs).
    weight_cast_in, weight_cast_out: w_in / w_out already cast,
      ``cast_weight(w, meta.kernel, recipe)`` (e.g. once per optimizer step), or None; as
      for ``fp8_dot_general_chained``'s `weight_cast`.
    norm: None, or ``(gain, eps)``: the first GEMM multiplies RMSNorm's output
      ``rms_norm(x, gain, eps)`` (gain [D]) instead of x, normalized inside its input's cast,
      as ``fp8_dot_general_chained``'s `lhs_norm`.
  Returns y [..., N]. Outside ``shard_map`` only, on a mesh without Explicit axes (else use
  two fp8_dot_general_chained calls). With a row-wise `recipe`: two row-wise
  ``fp8_dot_general_chained`` calls, the norm and activation (and their derivatives) by XLA
  ops.
  """
  if activation is None:
    raise ValueError(f"fp8_mlp: activation=None is not allowed; use one of "
                     f"{list(ct.ACTIVATIONS)} (without one, call fp8_dot_general twice)")
  ct.check_activation(activation)
  gated = activation in ct.GATED
  for name, meta in (("meta_in", meta_in), ("meta_out", meta_out)):
    if not isinstance(meta, Fp8DotMeta):
      raise TypeError(f"fp8_mlp: {name} must be an Fp8DotMeta, got {type(meta).__name__}; use "
                      "fp8jax.init_dot_meta(recipe)")
  if not isinstance(recipe, Recipe):
    raise TypeError(f"fp8_mlp: recipe must be an fp8jax.Recipe, got {type(recipe).__name__}")
  x, w_in, w_out = (jnp.asarray(a) for a in (x, w_in, w_out))
  for name, arr in (("x", x), ("w_in", w_in), ("w_out", w_out)):
    if not jnp.issubdtype(arr.dtype, jnp.floating):
      raise TypeError(f"fp8_mlp: {name} must be a float array, got {arr.dtype}")
  if (x.ndim < 1 or w_in.ndim != 2 or w_out.ndim != 2 or x.shape[-1] != w_in.shape[0]
      or w_in.shape[1] != (2 if gated else 1) * w_out.shape[0]):
    hidden = "2F] (gate, up pairs)" if gated else "F]"
    raise ValueError(f"fp8_mlp: shapes x{list(x.shape)}, w_in{list(w_in.shape)}, "
                     f"w_out{list(w_out.shape)} do not chain as x[..., D] @ w_in[D, {hidden} "
                     f"-> {activation} -> [..., F] @ w_out[F, N]")
  reason = mlp_op_reason(x, w_in, w_out, meta_in, meta_out)
  if reason:
    raise ValueError(f"fp8_mlp: {reason}; use two fp8_dot_general_chained calls")
  gain, norm_eps = _check_lhs_norm(norm, x, (((x.ndim - 1,), (0,)), ((), ())), None)
  h_dtype = preferred_element_type or jnp.result_type(x.dtype, w_in.dtype)
  y_dtype = preferred_element_type or jnp.result_type(h_dtype, w_out.dtype)
  if recipe.rowwise:
    return _rowwise_mlp(x, w_in, w_out, meta_in, meta_out, recipe, activation, norm, h_dtype,
                        y_dtype, weight_cast_in, weight_cast_out)
  lead, d = x.shape[:-1], x.shape[-1]
  m, f = math.prod(lead), w_in.shape[1]
  x2 = x.reshape(m, d)
  casts = []
  for wc, w in ((weight_cast_in, w_in), (weight_cast_out, w_out)):
    if wc is not None:
      _check_weight_cast(wc, w, recipe, frozenset())
      wc = WeightCast(wc.q, *(jnp.asarray(a, jnp.float32) for a in wc[1:]))
    casts.append(wc)
  cfg_in = _plain_config((m, d), x.dtype, w_in, h_dtype, recipe,
                         weight_cast=casts[0] is not None, grad_activation=activation,
                         norm_eps=norm_eps)
  cfg_out = _plain_config((m, f), h_dtype, w_out, y_dtype, recipe, activation,
                          weight_cast=casts[1] is not None)
  y, meta_in, meta_out = _fp8_mlp(x2, w_in, w_out, meta_in, meta_out, *casts, gain, cfg_in,
                                  cfg_out)
  return y.reshape(*lead, w_out.shape[1]), meta_in, meta_out


def _rowwise_mlp(x, w_in, w_out, meta_in, meta_out, recipe: Recipe, activation: str, norm,
                 h_dtype, y_dtype, weight_cast_in, weight_cast_out):
  """:func:`fp8_mlp_chained` with a row-wise recipe: two row-wise GEMMs, the RMSNorm, the
  activation and their derivatives by XLA ops (no fused kernel). Returns (y, meta_in
  passthrough, meta_out passthrough)."""
  h, meta_in = fp8_dot_general_chained(x, w_in, (((x.ndim - 1,), (0,)), ((), ())), meta_in,
                                       recipe, preferred_element_type=h_dtype,
                                       weight_cast=weight_cast_in, lhs_norm=norm)
  h = ct.activate(checkpoint_name(h, GEMM_OUTPUT_NAME), activation)
  y, meta_out = fp8_dot_general_chained(h, w_out, (((h.ndim - 1,), (0,)), ((), ())), meta_out,
                                        recipe, preferred_element_type=y_dtype,
                                        weight_cast=weight_cast_out)
  return y, meta_in, meta_out
