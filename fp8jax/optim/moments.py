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
Neither payload saturates. ``r`` is computed in units of its new scale, so gradients from
1e-38 to 3e38 neither underflow nor overflow on the way.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from fp8jax.optim.scaled import (ScaledArray, dequantize_scaled, is_scaled, payload_max,
                                 quantize_with_scale, scale_from_bound)


def decode(mu: ScaledArray, nu: ScaledArray):
  """Stored moments -> (m, r) in f32: first moment and root of the second, shaped like mu."""
  r = dequantize_scaled(nu)
  return dequantize_scaled(mu) * r, r


def advance(m_old, r_old, g, nu_scale, b1: float, b2: float):
  """One Adam moment step in f32: (m, r) with r = sqrt(b2 r_old^2 + (1-b2) g^2).

  `r` is computed in units of the new `nu_scale` (where it is <= the payload max, so its
  square cannot overflow and only elements ~19 decades below the tensor's largest, which the
  payload flushes anyway, underflow) and returned in those units: ``r_units * nu_scale`` is
  the root, ``r_units`` is what ``nu`` stores.
  """
  inv = jnp.where(nu_scale > 0, 1.0 / nu_scale, 0.0)
  m = b1 * m_old + (1.0 - b1) * g
  x, y = r_old * inv, g * inv
  return m, jnp.sqrt(b2 * (x * x) + (1.0 - b2) * (y * y))


def u_cap(b1: float, b2: float, mu_dtype, nu_dtype) -> float:
  """The Cauchy-Schwarz bound on ``|u| = |m| / sqrt(v)`` (inf where b1^2 >= b2), with the
  relative rounding of the stored ``u`` and ``r`` folded into b1 and b2."""
  rel = lambda dtype: 2.0 ** -(int(jnp.finfo(dtype).nmant) + 1)
  eps_u, eps_r = rel(mu_dtype), rel(nu_dtype)
  b1e = b1 * (1.0 + eps_u) * (1.0 + eps_r)
  b2e = b2 * (1.0 - eps_r) ** 2
  if b1e * b1e >= b2e:
    return math.inf
  return (1.0 - b1) * (1.0 + eps_u) / math.sqrt((1.0 - b2) * (1.0 - b1e * b1e / b2e))


def next_scales(mu_scale, nu_scale, amax_g, b1: float, b2: float, mu_dtype, nu_dtype):
  """(mu_scale, nu_scale) for the state written this step, from the bounds above.

  Elementwise over stacked per-tensor values (f32[L] for a tree of L tensors): `mu_scale` and
  `nu_scale` are the old state's scales, `amax_g` the gradient's agreed amax (or a bound on it).
  """
  pmax_nu, pmax_mu = payload_max(nu_dtype), payload_max(mu_dtype)
  r_bound = jnp.hypot(math.sqrt(b2) * nu_scale * pmax_nu, math.sqrt(1.0 - b2) * amax_g)
  u_bound = b1 / math.sqrt(b2) * (mu_scale * pmax_mu) + (1.0 - b1) / math.sqrt(1.0 - b2)
  u_bound = jnp.minimum(u_bound, u_cap(b1, b2, mu_dtype, nu_dtype))
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
