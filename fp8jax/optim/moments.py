"""How Adam's moments are stored: first moment normalised by the root of the second.

Per parameter tensor the state holds two :class:`ScaledArray`\\ s:

* ``nu``: ``r = sqrt(v)`` (not ``v``): it spans as many decades as the gradients do, not
  twice as many, so FP16 with one scale per tensor holds 9 decades of gradient magnitude at
  full precision (12 with subnormals) where ``v`` in FP16 would hold 4.5.
* ``mu``: ``u = m / r``, the first moment in units of the second moment's root. Adam's update
  is ``~ u``, so ``u`` is O(1) for every element whatever its gradient scale, and one scale
  per tensor fits E4M3; ``m`` itself would flush elements 5.4 decades below the tensor's
  largest. Decoding is ``m = u * r``: where ``r`` is stored as 0, ``m`` reads as 0 too, so
  the second moment can never be zero where the first is not.

Both scales are fixed *before* the new state is written, from rigorous bounds, so the whole
update is one elementwise pass needing no reduction over the moments (only the gradient's
amax, which a scaled FP8 gradient carries in its scale)::

  r_new^2 = b2 r_old^2 + (1-b2) g^2
      => max r_new <= hypot(sqrt(b2) R_old, sqrt(1-b2) max|g|)
  |u_new| = |b1 m_old + (1-b1) g| / r_new
      <= b1/sqrt(b2) U_old + (1-b1)/sqrt(1-b2)

(``r_new >= sqrt(b2) r_old`` and ``r_new >= sqrt(1-b2)|g|``; ``R_old``, ``U_old``: the bounds
the old payloads were scaled to, which the stored values never exceed). The ``u`` bound is
capped by Cauchy-Schwarz, ``|m_t| <= (1-b1) sqrt(v_t / (1-b2)) / sqrt(1 - b1^2/b2)`` for any
gradient history, with the stored formats' rounding folded into ``b1`` and ``b2``: ~11.7 for
(0.9, 0.999) with an E4M3 ``u`` and an FP16 ``r``, so after a few steps ``u``'s scale is fixed.
The factors of these bounds are rounded up to 9 significant bits (see :data:`ROUND_BITS`).
Neither payload saturates. ``r`` is computed in units of its new scale, so gradients from
1e-38 to 3e38 neither underflow nor overflow on the way.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from fp8jax.optim.scaled import (ScaledArray, dequantize_scaled, is_scaled, payload_max,
                                 quantize_with_scale, scale_from_bound)


def decode(mu: ScaledArray, nu: ScaledArray):
  """Stored moments -> (m, r) in f32: first moment and root of the second, shaped like mu."""
  r = dequantize_scaled(nu)
  return dequantize_scaled(mu) * r, r


def hyper(x):
  """A numeric hyperparameter as the update uses it: a Python number as it is (a constant of
  the program), anything else (a NumPy or JAX scalar, also a traced one, e.g. from
  ``optax.inject_hyperparams``) as f32[]."""
  if isinstance(x, (int, float)) and not isinstance(x, bool):
    return x
  return jnp.asarray(x, jnp.float32)


def complement(b):
  """``1 - b`` for a decay rate `b` (see :func:`hyper`): computed in float64 for a Python
  number (as optax does: 1 - 0.999 is f32(1e-3)), in f32 otherwise. For any f32 value of
  `b` in [0.5, 1] both are exact, so a traced `b` and the Python number of the same value
  give the same program values."""
  b = hyper(b)
  return 1.0 - b


def _f32(x) -> jax.Array:
  return jnp.asarray(x, jnp.float32)


def advance(m_old, r_old, g, nu_scale, b1, b2):
  """One Adam moment step in f32: (m, r) with r = sqrt(b2 r_old^2 + (1-b2) g^2).

  `b1`, `b2`: Python numbers or f32[] (traced or not; see :func:`hyper`). `r` is computed in
  units of the new `nu_scale` (where it is <= the payload max, so its square cannot overflow
  and only elements ~19 decades below the tensor's largest, which the payload flushes
  anyway, underflow) and returned in those units: ``r_units * nu_scale`` is the root,
  ``r_units`` is what ``nu`` stores.
  """
  b1, b2 = hyper(b1), hyper(b2)
  inv = jnp.where(nu_scale > 0, 1.0 / nu_scale, 0.0)
  m = b1 * m_old + complement(b1) * g
  x, y = r_old * inv, g * inv
  return m, jnp.sqrt(b2 * (x * x) + complement(b2) * (y * y))


# The scale factors below are rounded up to ROUND_BITS significant bits (<= 0.2% looser
# bounds). A Python beta's factors are computed in float64, a traced beta's in f32, and XLA
# rewrites f32 scalar arithmetic (rsqrt, reassociation) differently for constants and
# runtime values; the coarse values are the same in all these cases (unless the exact value
# lies within an f32 ulp of a grid point), so traced and Python betas give the same scales.
ROUND_BITS = 9


def _is_number(x) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def _round_up(x):
  """Positive `x` rounded up to ROUND_BITS significant bits: a Python float for a Python
  number (inf stays inf), else f32 (its bit pattern rounded up; inf stays inf)."""
  if _is_number(x):
    if not math.isfinite(x) or x <= 0:
      return float(x)
    mant, expo = math.frexp(x)
    return math.ldexp(math.ceil(mant * 2.0**ROUND_BITS) / 2.0**ROUND_BITS, expo)
  low = 2 ** (int(jnp.finfo(jnp.float32).nmant) + 1 - ROUND_BITS) - 1
  bits = lax.bitcast_convert_type(_f32(x), jnp.int32)
  up = lax.bitcast_convert_type((bits + low) & ~low, jnp.float32)
  return jnp.where(jnp.isfinite(x) & (x > 0), up, x)


def u_cap(b1, b2, mu_dtype, nu_dtype):
  """The Cauchy-Schwarz bound on ``|u| = |m| / sqrt(v)`` (inf where b1^2 >= b2), with the
  relative rounding of the stored ``u`` and ``r`` folded into b1 and b2, rounded up to
  ``ROUND_BITS`` significant bits.

  `b1`, `b2`: Python numbers (returns a Python float, float64 arithmetic) or f32[] arrays,
  traced or not (returns f32[]); ``1 - b`` as :func:`complement` computes it.
  """
  rel = lambda dtype: 2.0 ** -(int(jnp.finfo(dtype).nmant) + 1)
  eps_u, eps_r = rel(mu_dtype), rel(nu_dtype)
  if _is_number(b1) and _is_number(b2):
    b1e = b1 * (1.0 + eps_u) * (1.0 + eps_r)
    b2e = b2 * (1.0 - eps_r) ** 2
    if b1e * b1e >= b2e:
      return math.inf
    return _round_up((1.0 - b1) * (1.0 + eps_u) / math.sqrt((1.0 - b2) * (1.0 - b1e * b1e / b2e)))
  b1e = _f32(b1) * ((1.0 + eps_u) * (1.0 + eps_r))
  b2e = _f32(b2) * (1.0 - eps_r) ** 2
  finite = b1e * b1e < b2e
  denom = _f32(complement(b2)) * (1.0 - b1e * b1e / b2e)
  cap = _f32(complement(b1)) * (1.0 + eps_u) / jnp.sqrt(jnp.where(finite, denom, 1.0))
  return jnp.where(finite, _round_up(cap), jnp.inf)


def _bound_factors(b1, b2, mu_dtype, nu_dtype):
  """(A, B, C, D, cap): ``R_new <= hypot(A R_scale, B max|g|)``,
  ``U_new <= min(C U_scale + D, cap)`` in units of the payloads' scales (see the module doc),
  each factor rounded up to ROUND_BITS bits; Python floats for Python betas, else f32[]."""
  pmax_nu, pmax_mu = payload_max(nu_dtype), payload_max(mu_dtype)
  cap = u_cap(b1, b2, mu_dtype, nu_dtype)
  if _is_number(b1) and _is_number(b2):
    sqrt_b2, sqrt_c2 = math.sqrt(b2), math.sqrt(1.0 - b2)
  else:
    b1, b2 = _f32(b1), _f32(b2)
    sqrt_b2, sqrt_c2 = jnp.sqrt(b2), jnp.sqrt(_f32(complement(b2)))
  return (_round_up(sqrt_b2 * pmax_nu), _round_up(sqrt_c2),
          _round_up(b1 / sqrt_b2 * pmax_mu), _round_up(complement(b1) / sqrt_c2), cap)


def next_scales(mu_scale, nu_scale, amax_g, b1, b2, mu_dtype, nu_dtype):
  """(mu_scale, nu_scale) for the state written this step, from the bounds above.

  Elementwise over stacked per-tensor values (f32[L] for a tree of L tensors): `mu_scale` and
  `nu_scale` are the old state's scales, `amax_g` the gradient's agreed amax (or a bound on it).
  `b1`, `b2`: Python numbers or f32[] (traced or not).
  """
  pmax_nu, pmax_mu = payload_max(nu_dtype), payload_max(mu_dtype)
  a, b, c, d, cap = _bound_factors(b1, b2, mu_dtype, nu_dtype)
  r_bound = jnp.hypot(a * nu_scale, b * amax_g)
  u_bound = jnp.minimum(c * mu_scale + d, cap)
  return scale_from_bound(u_bound, pmax_mu), scale_from_bound(r_bound, pmax_nu)


def grad_bounds(grads, amax_g=None) -> jax.Array:
  """f32[L]: a bound on each gradient leaf's amax for :func:`next_scales`.

  A scaled gradient's payload never exceeds its format's largest value, so ``scale * max``
  bounds it with no pass over the data; plain leaves take their entry of `amax_g` (their
  agreed amaxes, f32[L]; may be None when every leaf is scaled).
  """
  out = []
  for i, g in enumerate(grads):
    if is_scaled(g):
      out.append(jnp.asarray(g.scale, jnp.float32) * float(jnp.finfo(g.data.dtype).max))
    elif amax_g is None:
      raise ValueError("grad_bounds: a plain (unscaled) gradient leaf needs its amax")
    else:
      out.append(amax_g[i])
  return jnp.stack(out) if out else jnp.zeros((0,), jnp.float32)


def encode(m, r_units, mu_scale, nu_scale, mu_dtype, nu_dtype):
  """(m in f32, r in units of nu_scale) -> (mu, nu) ScaledArrays (u = m / r, 0 where r = 0)."""
  r = r_units * nu_scale
  u = jnp.where(r > 0, m / jnp.where(r > 0, r, 1.0), 0.0)
  bound = float(jnp.finfo(nu_dtype).max)
  return (ScaledArray(quantize_with_scale(u, mu_scale, mu_dtype), mu_scale),
          ScaledArray(jnp.minimum(r_units, bound).astype(nu_dtype), nu_scale))


def adam_moments(state):
  """Adam's (m, v) in f32 decoded from a :class:`fp8jax.optim.ScaleByAdamState` (two trees
  like the params): for inspection, tests and conversion to optax's state. ``v = r * r``
  overflows to inf where |gradient| > ~1e19 (the stored state itself does not)."""
  mus, treedef = jax.tree.flatten(state.mu, is_leaf=lambda x: isinstance(x, ScaledArray))
  pairs = [decode(mu, nu) for mu, nu in zip(mus, treedef.flatten_up_to(state.nu))]
  return (jax.tree.unflatten(treedef, [m for m, _ in pairs]),
          jax.tree.unflatten(treedef, [r * r for _, r in pairs]))
