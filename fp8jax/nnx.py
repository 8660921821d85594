"""Flax NNX support: the :class:`Fp8State` variable type and FP8 ``Linear`` / ``Einsum``.

FP8 state is an NNX variable of its own type, :class:`Fp8State` (not an ``nnx.Param``), that
holds one :class:`fp8jax.Fp8DotMeta` per GEMM. ``nnx.Optimizer(model, tx, wrt=nnx.Param)``
never sees it, so no optimizer, clipping or weight decay touches it.

How the state is updated (overwrite-with-gradient). The gradient of a loss with respect to an
``Fp8State`` is the *updated* meta (new amax history and scale), not a derivative. A layer
stores the passthrough meta of :func:`fp8jax.fp8_dot_general_chained` back into its variable
after each call, so a second call of the same layer in one forward consumes the first call's
output and the two updates combine by max in the backward pass (never by sum). This works
under ``nnx.grad`` / ``nnx.value_and_grad``, ``nnx.jit``, ``nnx.remat`` and ``nnx.scan``:
the stored passthrough has the same values as before, so the forward pass leaves the state
numerically unchanged; only :func:`apply_fp8_updates` writes new values.

Train step (Params to the optimizer, FP8 state overwritten with its gradient)::

  import optax
  from flax import nnx
  import fp8jax.nnx as fnnx

  model = MyModel(rngs=nnx.Rngs(0))               # built from fnnx.Linear / fnnx.Einsum
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x, y):
    def loss_fn(model):
      return jnp.mean((model(x) - y) ** 2)
    diff = nnx.DiffState(0, fnnx.PARAM_AND_FP8)   # nnx.Any(nnx.Param, fnnx.Fp8State)
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
    param_grads = fnnx.apply_fp8_updates(model, grads)  # writes Fp8State, returns the rest
    optimizer.update(model, param_grads)
    return loss

With the default ``argnums=0`` (Params only) the FP8 state never updates: the first cast of
every tensor then keeps using just-in-time (current) scaling. :func:`apply_fp8_updates` raises
when the model has FP8 state but the gradients hold none.

Scan over layers: create stacked layers with ``nnx.vmap`` (each ``Fp8State`` leaf gets a
leading layer axis) and apply them with ``nnx.scan``; each layer's state is updated from its
own amaxes. As with other NNX layers that write variables (BatchNorm), call these modules
inside NNX transforms (``nnx.jit``, ``nnx.grad``, ...), not inside raw ``jax.jit`` closures.
"""
from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from fp8jax.dot import fp8_dot_general_chained, init_dot_meta
from fp8jax.einsum import EinsumDims, einsum_to_dot_general, fp8_einsum, parse_einsum
from fp8jax.recipe import Recipe
from fp8jax.scaling import Fp8Meta, keep_untouched

__all__ = ["Fp8State", "PARAM_AND_FP8", "Linear", "Einsum", "EinsumDims", "parse_einsum",
           "einsum_to_dot_general", "fp8_einsum", "apply_fp8_updates"]


class Fp8State(nnx.Variable):
  """NNX variable holding FP8 state (an :class:`fp8jax.Fp8DotMeta` per GEMM).

  Not an ``nnx.Param``: optimizers built with ``wrt=nnx.Param`` skip it. Its gradient is
  the updated state; write it back with :func:`apply_fp8_updates`.
  """


PARAM_AND_FP8 = nnx.Any(nnx.Param, Fp8State)
"""Filter for ``nnx.DiffState``: differentiate Params and FP8 state together."""


# ----------------------------------------------------------------------------------------
# modules
# ----------------------------------------------------------------------------------------

def _check_recipe(recipe, amax_axes) -> tuple[str, ...]:
  if not isinstance(recipe, Recipe):
    raise TypeError(f"recipe must be an fp8jax.Recipe, got {type(recipe).__name__}")
  if isinstance(amax_axes, str):
    amax_axes = (amax_axes,)
  return tuple(amax_axes)


def _reject(name: str, value, default) -> None:
  if value is not default:
    raise ValueError(f"{name}={value!r} is not supported by fp8jax.nnx: the FP8 GEMM replaces "
                     f"it; leave the default")


def _no_out_sharding(out_sharding) -> None:
  if out_sharding is not None:
    raise ValueError(f"out_sharding={out_sharding!r} is not supported by fp8jax.nnx modules; "
                     "use None (shard with jax.jit / sharding constraints instead)")


class _Fp8Mixin:
  """Shared FP8 call: reads the layer's Fp8State, stores the passthrough back."""

  def _fp8_call(self, fn, *args):
    y, meta = fn(*args, self.fp8_meta.get_value())
    self.fp8_meta.set_value(meta)
    return y


class Linear(_Fp8Mixin, nnx.Linear):
  """``nnx.Linear`` whose matmul is an FP8 GEMM (see the module docstring).

  Same arguments as ``nnx.Linear`` plus `recipe` and `amax_axes` (mesh axes to agree amaxes
  over inside ``shard_map``). `precision` is ignored (FP8 GEMMs accumulate in f32);
  `dot_general` must stay the default. State: kernel [in, out], bias [out] (Params),
  fp8_meta (Fp8State holding an Fp8DotMeta).
  """

  def __init__(self, in_features: int, out_features: int, *, recipe: Recipe = Recipe(),
               amax_axes: Sequence[str] = (), dot_general=lax.dot_general, **kwargs):
    _reject("dot_general", dot_general, lax.dot_general)
    amax_axes = _check_recipe(recipe, amax_axes)
    super().__init__(in_features, out_features, **kwargs)
    self.recipe = recipe
    self.amax_axes = amax_axes
    self.fp8_meta = Fp8State(init_dot_meta(recipe))

  def _dot(self, x, kernel, meta):
    dn = (((x.ndim - 1,), (0,)), ((), ()))
    return fp8_dot_general_chained(x, kernel, dn, meta, self.recipe,
                                   preferred_element_type=self.preferred_element_type,
                                   amax_axes=self.amax_axes)

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    """inputs [..., in] -> [..., out]."""
    _no_out_sharding(out_sharding)
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)
    y = self._fp8_call(self._dot, inputs, kernel)
    if bias is not None:
      y += jnp.reshape(bias, (1,) * (y.ndim - 1) + (-1,))
    return y


class Einsum(_Fp8Mixin, nnx.Einsum):
  """``nnx.Einsum`` whose contraction is an FP8 GEMM (see :func:`einsum_to_dot_general`).

  Same arguments as ``nnx.Einsum`` plus `recipe` and `amax_axes`; `precision` is ignored and
  `einsum_op` must stay the default. The input is the FP8 "input" role, the kernel the
  "kernel" role. State: kernel, bias (Params), fp8_meta (Fp8State).
  """

  def __init__(self, einsum_str: str, kernel_shape, bias_shape=None, *,
               recipe: Recipe = Recipe(), amax_axes: Sequence[str] = (),
               einsum_op=jnp.einsum, **kwargs):
    _reject("einsum_op", einsum_op, jnp.einsum)
    amax_axes = _check_recipe(recipe, amax_axes)
    super().__init__(einsum_str, kernel_shape, bias_shape, **kwargs)
    self.recipe = recipe
    self.amax_axes = amax_axes
    self.fp8_meta = Fp8State(init_dot_meta(recipe))

  def __call__(self, inputs: jax.Array, einsum_str: str | None = None,
               out_sharding=None) -> jax.Array:
    """inputs -> einsum(eqn, inputs, kernel) (+ bias); a call-time `einsum_str` wins, as in
    ``nnx.Einsum``."""
    _no_out_sharding(out_sharding)
    eqn = (einsum_str if einsum_str is not None else self.einsum_str).replace(" ", "")
    self._einsum_str_check(eqn)
    bias = self.bias[...] if self.bias is not None else None
    inputs, kernel, bias = self.promote_dtype((inputs, self.kernel[...], bias), dtype=self.dtype)
    einsum = lambda x, k, meta: fp8_einsum(
        eqn, x, k, meta, self.recipe, preferred_element_type=self.preferred_element_type,
        amax_axes=self.amax_axes)
    y = self._fp8_call(einsum, inputs, kernel)
    if bias is not None:
      y += jnp.reshape(bias, self._bias_shape(eqn, inputs.ndim, kernel.shape))
    return y

  def _bias_shape(self, eqn: str, lhs_ndim: int, kernel_shape) -> list[int]:
    """Output-rank shape with the kernel's size on output axes labelled in the kernel, else 1."""
    _, rhs, out = parse_einsum(eqn, lhs_ndim, len(kernel_shape))
    sizes = dict(zip(rhs, kernel_shape))
    return [sizes.get(c, 1) for c in out]


# ----------------------------------------------------------------------------------------
# train-step helpers
# ----------------------------------------------------------------------------------------

def _is_meta(x) -> bool:
  return isinstance(x, Fp8Meta)


def apply_fp8_updates(model: nnx.Module, grads: nnx.State) -> nnx.State:
  """Writes the Fp8State part of `grads` into `model`; returns the other grads (Params).

  `grads` comes from ``nnx.grad`` / ``nnx.value_and_grad`` with
  ``argnums=nnx.DiffState(0, PARAM_AND_FP8)``. The returned state goes to
  ``optimizer.update(model, param_grads)``. Layers not called in the forward keep their state.
  """
  fp8_grads, rest = nnx.split_state(grads, Fp8State, ...)
  old = nnx.state(model, Fp8State)
  if not jax.tree.leaves(fp8_grads):
    if jax.tree.leaves(old):
      raise ValueError("apply_fp8_updates: the model has Fp8State but `grads` holds none; take "
                       "gradients with argnums=nnx.DiffState(0, fp8jax.nnx.PARAM_AND_FP8)")
    return rest
  merged = jax.tree.map(keep_untouched, fp8_grads, nnx.filter_state(old, _paths(fp8_grads)),
                        is_leaf=_is_meta)
  nnx.update(model, merged)
  return rest


def _paths(state: nnx.State):
  """A filter matching exactly the variable paths present in `state`."""
  paths = {path for path, _ in nnx.to_flat_state(state)}
  return lambda path, _: tuple(path) in paths
