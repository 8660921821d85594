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
import numpy as np
import optax

from fp8jax.optim import moments
from fp8jax.optim.finite import skip_not_finite
from fp8jax.optim.scaled import (ScaledArray, amaxes, check_float_dtype, check_real,
                                 dequantize_scaled, is_scaled, zeros_like_scaled)

# Default payload types as dtype objects, not scalar types: ``optax.inject_hyperparams``
# takes every callable argument for a schedule, and ``jnp.float8_e4m3fn`` is callable.
E4M3 = np.dtype(jnp.float8_e4m3fn)
F16 = np.dtype(jnp.float16)


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


def _concrete(x):
  """The value of a numeric scalar as a Python number; None for a traced value."""
  if isinstance(x, (int, float)):
    return x
  try:
    return float(x)
  except TypeError:  # a tracer (jax.errors.ConcretizationTypeError) or not a scalar
    return None


def _check_betas(b1, b2):
  """ValueError for betas outside 0 <= b1 < 1, 0 < b2 < 1 (traced values are not checked)."""
  for name, b, low_ok, rule in (("b1", b1, True, "0 <= b1 < 1"), ("b2", b2, False, "0 < b2 < 1")):
    v = _concrete(b)
    if v is None or ((0 <= v if low_ok else 0 < v) and v < 1):
      continue
    dtype = getattr(b, "dtype", None)
    hint = ""
    if dtype is not None and np.dtype(dtype).itemsize < 4:
      hint = (f" ({np.dtype(dtype)} rounded it; give optax.inject_hyperparams "
              "hyperparam_dtype=jnp.float32)")
    raise ValueError(f"scale_by_adam: {name}={v!r} is not allowed; use {rule}{hint}")


def _bias_correction(decay, count):
  """1 - decay**count in f32."""
  return 1.0 - jnp.asarray(decay, jnp.float32) ** count.astype(jnp.float32)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                  eps_root: float = 0.0, mu_dtype: Any = E4M3, *, nesterov: bool = False,
                  nu_dtype: Any = F16,
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

  The numeric hyperparameters (`b1`, `b2`, `eps`, `eps_root`) may be Python numbers or f32[]
  arrays, traced ones included, so ``optax.inject_hyperparams`` can hold them in the state.
  A traced value equal to a Python number gives the same updates and state when b1, b2 are
  f32 values in [0.5, 1) (elsewhere ``1 - b`` is rounded once more: it is computed in
  float64 for a Python number, as optax does). Traced betas are not range-checked.
  Params must be real: ``init`` raises ValueError naming the first complex leaf (and
  ``update`` the first complex gradient); train complex leaves with a plain optax optimizer
  through ``optax.partition`` (docs/optim.md).
  """
  _check_betas(b1, b2)
  mu_dtype = check_float_dtype("scale_by_adam", "mu_dtype", jnp.float32 if mu_dtype is None else mu_dtype)
  nu_dtype = check_float_dtype("scale_by_adam", "nu_dtype", jnp.float32 if nu_dtype is None else nu_dtype)
  axis_names = tuple(axis_names)

  def init(params):
    check_real("fp8jax.optim.scale_by_adam", "parameter", params)
    zeros = lambda dtype: jax.tree.map(lambda p: zeros_like_scaled(p, dtype), params,
                                       is_leaf=is_scaled)
    return ScaleByAdamState(jnp.zeros((), jnp.int32), zeros(mu_dtype), zeros(nu_dtype))

  def update(updates, state, params=None):
    del params
    check_real("fp8jax.optim.scale_by_adam", "gradient", updates)
    b1_, b2_ = moments.hyper(b1), moments.hyper(b2)
    eps_ = moments.hyper(eps)
    grads, treedef = jax.tree.flatten(updates, is_leaf=is_scaled)
    mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
    # Per-tensor scalars, stacked (f32[L]) so they cost one collective and one small kernel.
    amax_g = amaxes(grads, axis_names)
    ok = jnp.all(jnp.isfinite(amax_g))
    old_mu_scale = jnp.stack([mu.scale for mu in mus]) if mus else jnp.zeros((0,))
    old_nu_scale = jnp.stack([nu.scale for nu in nus]) if nus else jnp.zeros((0,))
    mu_scale, nu_scale = moments.next_scales(old_mu_scale, old_nu_scale,
                                             moments.grad_bounds(grads, amax_g), b1_, b2_,
                                             mu_dtype, nu_dtype)
    mu_scale = jnp.where(ok, mu_scale, old_mu_scale)
    nu_scale = jnp.where(ok, nu_scale, old_nu_scale)
    count = optax.safe_int32_increment(state.count)
    bc1, bc2 = _bias_correction(b1_, count), _bias_correction(b2_, count)
    new_grads, new_mus, new_nus = [], [], []
    for i, (g, mu, nu) in enumerate(zip(grads, mus, nus)):
      out_dtype = jnp.float32 if is_scaled(g) else g.dtype
      g = dequantize_scaled(g)
      m_old, r_old = moments.decode(mu, nu)
      m, r_units = moments.advance(m_old, r_old, g, nu_scale[i], b1_, b2_)
      if nesterov:
        m_hat = b1_ * m / _bias_correction(b1_, optax.safe_int32_increment(count)) \
            + moments.complement(b1_) * g / bc1
      else:
        m_hat = m / bc1
      # sqrt(v_hat + eps_root), with r = r_units * nu_scale.
      r_hat = r_units * (nu_scale[i] / jnp.sqrt(bc2))
      if not (isinstance(eps_root, (int, float)) and eps_root == 0):
        r_hat = jnp.hypot(r_hat, jnp.sqrt(jnp.asarray(eps_root, jnp.float32)))
      new_mu, new_nu = moments.encode(m, r_units, mu_scale[i], nu_scale[i], mu_dtype, nu_dtype)
      new_grads.append(jnp.where(ok, m_hat / (r_hat + eps_), 0.0).astype(out_dtype))
      new_mus.append(ScaledArray(jnp.where(ok, new_mu.data, mu.data), mu_scale[i]))
      new_nus.append(ScaledArray(jnp.where(ok, new_nu.data, nu.data), nu_scale[i]))
    new_state = ScaleByAdamState(jnp.where(ok, count, state.count),
                                 jax.tree.unflatten(treedef, new_mus),
                                 jax.tree.unflatten(treedef, new_nus))
    return jax.tree.unflatten(treedef, new_grads), new_state

  return optax.GradientTransformation(init, update)


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, mu_dtype: Any = E4M3, *, nesterov: bool = False,
         nu_dtype: Any = F16,
         axis_names: Sequence[str] = ()) -> optax.GradientTransformationExtraArgs:
  """optax.adam with the state of :func:`scale_by_adam`; `learning_rate` may be a schedule.

  A step with non-finite gradients is skipped as a whole (zero updates, state unchanged,
  schedule count included). Numeric hyperparameters may be traced (see
  :func:`scale_by_adam`): ``optax.inject_hyperparams(adam)(learning_rate=...)`` works under
  ``jax.jit``; the dtype arguments, if given as scalar types such as ``jnp.bfloat16``, go in
  ``static_args`` (``np.dtype`` objects or strings need not). Complex params are refused at
  ``init`` (ValueError naming the leaf); give them a plain optax optimizer with
  ``optax.partition``.
  """
  return skip_not_finite(optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, nu_dtype=nu_dtype,
                    axis_names=axis_names),
      optax.scale_by_learning_rate(learning_rate)), axis_names)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, mu_dtype: Any = E4M3, weight_decay: float = 1e-4,
          mask=None, *, nesterov: bool = False, nu_dtype: Any = F16,
          axis_names: Sequence[str] = ()) -> optax.GradientTransformationExtraArgs:
  """optax.adamw (decoupled weight decay, `mask` selects the decayed params) with the state
  of :func:`scale_by_adam`; `learning_rate` and `weight_decay` may be schedules.

  Weight decay needs `params` (plain arrays; with FP16 master weights pass
  :func:`fp8jax.optim.master_params`). A step with non-finite gradients is skipped as a
  whole: zero updates (no decay either), state unchanged.

  Every numeric hyperparameter (`learning_rate`, `b1`, `b2`, `eps`, `eps_root`,
  `weight_decay`) may be a traced f32[], so ``optax.inject_hyperparams(adamw)(
  learning_rate=...)`` works under ``jax.jit`` and gives the updates of the plain call with
  the same values (:func:`scale_by_adam`); dtype arguments given as scalar types (e.g.
  ``jnp.bfloat16``) go in ``static_args``. With bf16/f16 params ``inject_hyperparams``
  rounds the hyperparameters to the params' dtype (b2 = 0.999 becomes 1.0, refused): pass
  ``hyperparam_dtype=jnp.float32``.

  Complex params are refused: ``init`` raises ValueError naming the first complex leaf and
  its dtype. Train them with a plain optax optimizer and the rest with this one::

    labels = jax.tree.map(lambda p: "complex" if jnp.iscomplexobj(p) else "fp8", params)
    tx = optax.partition({"fp8": adamw(lr), "complex": optax.adamw(lr)}, labels)
  """
  return skip_not_finite(optax.chain(
      scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov=nesterov, nu_dtype=nu_dtype,
                    axis_names=axis_names),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate)), axis_names)
