"""Adam and AdamW with FP8 / FP16 state, as optax transforms (MS-AMP O2, wider range).

Math runs in f32; the state is stored low precision (see :mod:`fp8jax.optim.moments`):
``mu`` holds the first moment divided by the root of the second (E4M3 by default) and
``nu`` the root of the second moment (FP16 by default), each with one f32 scale per tensor:
3 bytes per parameter plus 8 bytes per tensor and a 4-byte count.

Gradients may be plain arrays or :class:`~fp8jax.optim.ScaledArray`\\ s (FP8 payload with a
scale, as FP8 gradient communication delivers them); updates come back as plain arrays (f32
for scaled gradients, else the gradient's dtype, as optax does). A step with any inf/NaN
gradient returns zero updates and leaves the state unchanged (see :mod:`fp8jax.optim.finite`).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from fp8jax.optim import moments
from fp8jax.optim.finite import skip_not_finite
from fp8jax.optim.scaled import (ScaledArray, amaxes, check_float_dtype, dequantize_scaled,
                                 is_scaled, zeros_like_scaled)

E4M3 = jnp.float8_e4m3fn


class ScaleByAdamState(NamedTuple):
  """State of :func:`scale_by_adam`.

  Attributes:
    count: i32[] steps applied (skipped steps not counted).
    mu: tree like the params of ScaledArray: ``m / sqrt(v)`` (mu_dtype, f32[] scale).
    nu: tree like the params of ScaledArray: ``sqrt(v)`` (nu_dtype, f32[] scale).
  """

  count: jax.Array
  mu: Any
  nu: Any


def _check_betas(b1, b2):
  """ValueError for betas outside 0 <= b1 < 1, 0 < b2 < 1 (Python numbers only)."""
  if isinstance(b1, (int, float)) and not 0 <= b1 < 1:
    raise ValueError(f"scale_by_adam: b1={b1!r} is not allowed; use 0 <= b1 < 1")
  if isinstance(b2, (int, float)) and not 0 < b2 < 1:
    raise ValueError(f"scale_by_adam: b2={b2!r} is not allowed; use 0 < b2 < 1")


def _bias_correction(decay, count):
  """1 - decay**count in f32."""
  return 1.0 - jnp.asarray(decay, jnp.float32) ** count.astype(jnp.float32)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0, mu_dtype: Any = E4M3, *, nesterov: bool = False,
                  nu_dtype: Any = jnp.float16,
                  axis_names: Sequence[str] = ()) -> optax.GradientTransformation:
  """Adam's scaling (optax.scale_by_adam's signature) with low-precision moments.

  Args:
    b1, b2: decay rates of the first and second moment (0 <= b1 < 1, 0 < b2 < 1).
    eps, eps_root: added to the denominator outside / inside the square root.
    mu_dtype: payload type of the normalised first moment (E4M3; None means float32).
    nesterov: Nesterov momentum, as in optax.
    nu_dtype: payload type of the second moment's root (FP16; None means float32).
    axis_names: mesh axes to agree scales and the finiteness check over inside
      ``shard_map`` (axes the arrays are typed as varying over are added automatically).
  Returns:
    An ``optax.GradientTransformation`` with state :class:`ScaleByAdamState`. Its states are
    built elementwise from the params, so they shard like them; ``init`` under ``jax.jit``
    with Auto mesh axes needs ``out_shardings`` (outside jit, or with Explicit axes, the
    params' shardings carry over).
  """
  _check_betas(b1, b2)
  mu_dtype = check_float_dtype("scale_by_adam", "mu_dtype", jnp.float32 if mu_dtype is None else mu_dtype)
  nu_dtype = check_float_dtype("scale_by_adam", "nu_dtype", jnp.float32 if nu_dtype is None else nu_dtype)
  axis_names = tuple(axis_names)

  def init(params):
    zeros = lambda dtype: jax.tree.map(lambda p: zeros_like_scaled(p, dtype), params,
                                       is_leaf=is_scaled)
    return ScaleByAdamState(jnp.zeros((), jnp.int32), zeros(mu_dtype), zeros(nu_dtype))

  def update(updates, state, params=None):
    del params
    grads, treedef = jax.tree.flatten(updates, is_leaf=is_scaled)
    mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
    # Per-tensor scalars, stacked (f32[L]) so they cost one collective and one small kernel.
    amax_g = amaxes(grads, axis_names)
    ok = jnp.all(jnp.isfinite(amax_g))
    old_mu_scale = jnp.stack([mu.scale for mu in mus]) if mus else jnp.zeros((0,))
    old_nu_scale = jnp.stack([nu.scale for nu in nus]) if nus else jnp.zeros((0,))
    mu_scale, nu_scale = moments.next_scales(old_mu_scale, old_nu_scale,
                                             moments.grad_bounds(grads, amax_g), b1, b2,
                                             mu_dtype, nu_dtype)
    mu_scale = jnp.where(ok, mu_scale, old_mu_scale)
    nu_scale = jnp.where(ok, nu_scale, old_nu_scale)
    count = optax.safe_int32_increment(state.count)
    bc1, bc2 = _bias_correction(b1, count), _bias_correction(b2, count)
    new_grads, new_mus, new_nus = [], [], []
    for i, (g, mu, nu) in enumerate(zip(grads, mus, nus)):
      out_dtype = jnp.float32 if is_scaled(g) else g.dtype
      g = dequantize_scaled(g)
      m_old, r_old = moments.decode(mu, nu)
      m, r_units = moments.advance(m_old, r_old, g, nu_scale[i], b1, b2)
      if nesterov:
        m_hat = b1 * m / _bias_correction(b1, optax.safe_int32_increment(count)) \
            + (1.0 - b1) * g / bc1
      else:
        m_hat = m / bc1
      # sqrt(v_hat + eps_root), with r = r_units * nu_scale.
      r_hat = r_units * (nu_scale[i] / jnp.sqrt(bc2))
      if not (isinstance(eps_root, (int, float)) and eps_root == 0):
        r_hat = jnp.hypot(r_hat, jnp.sqrt(jnp.asarray(eps_root, jnp.float32)))
      new_mu, new_nu = moments.encode(m, r_units, mu_scale[i], nu_scale[i], mu_dtype, nu_dtype)
      new_grads.append(jnp.where(ok, m_hat / (r_hat + eps), 0.0).astype(out_dtype))
      new_mus.append(ScaledArray(jnp.where(ok, new_mu.data, mu.data), mu_scale[i]))
      new_nus.append(ScaledArray(jnp.where(ok, new_nu.data, nu.data), nu_scale[i]))
    new_state = ScaleByAdamState(jnp.where(ok, count, state.count),
                                 jax.tree.unflatten(treedef, new_mus),
                                 jax.tree.unflatten(treedef, new_nus))
    return jax.tree.unflatten(treedef, new_grads), new_state

  return optax.GradientTransformation(init, update)


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: Any = E4M3, *, nesterov: bool = False,
         nu_dtype: Any = jnp.float16,
         axis_names: Sequence[str] = ()) -> optax.GradientTransformationExtraArgs:
  """optax.adam with the state of :func:`scale_by_adam`; `learning_rate` may be a schedule.

  A step with non-finite gradients is skipped as a whole (zero updates, state unchanged,
  schedule count included).
  """
  return skip_not_finite(optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, nu_dtype=nu_dtype,
                    axis_names=axis_names),
      optax.scale_by_learning_rate(learning_rate)), axis_names)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: Any = E4M3, weight_decay: float = 1e-4,
          mask=None, *, nesterov: bool = False, nu_dtype: Any = jnp.float16,
          axis_names: Sequence[str] = ()) -> optax.GradientTransformationExtraArgs:
  """optax.adamw (decoupled weight decay, `mask` selects the decayed params) with the state
  of :func:`scale_by_adam`; `learning_rate` and `weight_decay` may be schedules.

  Weight decay needs `params` (plain arrays; with FP16 master weights pass
  :func:`fp8jax.optim.master_params`). A step with non-finite gradients is skipped as a
  whole: zero updates (no decay either), state unchanged.
  """
  return skip_not_finite(optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, nu_dtype=nu_dtype,
                    axis_names=axis_names),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate)), axis_names)
