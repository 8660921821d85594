"""fp8jax.optim's optax contract: complex params refused with a one-line error (and the
optax.partition route for them), every numeric hyperparameter traceable under
``optax.inject_hyperparams`` inside ``jax.jit`` with the plain call's updates, and a state
whose structure and dtypes do not change across steps (one trace of a jitted update).

Injected vs plain: ``inject_hyperparams`` stores the hyperparameters as f32, so the plain
call gets the same f32 values (``float(np.float32(x))``); with b1, b2 in [0.5, 1) the two
programs compute the same numbers (measured: bit-identical updates and state over 20 seeds x
12 steps, with and without the test suite's fast CPU code generation). The bounds allow f32
rounding differences of a constant vs a runtime scalar (1e-6 relative) and a rare flipped
FP8 rounding, not a different hyperparameter.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fp8jax.optim as fo

STEPS = 6  # past the step where the first moment's scale reaches its cap (moments.u_cap)
# Non-default values of every numeric hyperparameter of adamw, exactly representable in f32.
HYPER = dict(learning_rate=3e-3, b1=0.85, b2=0.97, eps=1e-6, eps_root=1e-12, weight_decay=0.05)


def _f32(x: float) -> float:
  return float(np.float32(x))


def _params(key):
  k1, k2, k3 = jax.random.split(key, 3)
  return {"dense": {"kernel": jax.random.normal(k1, (32, 48)),
                    "bias": 0.1 * jax.random.normal(k2, (48,))},
          "scale": 1.0 + 0.1 * jax.random.normal(k3, ())}


def _grads(key, params, steps):
  """`steps` fresh gradient trees; leaves at different magnitudes (1e-3 .. 10)."""
  leaves, treedef = jax.tree.flatten(params)
  out = []
  for t in range(steps):
    ks = jax.random.split(jax.random.fold_in(key, t), len(leaves))
    out.append(jax.tree.unflatten(treedef, [
        10.0 ** (i - 2) * jax.random.normal(k, p.shape) for i, (k, p) in enumerate(zip(ks, leaves))]))
  return out


def _run(tx, params, grads, state=None):
  """Updates of every step (jitted update, params fixed) and the final state."""
  update = jax.jit(tx.update)
  state = tx.init(params) if state is None else state
  out = []
  for g in grads:
    u, state = update(g, state, params)
    out.append(u)
  return out, state


def _assert_updates_close(a, b, rtol=1e-6):
  """Per step and leaf: elementwise within rtol of the reference leaf's largest value."""
  for ua, ub in zip(a, b):
    for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub)):
      y = np.asarray(y, np.float64)
      np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=rtol,
                                 atol=rtol * np.abs(y).max())


def _assert_same_state(a, b):
  """Two ScaleByAdamStates: same count, scales within 1e-6, payloads equal but for rare
  rounding flips (<= 1e-3 of the elements)."""
  assert int(a.count) == int(b.count)
  leaves = lambda s: jax.tree.leaves((s.mu, s.nu), is_leaf=fo.is_scaled)
  for x, y in zip(leaves(a), leaves(b)):
    assert x.data.dtype == y.data.dtype
    np.testing.assert_allclose(np.asarray(x.scale), np.asarray(y.scale), rtol=1e-6)
    assert np.mean(np.asarray(x.data, np.float32) != np.asarray(y.data, np.float32)) <= 1e-3


def _fp8_state(state):
  """The ScaleByAdamState inside an adam/adamw state (wrapped by inject_hyperparams or not)."""
  inner = state.inner_state if hasattr(state, "inner_state") else state
  return inner[0]


# --- complex params ---------------------------------------------------------------------

@pytest.mark.parametrize("make", [lambda: fo.adamw(1e-3), lambda: fo.adam(1e-3),
                                  lambda: fo.scale_by_adam()], ids=["adamw", "adam", "scale"])
def test_complex_params_refused_at_init_naming_leaf_and_dtype(make):
  params = {"real": jnp.ones((3,)), "block": {"w": jnp.ones((2, 2), jnp.complex64)}}
  with pytest.raises(ValueError, match=r"parameter \['block'\]\['w'\] is complex64; .*"
                                       r"optax\.partition") as info:
    make().init(params)
  assert "\n" not in str(info.value)


def test_complex_gradients_and_master_weights_refused():
  params = {"w": jnp.ones((3,))}
  tx = fo.adamw(1e-3)
  state = tx.init(params)
  with pytest.raises(ValueError, match=r"gradient \['w'\] is complex64"):
    tx.update({"w": jnp.ones((3,), jnp.complex64)}, state, params)
  with pytest.raises(ValueError, match=r"init_master: parameter \['z'\] is complex128"):
    fo.init_master({"w": np.ones(3, np.float32), "z": np.ones(3, np.complex128)})


def test_partition_route_trains_complex_leaves_with_plain_optax(key):
  """The documented route: optax.partition gives complex leaves optax.adamw and the rest
  fo.adamw; each part's updates equal those of its optimizer run on that part alone."""
  kp, kz, kg = jax.random.split(key, 3)
  real = {"w": jax.random.normal(kp, (8, 16))}
  z = jax.lax.complex(jax.random.normal(kz, (8,)), jax.random.normal(jax.random.fold_in(kz, 1), (8,)))
  params = {"real": real, "z": z}
  labels = jax.tree.map(lambda p: "complex" if jnp.iscomplexobj(p) else "fp8", params)
  tx = optax.partition({"fp8": fo.adamw(1e-2), "complex": optax.adamw(1e-2)}, labels)
  real_grads = _grads(kg, real, 2)
  zgrads = [1j * z * (t + 1) + 0.5 * z for t in range(2)]
  grads = [{"real": g, "z": zg} for g, zg in zip(real_grads, zgrads)]
  got, _ = _run(tx, params, grads)
  want_real, _ = _run(fo.adamw(1e-2), real, real_grads)
  want_z, _ = _run(optax.adamw(1e-2), z, zgrads)
  for g, wr, wz in zip(got, want_real, want_z):
    assert np.abs(np.imag(np.asarray(g["z"]))).max() > 1e-3  # the imaginary part is trained
    np.testing.assert_allclose(np.asarray(g["z"]), np.asarray(wz), rtol=1e-6)
    _assert_updates_close([g["real"]], [wr], rtol=1e-6)


# --- traced hyperparameters ---------------------------------------------------------------

@pytest.mark.parametrize("factory,extra,names", [
    (fo.adamw, {}, ("learning_rate", "b1", "b2", "eps", "eps_root", "weight_decay")),
    (fo.adam, {"nesterov": True}, ("learning_rate", "b1", "b2", "eps", "eps_root")),
], ids=["adamw", "adam-nesterov"])
def test_injected_hyperparams_match_plain_call_under_jit(key, factory, extra, names):
  """inject_hyperparams(factory) with every numeric hyperparameter set (traced inside the
  jitted update) gives the plain call's updates and stored state at the same f32 values;
  the update is traced once for all steps."""
  kp, kg = jax.random.split(key)
  params = _params(kp)
  grads = _grads(kg, params, STEPS)
  hyper = {k: HYPER[k] for k in names}
  injected = optax.inject_hyperparams(factory)(**hyper, **extra)
  state = injected.init(params)
  assert sorted(state.hyperparams) == sorted(names)  # dtypes are not hyperparameters
  assert all(v.dtype == jnp.float32 for v in state.hyperparams.values())
  traces = []

  def update(g, s, p):
    traces.append(1)
    return injected.update(g, s, p)
  got, got_state = _run(optax.GradientTransformation(injected.init, update), params, grads)
  want, want_state = _run(factory(**{k: _f32(v) for k, v in hyper.items()}, **extra), params,
                          grads)
  assert len(traces) == 1
  _assert_updates_close(got, want)
  a, b = _fp8_state(got_state), _fp8_state(want_state)
  assert int(a.count) == STEPS
  _assert_same_state(a, b)
  assert a.mu["dense"]["kernel"].data.dtype == jnp.float8_e4m3fn
  assert a.nu["dense"]["kernel"].data.dtype == jnp.float16


@pytest.mark.parametrize("name,value", [("b1", 0.5), ("b2", 0.9), ("eps", 1e-2),
                                        ("learning_rate", 1e-4), ("weight_decay", 0.5)])
def test_changing_an_injected_hyperparameter_changes_the_update(key, name, value):
  """A hyperparameter replaced in the injected state (no re-trace) takes effect: the updates
  follow the plain call with the new value and differ from those with the old one."""
  kp, kg = jax.random.split(key)
  params = _params(kp)
  grads = _grads(kg, params, 3)
  base = dict(learning_rate=1e-2, b1=0.875, b2=0.96875, eps=1e-6, weight_decay=0.125)
  injected = optax.inject_hyperparams(fo.adamw)(**base)
  state = injected.init(params)
  state.hyperparams[name] = jnp.asarray(value, jnp.float32)
  got, _ = _run(injected, params, grads, state)
  want, _ = _run(fo.adamw(**dict(base, **{name: _f32(value)})), params, grads)
  old, _ = _run(fo.adamw(**base), params, grads)
  _assert_updates_close(got, want)
  flat = lambda us: np.concatenate([np.ravel(x) for u in us for x in jax.tree.leaves(u)])
  assert np.linalg.norm(flat(got) - flat(old)) > 1e-2 * np.linalg.norm(flat(old))


def test_injected_defaults_match_plain_defaults_with_f32_state(key):
  """Python defaults (0.9, 0.999, 1e-8) vs their f32 values in the injected state, with f32
  moments: only 1 - b2 differs (f32(1e-3) vs 1 - f32(0.999), 1.3e-5 apart)."""
  kp, kg = jax.random.split(key)
  params = _params(kp)
  grads = _grads(kg, params, 3)
  got, _ = _run(optax.inject_hyperparams(fo.adamw)(learning_rate=1e-3, mu_dtype=None,
                                                   nu_dtype=None), params, grads)
  want, _ = _run(fo.adamw(1e-3, mu_dtype=None, nu_dtype=None), params, grads)
  _assert_updates_close(got, want, rtol=3e-5)


def test_dtype_arguments_under_inject_hyperparams():
  """A dtype given as a scalar type is callable, which inject_hyperparams takes for a
  schedule: a clear error says to name it in static_args, where it works."""
  params = {"w": jnp.ones((4,))}
  with pytest.raises(ValueError, match="mu_dtype is an array .* static_args"):
    optax.inject_hyperparams(fo.adamw)(1e-3, mu_dtype=jnp.bfloat16).init(params)
  tx = optax.inject_hyperparams(fo.adamw, static_args=("mu_dtype",))(1e-3, mu_dtype=jnp.bfloat16)
  state = tx.init(params)
  assert state.inner_state[0].mu["w"].data.dtype == jnp.bfloat16
  assert "mu_dtype" not in state.hyperparams


def test_narrow_hyperparam_dtype_is_refused_with_a_hint():
  """With bf16 params inject_hyperparams stores b2 = 0.999 as bf16 1.0: refused, naming
  hyperparam_dtype; with hyperparam_dtype=float32 it works."""
  params = {"w": jnp.ones((4,), jnp.bfloat16)}
  with pytest.raises(ValueError, match=r"b2=1\.0 is not allowed.*bfloat16.*hyperparam_dtype"):
    optax.inject_hyperparams(fo.adamw)(1e-3).init(params)
  tx = optax.inject_hyperparams(fo.adamw, hyperparam_dtype=jnp.float32)(1e-3)
  assert tx.init(params).hyperparams["b2"].dtype == jnp.float32
  with pytest.raises(ValueError, match=r"b1=1\.5 is not allowed"):
    optax.inject_hyperparams(fo.adam)(1e-3, b1=1.5).init({"w": jnp.ones(2)})


# --- state stability ------------------------------------------------------------------------

@pytest.mark.parametrize("inject", [False, True], ids=["plain", "injected"])
def test_state_types_stable_across_steps_one_trace(key, inject):
  """Plain and FP8 (ScaledArray) gradients and a skipped (non-finite) step: the state's
  structure, shapes, dtypes and weak types never change, so a jitted update traces once."""
  kp, kg = jax.random.split(key)
  params = _params(kp)
  tx = optax.inject_hyperparams(fo.adamw)(learning_rate=1e-3) if inject else fo.adamw(1e-3)
  traces = []

  @jax.jit
  def update(g, s, p):
    traces.append(1)
    return tx.update(g, s, p)

  state = tx.init(params)
  types = lambda s: (jax.tree.structure(s), [jax.typeof(x) for x in jax.tree.leaves(s)])
  first = types(state)
  grads = _grads(kg, params, 3)
  grads[1] = jax.tree.map(lambda x: x.at[..., 0].set(jnp.inf) if x.ndim else x, grads[1])
  for g in grads:
    _, state = update(g, state, params)
    assert types(state) == first
  assert len(traces) == 1
  count = _fp8_state(state).count
  assert int(count) == 2  # the non-finite step was skipped
  fp8 = [fo.quantize_updates(g) for g in _grads(jax.random.fold_in(kg, 7), params, 2)]
  for g in fp8:
    _, state = update(g, state, params)
    assert types(state) == first
  assert len(traces) == 2  # one more trace for the ScaledArray gradient tree, not per step
