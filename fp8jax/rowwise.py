"""Row-wise FP8 scaling (``Recipe(granularity="rowwise")``): one scale per row of each GEMM
operand along the axis that GEMM contracts.

Every operand of every GEMM is cast with one f32 scale per slice along the GEMM's
contraction axis, from that slice's own amax (current scaling; margin and power-of-two
rounding as in :func:`fp8jax.scaling.scale_from_amax`; a slice whose amax is 0, inf or NaN
gets scale 1). The scales are then constant along the contraction and factor out of the sum::

  out[m, n] = sum_k a[m, k] b[k, n] ~= (sum_k q_a[m, k] q_b[k, n]) * s_a[m] * s_b[n]

so the FP8 GEMM runs with unit scales (the FP8 arrays straight into ``lax.dot_general``, f32
output) and the scales multiply its output, in f32, before the cast to the output dtype.

For ``y[M, N] = x[M, K] @ w[K, N]`` (leading batch axis optional):

* forward: x per row (amax over K, scales [M]), w per column (amax over K, scales [N]);
* input gradient ``dx = g @ w^T`` contracts N: g per row (over N, [M]), w per row (over N,
  [K]);
* weight gradient ``dw = x^T @ g`` contracts the tokens M: x per column (over M, [K]), g per
  column (over M, [N]).

x is cast twice in the forward: its per-column cast (1 byte per element and K scales) is the
residual of the weight gradient. g is cast twice in the backward, w once more (per row, from
the weight itself, which is the other residual). Formats as for tensor scaling: forward
operands in ``recipe.fwd_format``, output gradients in ``recipe.bwd_format``; accumulation as
``recipe.bwd_fast_accumulation`` says.

FP8 state: the GEMM's :class:`fp8jax.Fp8DotMeta` does not scale anything here. Each role's
amax history records the tensor's amax (the max over its rows; pmax over `amax_axes`) and its
scale is updated as delayed scaling would (:func:`fp8jax.scaling.update_meta`), so the state
has the same shape and update rules as a tensor-scaled GEMM's: it is saved, restored,
combined by max and written back (the cotangent of the meta) alike.

Inside ``shard_map`` each device scales its own rows: the scales need not agree between
devices, since each device applies its own to its own partial product.
"""
from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax import scaling
from fp8jax.dot_layout import to_vma
from fp8jax.recipe import Recipe


class Config(NamedTuple):
  """Static (hashable) arguments of the row-wise FP8 matmul.

  recipe: its formats and scaling rules (``granularity="rowwise"``); out_dtype, x_dtype,
  w_dtype: dtypes of y, dx, dw; native: FP8 arrays go to ``lax.dot_general`` (else upcast
  exactly, f32 accumulation); amax_axes: mesh axes (inside ``shard_map``) the recorded tensor
  amaxes are pmax-reduced over; meta_vma: manual mesh axes the meta varies over; x_sharding,
  w_sharding: output shardings of the backward GEMMs on a mesh with Explicit axes (or None);
  input_name, weight_name: ``checkpoint_name`` of the activation's per-column cast (the
  weight gradient's residual) and of the weight's forward cast, for remat policies.
  """

  recipe: Recipe
  out_dtype: Any
  native: bool
  amax_axes: tuple = ()
  x_dtype: Any = jnp.float32
  w_dtype: Any = jnp.float32
  meta_vma: frozenset = frozenset()
  x_sharding: Any = None
  w_sharding: Any = None
  input_name: str | None = None
  weight_name: str | None = None


def amax_along(x: jax.Array, axis: int) -> jax.Array:
  """max(|x|) over `axis` (that axis removed) as f32; NaN where a slice holds a NaN. For the
  float types of :func:`fp8jax.scaling.compute_amax` an integer max over the bits (exact)."""
  dt = np.dtype(x.dtype)
  utype = scaling._AMAX_BITS.get(dt)
  if utype is None:
    a = jnp.max(jnp.abs(x), axis=axis).astype(jnp.float32)
    return jnp.where(jnp.any(jnp.isnan(x), axis=axis), jnp.nan, a)
  magnitude = utype(np.iinfo(utype).max >> 1)  # all bits but the sign
  code = jnp.max(lax.bitcast_convert_type(x, utype) & magnitude, axis=axis)
  return lax.bitcast_convert_type(code.astype(utype), x.dtype).astype(jnp.float32)


def scales_along(x: jax.Array, axis: int, recipe: Recipe, fmt) -> tuple[jax.Array, jax.Array]:
  """(scales, amaxes) of casting `x` with one scale per slice along `axis` (that axis
  removed, f32): each slice's amax maps to fp8_max(fmt) / 2**margin (a power of two above it
  with ``recipe.power_of_two_scales``); 1 where the amax is 0, inf or NaN."""
  amax = amax_along(x, axis)
  one = jnp.ones((), jnp.float32)
  return scaling.scale_from_amax(amax, one, fmt, recipe.margin,
                                 recipe.power_of_two_scales), amax


def quantize_along(x: jax.Array, axis: int, recipe: Recipe, fmt):
  """(q, scales, amaxes): `x` cast to FP8 type `fmt` with one scale per slice along `axis`
  (:func:`scales_along`); ``x ~= f32(q) * expand_dims(scales, axis)``."""
  axis = axis % x.ndim
  scale, amax = scales_along(x, axis, recipe, fmt)
  return scaling.quantize(x, jnp.expand_dims(scale, axis), fmt), scale, amax


def tensor_amax(amaxes: jax.Array, amax_axes=()) -> jax.Array:
  """The tensor's amax (f32[], NaN-safe) from its slices' `amaxes`, pmax over `amax_axes`."""
  return scaling.compute_amax(amaxes, tuple(amax_axes))


def _emulation_dtype():
  """BF16 on GPUs, F32 elsewhere: as :mod:`fp8jax.dot` emulates FP8 GEMMs."""
  return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def scaled_mm(a, b, contract: tuple[int, int], scale_a, scale_b, out_dtype, native: bool,
              fast_accum: bool, out_sharding=None):
  """``(a . b) * scale_a[.., :, None] * scale_b[.., None, :]`` cast to `out_dtype`: a, b FP8
  (2-D, or 3-D with batch axis 0), contracting a's axis contract[0] with b's contract[1];
  scale_a over a's free axis, scale_b over b's ([B, free] when batched).

  Native: the FP8 arrays go straight to dot_general (unit scales: cuBLASLt's FP8 GEMM), f32
  output; `fast_accum` (Precision.DEFAULT) lets it accumulate in the tensor cores' reduced
  precision, else HIGHEST (exact f32). Emulated: the FP8 values upcast exactly (BF16 on
  GPUs, F32 elsewhere), f32 accumulation. The scales multiply the f32 product."""
  batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
  dn = (((contract[0],), (contract[1],)), batch)
  if native:
    precision = lax.Precision.DEFAULT if fast_accum else lax.Precision.HIGHEST
  else:
    wide = _emulation_dtype()
    precision = lax.Precision.DEFAULT if wide == jnp.bfloat16 else lax.Precision.HIGHEST
    a, b = a.astype(wide), b.astype(wide)
  y = lax.dot_general(a, b, dn, precision=precision, preferred_element_type=jnp.float32,
                      out_sharding=out_sharding)
  return (y * scale_a[..., :, None] * scale_b[..., None, :]).astype(out_dtype)


def _named(name: str | None, *arrays):
  """`arrays` tagged for remat (:func:`fp8jax.scaling.checkpoint_named`); unchanged without
  a name."""
  return arrays if name is None else scaling.checkpoint_named(name, *arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def matmul(x, w, meta, cfg: Config):
  """x[B?, M, K] @ w[B?, K, N] with row-wise FP8 scaling; returns ``(y[B?, M, N], meta)``.

  `meta` (an :class:`fp8jax.Fp8DotMeta`) comes back unchanged; its cotangent is the updated
  state (each role's tensor amax recorded), combined by max with the cotangent of the
  returned meta, as :func:`fp8jax.fp8_dot_general_chained` does."""
  return _matmul_fwd(x, w, meta, cfg)[0]


def _matmul_fwd(x, w, meta, cfg: Config):
  r = cfg.recipe
  k_axis = x.ndim - 1
  qx, sx, ax = quantize_along(x, k_axis, r, r.fwd_format)  # rows of x
  qw, sw, aw = quantize_along(w, k_axis - 1, r, r.fwd_format)  # columns of w
  qw, sw = _named(cfg.weight_name, qw, sw)
  y = scaled_mm(qx, qw, (k_axis, k_axis - 1), sx, sw, cfg.out_dtype, cfg.native, True)
  # The weight gradient contracts the tokens: x per column, cast now (the residual).
  qx_t, sx_t, _ = quantize_along(x, k_axis - 1, r, r.fwd_format)
  qx_t, sx_t = _named(cfg.input_name, qx_t, sx_t)
  partial = meta._replace(
      input=scaling.update_meta(meta.input, tensor_amax(ax, cfg.amax_axes), r, r.fwd_format),
      kernel=scaling.update_meta(meta.kernel, tensor_amax(aw, cfg.amax_axes), r,
                                 r.fwd_format))
  return (y, meta), (qx_t, sx_t, w, partial)


def _matmul_bwd(cfg: Config, res, cts):
  qx_t, sx_t, w, partial = res
  g, meta_ct = cts
  g = scaling.dense_cotangent(g)
  r = cfg.recipe
  m_axis = g.ndim - 2
  # Input gradient g[.., M, N] . w[.., K, N] over N: both per row along N.
  qg, sg, ag = quantize_along(g, m_axis + 1, r, r.bwd_format)
  qw, sw, _ = quantize_along(w, m_axis + 1, r, r.fwd_format)
  dx = scaled_mm(qg, qw, (m_axis + 1, m_axis + 1), sg, sw, cfg.x_dtype, cfg.native,
                 r.dgrad_fast, cfg.x_sharding)
  # Weight gradient x[.., M, K] . g[.., M, N] over M: both per column along M.
  qg_t, sg_t, _ = quantize_along(g, m_axis, r, r.bwd_format)
  dw = scaled_mm(qx_t, qg_t, (m_axis, m_axis), sx_t, sg_t, cfg.w_dtype, cfg.native,
                 r.wgrad_fast, cfg.w_sharding)
  new = partial._replace(output_grad=scaling.update_meta(
      partial.output_grad, tensor_amax(ag, cfg.amax_axes), r, r.bwd_format))
  new = jax.tree.map(lambda a: to_vma(a, cfg.meta_vma), new)
  return dx, dw, scaling.combine_cotangent(new, meta_ct)


matmul.defvjp(scaling.primal_values_fwd(_matmul_fwd, (3,)), _matmul_bwd, symbolic_zeros=True)


def check_call(weight_cast, weight_shardings) -> None:
  """Raises ValueError for what a row-wise GEMM does not take: a weight cast once per step
  (`weight_cast`) or a ZeRO-3 weight gather (`weight_shardings`)."""
  if weight_cast is not None:
    raise ValueError("weight_cast is not supported with Recipe(granularity='rowwise'): the "
                     "GEMM casts its weight per column (and per row for the input gradient)")
  if weight_shardings is not None:
    raise ValueError("weight_shardings (ZeRO-3 weight gathers) is not supported with "
                     "Recipe(granularity='rowwise'); gather the weight first or use "
                     "granularity='tensor'")
