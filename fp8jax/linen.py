"""Flax linen support: an FP8 ``dot_general_cls`` and FP8 state handling.

Usage::

  dense = nn.Dense(1024, dot_general_cls=functools.partial(fp8jax.linen.Fp8DotGeneral,
                                                           recipe=fp8jax.Recipe()))
  variables = model.init(key, x)                    # {'params': ..., 'fp8_meta': ...}
  grads = jax.grad(loss_fn)(variables, batch)       # differentiate ALL variables
  updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
  variables = fp8jax.apply_fp8_updates(variables, grads)   # FP8 state <- its new value
  variables = {**variables, "params": optax.apply_updates(variables["params"], updates)}

The FP8 state lives in the collection ``FP8_COLLECTION``; its "gradient" is its updated
value, so the optimizer must only ever see ``grads["params"]``. Under ``nn.scan`` over layers
put ``FP8_COLLECTION`` in ``variable_axes`` (state stacked on the layer axis).

For inference of weights trained elsewhere (an imported checkpoint, a BF16 run evaluated with
FP8 GEMMs): :func:`init_fp8_state` makes a model's FP8 state without initialising parameters,
and :func:`calibrate_fp8` sets its forward scales from the amaxes of a few forward passes (no
gradient); under ``nn.scan`` put ``CALIBRATION_COLLECTION`` in ``variable_axes`` too.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Sequence

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp

from fp8jax import dot, einsum, fsdp, scaling
from fp8jax.kernels import cast_transpose
from fp8jax.dot import Fp8DotMeta
from fp8jax.recipe import Recipe

FP8_COLLECTION = "fp8_meta"
# Diagnostics (see fp8jax.train.health): only computed when the collection is mutable.
HEALTH_COLLECTION = "fp8_health"
PERTURBATIONS = "perturbations"
# Weights cast to FP8 once outside the model (see cast_weights): read by Fp8DotGeneral.
WEIGHT_CAST_COLLECTION = "fp8_weight_cast"
# Forward amaxes of each FP8 GEMM's operands, sown when the collection is mutable (see
# calibrate_fp8): {"input": f32[], "kernel": f32[]} per GEMM, the max over its calls.
CALIBRATION_COLLECTION = "fp8_calibration"
_FORWARD_ROLES = ("input", "kernel")
_ROLES = Fp8DotMeta._fields
# Per apply (keyed weakly by the root scope): the meta passthrough of each FP8 GEMM's last
# call, so that a second call of the same layer chains onto the first (updates combine by
# max instead of summing).
_CHAINS: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


def _chained(module: nn.Module, fn, lhs, rhs, *rest, activation: str | None = None,
             norm=None):
  """Runs ``fn(lhs, rhs, *rest, meta) -> (y, meta_passthrough)`` with `module`'s FP8 state.

  A second call of the same module in one apply consumes the first call's passthrough, so
  their FP8 updates combine by max in the backward pass. `activation`: the GEMM multiplies
  ``activate(lhs, activation)``; `norm` (gain, eps): ``rms_norm(lhs, gain, eps)`` (what the
  health probe looks at).
  """
  variables = {role: module.variable(FP8_COLLECTION, role, scaling.init_meta,
                                     module.recipe.amax_history_len) for role in _ROLES}
  chain = _CHAINS.setdefault(module.scope.root, {})
  meta = chain.get(module.scope.path)
  if meta is None:
    meta = Fp8DotMeta(*(variables[role].value for role in _ROLES))
  probing = module.is_mutable_collection(HEALTH_COLLECTION) and not module.is_initializing()
  # Like nn.Module.perturb: the taps are created when the collection is mutable, else used
  # if given (a probe that cannot make HEALTH_COLLECTION mutable, e.g. through pipeline
  # stages, reads the forward casts' health from the "forward_health" tap's gradient).
  def tap(name: str) -> bool:
    return not module.is_initializing() and (module.is_mutable_collection(PERTURBATIONS)
                                             or module.has_variable(PERTURBATIONS, name))
  calibrating = (module.is_mutable_collection(CALIBRATION_COLLECTION)
                 and not module.is_initializing())
  if probing or calibrating or tap("forward_health"):
    operand = (cast_transpose.activate(lhs, activation) if norm is None
               else cast_transpose.rms_norm(lhs, *norm))
  if probing:
    _sow_cast_health(module, meta, operand, rhs)
  if tap("forward_health"):
    forward = module.variable(PERTURBATIONS, "forward_health", jnp.zeros, (4,), jnp.float32)
    lhs = _forward_health_tap(lhs, forward.value, forward_health(module.recipe, meta,
                                                                  operand, rhs))
  if calibrating:
    axes = tuple(getattr(module, "amax_axes", ()))
    for role, x in zip(_FORWARD_ROLES, (operand, rhs)):
      module.sow(CALIBRATION_COLLECTION, role, scaling.compute_amax(x, axes),
                 reduce_fn=jnp.maximum, init_fn=lambda: jnp.zeros((), jnp.float32))
  y, chain[module.scope.path] = fn(lhs, rhs, *rest, meta)
  if tap("output_grad_health"):
    og = meta.output_grad
    # The scale the backward cast will use; 0 when it uses the gradient's own amax (current
    # scaling, or a delayed meta that has observed nothing yet).
    stored = (jnp.max(og.amax_history) > 0) & (module.recipe.scaling == "delayed")
    # The probe differentiates w.r.t. this zero f32[2]: its gradient is the (saturated,
    # flushed) fractions of the output gradient's cast (summed over the layer's calls).
    og_tap = module.variable(PERTURBATIONS, "output_grad_health", jnp.zeros, (2,), jnp.float32)
    y = _health_tap(y, og_tap.value, jnp.where(stored, og.scale, 0.0),
                    module.recipe.bwd_format)
  return y


def output_grad_health(g: jax.Array, scale: jax.Array, fmt) -> jax.Array:
  """f32[2]: (saturated, flushed) fractions of casting the output gradient `g` to `fmt` with
  `scale` (0: the scale of `g`'s own amax, as a cast with no stored scale takes it)."""
  own = scaling.scale_from_amax(scaling.compute_amax(g), jnp.float32(1), fmt)
  return jnp.stack(scaling.cast_health(g, jnp.where(scale > 0, scale, own), fmt))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _health_tap(y, tap, scale, fmt):
  """Identity on `y`; the cotangent of `tap` (f32[2]) is :func:`output_grad_health` of y's
  cotangent with `scale` and FP8 dtype `fmt`, so the probe reads each GEMM's output-gradient
  health from two numbers instead of keeping a tensor the size of every output."""
  del tap, scale
  return y


def _health_tap_fwd(y, tap, scale, fmt):
  del tap, fmt
  return y, scale


def _health_tap_bwd(fmt, scale, g):
  return g, output_grad_health(g, scale, fmt), jnp.zeros_like(scale)


_health_tap.defvjp(_health_tap_fwd, _health_tap_bwd)


def forward_health(recipe, meta, lhs, rhs) -> jax.Array:
  """f32[4]: (input saturated, input flushed, kernel saturated, kernel flushed) fractions of
  a GEMM's two forward casts with `meta`'s scales (``scaling.cast_health``). A value only:
  no gradient flows through it (the health tap's backward gives it a zero cotangent), so a
  probe's autodiff traces it once, as a constant.

  The kernel's pair is tagged as part of the weight cast (``dot.WEIGHT_CAST_NAME``): a remat
  policy that keeps the weight casts keeps it too, so the backward pass, which recomputes
  only what the policy did not save, needs no weight for it (else every layer's weight
  would stay alive from the forward to the backward of a probe under a layer scan)."""
  meta, lhs, rhs = jax.lax.stop_gradient((meta, lhs, rhs))
  pairs = []
  for x, m in ((lhs, meta.input), (rhs, meta.kernel)):
    scale = scaling.scale_for_cast(m, scaling.compute_amax(x), recipe, recipe.fwd_format)
    pairs.append(jnp.stack(scaling.cast_health(x, scale, recipe.fwd_format)))
  kernel, = scaling.checkpoint_named(dot.WEIGHT_CAST_NAME, pairs[1])
  return jnp.concatenate([pairs[0], kernel])


@jax.custom_vjp
def _forward_health_tap(x, tap, health):
  """Identity on `x`; the cotangent of `tap` (f32[4]) is `health` (:func:`forward_health`),
  so a probe that differentiates the taps reads the forward casts' health (summed over a
  layer's calls) without a mutable collection."""
  del tap, health
  return x


def _forward_health_tap_fwd(x, tap, health):
  del tap
  return x, health


def _forward_health_tap_bwd(health, g):
  return g, health, jnp.zeros_like(health)


_forward_health_tap.defvjp(_forward_health_tap_fwd, _forward_health_tap_bwd)


def _sow_cast_health(module, meta, lhs, rhs) -> None:
  """Sows the saturated / flushed fractions of this GEMM's two forward casts (max over calls)."""
  fractions = forward_health(module.recipe, meta, lhs, rhs)
  for i, (role, name) in enumerate((("input", "saturated"), ("input", "flushed"),
                                    ("kernel", "saturated"), ("kernel", "flushed"))):
    module.sow(HEALTH_COLLECTION, f"{role}_{name}", fractions[i], reduce_fn=jnp.maximum,
               init_fn=lambda: jnp.zeros(()))


def _weight_shardings(module: nn.Module, rhs) -> tuple[Any, bool]:
  """((home, gathered) shardings of the weight `rhs` of `module`'s GEMM (its parent's
  "kernel" parameter) under the active :class:`fp8jax.fsdp.WeightGather`, its keep_gathered);
  (None, False) without one, or when the weight is not split over the ZeRO axes."""
  gather = fsdp.active()
  if gather is None:
    return None, False
  path = fsdp.key_path(module.scope.path[:-1] + ("kernel",))
  return gather.shardings(path, jnp.shape(rhs)), gather.keep_gathered


class Fp8DotGeneral(nn.Module):
  """Drop-in ``dot_general_cls`` for ``nn.Dense`` / ``nn.DenseGeneral`` running FP8 GEMMs.

  Under an active :class:`fp8jax.fsdp.WeightGather` (ZeRO-3) the weight arrives as its shard
  and the GEMM gathers its E4M3 cast (``fp8_dot_general_chained(weight_shardings=...)``).

  Attributes:
    recipe: FP8 formats and scaling rules.
    amax_axes: mesh axis names to agree amaxes over (only inside ``shard_map``).
    lhs_activation: None, or "gelu": the GEMM multiplies GELU(lhs) (computed inside the FP8
      cast, see ``fp8_dot_general_chained``); e.g. an MLP's output projection fed its
      pre-activation.
    lhs_norm: None, or ``(gain [K], eps)``: the GEMM multiplies RMSNorm(lhs) (normalized
      inside the FP8 cast, ``fp8_dot_general_chained``'s `lhs_norm`); e.g. a pre-norm layer's
      first projection fed the residual stream and the norm's gain.
  """

  recipe: Recipe = Recipe()
  amax_axes: Sequence[str] = ()
  lhs_activation: str | None = None
  lhs_norm: Any = None

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               out_sharding=None):
    del precision  # FP8 GEMMs accumulate in f32
    cast = None
    if self.has_variable(WEIGHT_CAST_COLLECTION, "q"):  # cast once outside: cast_weights
      cast = dot.WeightCast(*(self.get_variable(WEIGHT_CAST_COLLECTION, f)
                              for f in dot.WeightCast._fields))
    shardings, keep = (None, False) if cast is not None else _weight_shardings(self, rhs)
    out = _chained(self, lambda lhs, rhs, dn, meta: dot.fp8_dot_general_chained(
        lhs, rhs, dn, meta, self.recipe, preferred_element_type=preferred_element_type,
        amax_axes=tuple(self.amax_axes), weight_cast=cast, lhs_activation=self.lhs_activation,
        weight_shardings=shardings, keep_gathered_weight=keep, lhs_norm=self.lhs_norm), lhs,
        rhs, dimension_numbers, activation=self.lhs_activation, norm=self.lhs_norm)
    if out_sharding is not None:
      out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out


# The name nn.Dense / nn.DenseGeneral give the GEMM module they build from dot_general_cls.
DENSE_GEMM_NAME = "Fp8DotGeneral_0"


def _dense_mlp_variables(module: nn.Module, names: tuple[str, str], gated: bool = False):
  """((w_in, w_out), (each GEMM's Fp8DotMeta), (each weight's WeightCast or None)) of
  `module`'s two ``nn.Dense`` children `names`, or a str saying what is missing. `gated`: the
  first is an ``nn.DenseGeneral((F, 2))`` (kernel [D, F, 2], returned as [D, 2F])."""
  v = module.variables
  params, fp8 = v.get("params", {}), v.get(FP8_COLLECTION, {})
  casts_in = v.get(WEIGHT_CAST_COLLECTION, {})
  kernels, metas, casts = [], [], []
  for i, name in enumerate(names):
    p = params.get(name)
    pairs = gated and i == 0
    shape = jnp.shape(p["kernel"]) if p is not None and "kernel" in p else ()
    if p is None or set(p) != {"kernel"} or len(shape) != (3 if pairs else 2) or (
        pairs and shape[-1] != 2):
      what = "nn.DenseGeneral((F, 2))" if pairs else "nn.Dense"
      return (f"'{name}' is not a bias-free {what} with params (got "
              f"{ {k: list(jnp.shape(a)) for k, a in (p or {}).items()} })")
    state = fp8.get(name, {}).get(DENSE_GEMM_NAME)
    if state is None or set(state) != set(_ROLES):
      return f"'{name}' has no {DENSE_GEMM_NAME} FP8 state (its dot_general_cls is not FP8)"
    flat = lambda a: a.reshape(a.shape[0], -1)  # noqa: E731  [D, F, 2] -> [D, 2F]: a view
    kernels.append(flat(p["kernel"]))
    metas.append(Fp8DotMeta(*(state[role] for role in _ROLES)))
    cast = casts_in.get(name, {}).get(DENSE_GEMM_NAME)  # cast_weights: once per step
    casts.append(None if cast is None else dot.WeightCast(
        flat(cast["q"]), *(cast[f] for f in dot.WeightCast._fields[1:])))
  return tuple(kernels), tuple(metas), tuple(casts)


def dense_mlp_reason(module: nn.Module, x, names: tuple[str, str] = ("fc_in", "fc_out"),
                     activation: str = "gelu") -> str | None:
  """None when :func:`dense_mlp` can run `module`'s two Dense layers `names` on `x` with
  `activation`; else why not (then call the Dense layers themselves: same variables, same
  quantized math)."""
  if module.is_initializing():
    return "initializing (the Dense layers create their variables)"
  if (any(module.is_mutable_collection(c) for c in (HEALTH_COLLECTION, PERTURBATIONS))
      or PERTURBATIONS in module.variables):  # (a probe's taps given as variables)
    return "the FP8 health probe watches each Dense layer"
  if module.is_mutable_collection(CALIBRATION_COLLECTION):
    return "calibration reads each Dense layer's operands"
  if fsdp.active() is not None:
    return "ZeRO-3 gathers each Dense layer's weight at its GEMM"
  found = _dense_mlp_variables(module, names, activation in cast_transpose.GATED)
  if isinstance(found, str):
    return found
  (w_in, w_out), (m_in, m_out), _ = found
  return dot.mlp_op_reason(x, w_in, w_out, m_in, m_out)


def dense_mlp(module: nn.Module, x, recipe: Recipe, activation: str = "gelu", dtype=None,
              names: tuple[str, str] = ("fc_in", "fc_out"), norm=None):
  """``Dense(names[1])(activate(Dense(names[0])(x)))`` of `module`'s two bias-free ``nn.Dense``
  children with :class:`Fp8DotGeneral` GEMMs (with a gated `activation` such as "swiglu" the
  first is an ``nn.DenseGeneral((F, 2))``: (gate, up) pairs), run as one
  :func:`fp8jax.dot.fp8_mlp_chained` op on their variables (created by an earlier ``init``
  through the Dense layers themselves): the activation's derivative is applied inside the
  cast of the gradient entering the first GEMM. The variables, their FP8 updates (also
  chained with other calls of the same Dense layers in this apply), the weights cast outside
  (:func:`cast_weights`, when given) and the quantized math are the Dense layers'.

  Must run inside `module`'s compact ``__call__``. Args: x [..., D]; `recipe`: the Dense layers'
  recipe; `activation`: as for ``fp8_mlp_chained``; `dtype`: the Dense layers' compute dtype
  (inputs and kernels are promoted to it, as nn.Dense does; None: as they are); `norm`:
  None, or ``(gain [D], eps)``: the first layer's input is ``rms_norm(x, gain, eps)`` (the
  Dense layers then have ``lhs_norm``; ``fp8_mlp_chained``'s `norm`). Returns y [..., N].
  Raises ValueError where :func:`dense_mlp_reason` says it cannot run.
  """
  reason = dense_mlp_reason(module, x, names, activation)
  if reason:
    raise ValueError(f"dense_mlp of {module.scope.path} {names}: {reason}")
  (w_in, w_out), metas, (wc_in, wc_out) = _dense_mlp_variables(module, names,
                                                               activation in cast_transpose.GATED)
  if dtype is not None:
    x, w_in, w_out = (jnp.asarray(a, dtype) for a in (x, w_in, w_out))
  chain = _CHAINS.setdefault(module.scope.root, {})
  paths = [module.scope.path + (name, DENSE_GEMM_NAME) for name in names]
  m_in, m_out = (chain.get(path, meta) for path, meta in zip(paths, metas))
  y, chain[paths[0]], chain[paths[1]] = dot.fp8_mlp_chained(
      x, w_in, w_out, m_in, m_out, recipe, activation, weight_cast_in=wc_in,
      weight_cast_out=wc_out, norm=norm)
  return y


class DotGeneral(nn.Module):
  """``dot_general_cls`` for ``nn.Dense`` / ``nn.DenseGeneral`` running ``lax.dot_general``
  (BF16 GEMMs), whose weight under an active :class:`fp8jax.fsdp.WeightGather` (ZeRO-3)
  arrives as its shard and is gathered inside the GEMM
  (:func:`fp8jax.fsdp.gathered_dot_general`).
  """

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
               out_sharding=None):
    shardings, keep = _weight_shardings(self, rhs)
    if shardings is None:
      out = jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                preferred_element_type=preferred_element_type)
    else:
      out = fsdp.gathered_dot_general(lhs, rhs, dimension_numbers, *shardings,
                                      precision=precision,
                                      preferred_element_type=preferred_element_type,
                                      keep_gathered=keep)
    if out_sharding is not None:
      out = jax.lax.with_sharding_constraint(out, out_sharding)
    return out


class Fp8EinsumOp(nn.Module):
  """``einsum(eqn, lhs, rhs)`` as an FP8 GEMM with its own FP8 state (lhs: activations)."""

  recipe: Recipe = Recipe()
  amax_axes: Sequence[str] = ()

  @nn.compact
  def __call__(self, eqn: str, lhs, rhs, preferred_element_type=None):
    shardings, keep = _weight_shardings(self, rhs)
    return _chained(self, lambda x, k, meta: einsum.fp8_einsum(
        eqn, x, k, meta, self.recipe, preferred_element_type=preferred_element_type,
        amax_axes=tuple(self.amax_axes), weight_shardings=shardings,
        keep_gathered_weight=keep), lhs, rhs)


class Einsum(nn.Einsum):
  """``nn.Einsum`` whose contraction is an FP8 GEMM (same fields plus `recipe`, `amax_axes`).

  Flax's ``nn.Einsum`` has no ``dot_general_cls`` hook, so this subclass routes its einsum
  through :class:`Fp8EinsumOp`. `precision` is ignored.
  """

  recipe: Recipe = Recipe()
  amax_axes: Sequence[str] = ()

  @nn.compact
  def __call__(self, inputs, einsum_str: str | None = None):
    """inputs -> einsum(eqn, inputs, kernel) (+ bias)."""
    return einsum_forward(self, inputs, einsum_str, recipe=self.recipe, amax_axes=self.amax_axes)


def einsum_forward(module: nn.Einsum, inputs, einsum_str: str | None = None, *, recipe: Recipe,
                   amax_axes: Sequence[str] = ()):
  """``nn.Einsum``'s forward for `module` with its contraction an FP8 GEMM.

  Must run inside `module`'s own ``__call__`` (its compact scope): creates the same
  "kernel" / "bias" params as ``nn.Einsum`` and the FP8 state under the submodule "fp8"
  (:class:`Fp8EinsumOp`). Returns einsum(eqn, inputs, kernel) (+ bias). `precision` is
  ignored.
  """
  eqn = nn.module.merge_param("einsum_str", module.einsum_str, einsum_str).replace(" ", "")
  if "->" not in eqn or eqn.count(",") != 1:
    raise ValueError(f"einsum_str={eqn!r} must be explicit ('->') with exactly two operands")
  kernel = module.param("kernel", module.kernel_init, module.shape, module.param_dtype)
  bias = None
  if module.use_bias:
    bias_shape, broadcasted_bias_shape = module._get_bias_shape(eqn, inputs, kernel)
    bias = module.param("bias", module.bias_init, bias_shape, module.param_dtype)
  inputs, kernel, bias = module.promote_dtype(inputs, kernel, bias, dtype=module.dtype)
  y = Fp8EinsumOp(recipe, amax_axes, parent=module, name="fp8")(
      eqn, inputs, kernel, preferred_element_type=module.preferred_element_type)
  if bias is not None:
    y += jnp.reshape(bias, broadcasted_bias_shape)
  return y


def apply_fp8_updates(variables, grads):
  """`variables` with its FP8 collection replaced by the updated state found in `grads`.

  `grads` is the gradient of the loss with respect to all of `variables`; params are
  returned untouched, and so is the state of a GEMM that did not run (zero cotangent).
  Raises ValueError when `grads` holds no FP8 state.
  """
  if FP8_COLLECTION not in variables:
    return variables
  if FP8_COLLECTION not in grads:
    raise ValueError(f"grads has no '{FP8_COLLECTION}' collection (keys: {sorted(grads)}); "
                     "differentiate the loss with respect to all variables, not only params")
  new = jax.tree.map(scaling.keep_untouched, grads[FP8_COLLECTION], variables[FP8_COLLECTION],
                     is_leaf=lambda x: isinstance(x, scaling.Fp8Meta))
  return {**variables, FP8_COLLECTION: new}


def cast_weights(variables, recipe: Recipe, dtype=None) -> dict:
  """``{WEIGHT_CAST_COLLECTION: ...}``: the FP8 cast of every :class:`Fp8DotGeneral`'s weight,
  done once, to apply the model with (``{**variables, **cast_weights(...)}``).

  Each FP8 GEMM of an ``nn.Dense`` / ``nn.DenseGeneral`` multiplies its module's "kernel"
  param, promoted to the module's compute `dtype` (None: as stored); the cast is
  :func:`fp8jax.dot.cast_weight` of that with the GEMM's kernel state and `recipe`, so the
  results are bit-identical to the GEMM casting it itself. Use it to cast once per optimizer
  step for all microbatches (``make_train_step(cast_weights=...)``). States stacked by
  ``nn.scan`` (leading layer axes) are cast per layer; put ``WEIGHT_CAST_COLLECTION`` in the
  scan's ``variable_axes`` like ``FP8_COLLECTION``. GEMMs without a "kernel" param next to
  them are skipped (they cast as usual); the collection is not differentiated. Raises
  ValueError for a row-wise `recipe` (its GEMMs cast their weights themselves).
  """
  if recipe.rowwise:
    raise ValueError("cast_weights: Recipe(granularity='rowwise') GEMMs cast their weights "
                     "themselves (per column, and per row for the input gradient); apply the "
                     "model without a weight cast")
  params = traverse_util.flatten_dict(variables["params"])
  out = {}
  for path, meta in traverse_util.flatten_dict(variables.get(FP8_COLLECTION, {})).items():
    # path = (.. parent module, GEMM module, role); the weight is the parent's "kernel".
    kernel = params.get(path[:-2] + ("kernel",))
    if path[-1] != "kernel" or not isinstance(meta, scaling.Fp8Meta) or kernel is None:
      continue
    cast = lambda w, m: dot.cast_weight(w if dtype is None else w.astype(dtype), m, recipe)
    for _ in range(jnp.ndim(meta.scale)):  # layer axes stacked by nn.scan
      cast = jax.vmap(cast)
    for field, value in cast(kernel, meta)._asdict().items():
      out[path[:-1] + (field,)] = value
  return {WEIGHT_CAST_COLLECTION: traverse_util.unflatten_dict(out)} if out else {}


def _is_meta(x) -> bool:
  return isinstance(x, scaling.Fp8Meta)


def init_fp8_state(model: nn.Module, *args, **kwargs) -> dict:
  """The FP8 collection of `model` applied to `args` (arrays or ``jax.ShapeDtypeStruct``;
  `kwargs` go to ``model.init`` too): every FP8 GEMM's state as never observed (scale 1, amax
  history of zeros; :func:`fp8jax.scaling.init_meta`), stacked as the model stacks it. No
  parameter is initialised: the tree comes from ``jax.eval_shape`` of ``model.init``. Returns
  ``{}`` for a model without FP8 GEMMs; apply the model with ``{"params": ...,
  FP8_COLLECTION: init_fp8_state(...)}``, then :func:`calibrate_fp8`."""
  shapes = jax.eval_shape(lambda *a: model.init(jax.random.key(0), *a, **kwargs), *args)
  return jax.tree.map(
      lambda m: scaling.Fp8Meta(jnp.ones(m.scale.shape, jnp.float32),
                                jnp.zeros(m.amax_history.shape, jnp.float32)),
      dict(shapes.get(FP8_COLLECTION, {})), is_leaf=_is_meta)


def forward_amaxes(model: nn.Module, variables, *args, **kwargs) -> dict:
  """The amaxes of one forward pass ``model.apply(variables, *args, **kwargs)``: the
  ``CALIBRATION_COLLECTION`` tree, ``{..GEMM path: {"input": amax, "kernel": amax}}`` (f32,
  stacked like the FP8 state under ``nn.scan``): for "input" the amax of the operand the GEMM
  casts (after its ``lhs_activation`` / ``lhs_norm``), for "kernel" of its weight; the max
  over repeated calls of one GEMM. Forward only."""
  _, sown = model.apply(variables, *args, mutable=[CALIBRATION_COLLECTION], **kwargs)
  return dict(sown.get(CALIBRATION_COLLECTION, {}))


def record_forward_amaxes(fp8_state, amaxes, recipe: Recipe) -> dict:
  """`fp8_state` (an FP8 collection) with each GEMM's "input" and "kernel" states updated by
  the amax :func:`forward_amaxes` recorded for it, as a training step's delayed update does
  (:func:`fp8jax.scaling.update_meta` in ``recipe.fwd_format``; stacked states per layer).
  States without a recorded amax (output gradients, GEMMs that did not run) are unchanged."""
  flat = traverse_util.flatten_dict(dict(fp8_state), is_leaf=lambda _, x: _is_meta(x))
  seen = traverse_util.flatten_dict(dict(amaxes))
  out = {}
  for path, meta in flat.items():
    amax = seen.get(path)
    if amax is None or path[-1] not in _FORWARD_ROLES or not _is_meta(meta):
      out[path] = meta
      continue
    update = lambda m, a: scaling.update_meta(m, a, recipe, recipe.fwd_format)  # noqa: E731
    for _ in range(jnp.ndim(meta.scale)):  # layer axes stacked by nn.scan
      update = jax.vmap(update)
    out[path] = update(meta, jnp.asarray(amax, jnp.float32))
  return traverse_util.unflatten_dict(out)


def calibrate_fp8(model: nn.Module, variables, batches, *, recipe: Recipe | None = None,
                  **kwargs) -> dict:
  """`variables` with the forward FP8 states of `model` ("input" and "kernel" of every FP8
  GEMM) calibrated on `batches`: one jitted forward pass ``model.apply(variables, batch,
  **kwargs)`` per batch whose amaxes (:func:`forward_amaxes`) are recorded into the amax
  histories as a training step would (:func:`record_forward_amaxes`), so the scales cover
  every batch seen (``amax_compute_algo="max"``). Only forward passes run, no gradient;
  output-gradient states stay as they are (never observed after :func:`init_fp8_state`).

  Args:
    model: a linen module whose FP8 GEMMs are :class:`Fp8DotGeneral` / :class:`Fp8EinsumOp`
      (under ``nn.scan``, ``CALIBRATION_COLLECTION`` in ``variable_axes``).
    variables: ``{"params": ..., FP8_COLLECTION: ...}`` (e.g. from :func:`init_fp8_state`).
    batches: an iterable of model inputs (e.g. int32[B, T] tokens), at least one.
    recipe: the recipe of the scale updates (default: ``model.recipe``).
  Returns the variables with the updated FP8 collection (params untouched).
  Raises ValueError: no FP8 state, no recipe, no batch.
  """
  if not variables.get(FP8_COLLECTION):
    raise ValueError(f"calibrate_fp8: the variables hold no '{FP8_COLLECTION}' state (make "
                     "it with init_fp8_state(model, ...))")
  recipe = recipe if recipe is not None else getattr(model, "recipe", None)
  if not isinstance(recipe, Recipe):
    raise ValueError(f"calibrate_fp8: no recipe (model.recipe is {recipe!r}); pass recipe=")
  amaxes_of = jax.jit(lambda v, batch: forward_amaxes(model, v, batch, **kwargs))
  record = jax.jit(lambda state, amaxes: record_forward_amaxes(state, amaxes, recipe))
  state, count = variables[FP8_COLLECTION], 0
  for batch in batches:
    state = record(state, amaxes_of({**variables, FP8_COLLECTION: state}, batch))
    count += 1
  if count == 0:
    raise ValueError("calibrate_fp8: no batch to calibrate on; pass at least one")
  return {**variables, FP8_COLLECTION: state}
