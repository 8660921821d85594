"""fp8jax.optim on CPU: FP8/FP16-state Adam(W) vs optax, FP16 master weights, FP8 gradients,
edge cases, optax composition, donation and sharding (8 CPU devices, see conftest.py).

Update error = ||u - u_optax|| / ||u_optax|| per step against optax with f32 state on the same
fresh gradients, max over the steps. E4M3 storage of the first moment costs ~5.5% (3 mantissa
bits, accumulated over ~1/(1-b1^2) steps); the bound is 10%.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax.optim as fo
from fp8jax.optim import ScaledArray
from conftest import rel_err

E4M3, E5M2, F16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float16
SHAPE = (128, 128)


def _flat(tree):
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])


def _assert_same_stored(a: ScaledArray, b: ScaledArray):
  """Two stored tensors from differently compiled programs (sharded vs not): same scale to
  f32 rounding, payloads equal except for rare rounding-boundary flips of one code, which
  an f32 result differing in its last bit (op fusion) can cause."""
  assert float(a.scale) == pytest.approx(float(b.scale), rel=1e-6)
  x, y = np.asarray(a.data, np.float32), np.asarray(b.data, np.float32)
  assert np.mean(x != y) <= 1e-3
  assert rel_err(x, y.astype(np.float64)) < 1e-3


def _step_errors(updates, ref):
  """rel_err per step of two update trees with a leading step axis."""
  per_step = lambda tree: np.concatenate(
      [np.asarray(x, np.float64).reshape(x.shape[0], -1) for x in jax.tree.leaves(tree)], axis=1)
  u, r = per_step(updates), per_step(ref)
  return np.array([rel_err(u[t], r[t]) for t in range(u.shape[0])])


def _gradient_stream(key, params, steps, dist="gauss", top=1.0):
  """`steps` fresh gradients per leaf (leading axis); with "elem8"/"row8" the magnitudes of
  the largest leaf span 8 decades (top*1e-8 .. top) per element / per row, fixed over steps
  (like rare vs frequent embedding rows) while the values are fresh every step."""
  leaves, treedef = jax.tree.flatten(params)
  big = max(range(len(leaves)), key=lambda i: leaves[i].size)
  out = []
  for i, p in enumerate(leaves):
    key, kv, km = jax.random.split(key, 3)
    g = jax.random.normal(kv, (steps,) + p.shape)
    if i == big and dist != "gauss":
      mshape = p.shape if dist == "elem8" else p.shape[:1] + (1,) * (p.ndim - 1)
      g = g * top * 10.0 ** jax.random.uniform(km, mshape, minval=-8.0, maxval=0.0)
    out.append(g)
  return jax.tree.unflatten(treedef, out)


def _params(key, names=("w", "b", "s")):
  k1, k2 = jax.random.split(key)
  p = {"w": jax.random.normal(k1, SHAPE) * 0.1, "b": jax.random.normal(k2, (SHAPE[1],)),
       "s": jnp.float32(0.5)}
  return {n: p[n] for n in names}


def _run(tx, params, grads):
  """Updates of `tx` for each step of `grads` (leading axis), one lax.scan under jit."""
  def step(state, g):
    u, state = tx.update(g, state, params)
    return state, u
  return jax.jit(lambda gs: jax.lax.scan(step, tx.init(params), gs))(grads)


def _msamp_adamw(learning_rate, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4):
  """A direct port of MS-AMP's O2 Adam state (the baseline of issue 4): m in E4M3 and v in
  FP16, each with one just-in-time scale per tensor (amax -> payload max)."""
  def init(params):
    z = lambda dt: jax.tree.map(lambda p: fo.quantize_scaled(jnp.zeros_like(p), dt), params)
    return jnp.zeros((), jnp.int32), z(E4M3), z(F16)

  def update(grads, state, params):
    count, mus, nus = state
    count = count + 1
    bc1, bc2 = 1 - b1 ** count.astype(jnp.float32), 1 - b2 ** count.astype(jnp.float32)
    gs, treedef = jax.tree.flatten(grads)
    out = []
    for g, mu, nu, p in zip(gs, treedef.flatten_up_to(mus), treedef.flatten_up_to(nus),
                            treedef.flatten_up_to(params)):
      m = b1 * fo.dequantize_scaled(mu) + (1 - b1) * g
      v = b2 * fo.dequantize_scaled(nu) + (1 - b2) * g * g
      u = -learning_rate * (m / bc1 / (jnp.sqrt(v / bc2) + eps) + weight_decay * p)
      out.append((u, fo.quantize_scaled(m, E4M3), fo.quantize_scaled(v, F16)))
    un = lambda i: jax.tree.unflatten(treedef, [o[i] for o in out])
    return un(0), (count, un(1), un(2))

  return optax.GradientTransformation(init, update)


# ---------------------------------------------------------------------------------------------
# Scaled arrays

@pytest.mark.parametrize("dtype,lo,hi", [(E4M3, 0.01, 0.06), (F16, 1e-4, 5e-4)])
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 1e30])
def test_scaled_roundtrip_neither_saturates_nor_underflows(key, dtype, lo, hi, magnitude):
  x = jax.random.normal(key, (4096,)) * magnitude
  q = fo.quantize_scaled(x, dtype)
  assert q.data.dtype == dtype and q.scale.dtype == jnp.float32 and q.scale.shape == ()
  fmax = float(jnp.finfo(dtype).max)
  payload = np.abs(np.asarray(q.data, np.float32))
  assert payload.max() == pytest.approx(fmax, rel=0.07)  # the amax uses the whole range
  assert np.mean(payload == 0) < 1e-3  # nothing flushed
  err = rel_err(fo.dequantize_scaled(q), np.asarray(x, np.float64))
  assert lo < err < hi
  q2 = fo.quantize_scaled(x, dtype, margin=2)  # headroom: amax -> fmax / 4
  assert np.abs(np.asarray(q2.data, np.float32)).max() == pytest.approx(fmax / 4, rel=0.07)


def test_scaled_zero_and_nonfinite_tensors(key):
  z = fo.quantize_scaled(jnp.zeros((16,)), E4M3)
  assert float(z.scale) == 0.0 and np.all(np.asarray(fo.dequantize_scaled(z)) == 0)
  x = jax.random.normal(key, (16,)).at[3].set(jnp.nan)
  assert np.isnan(np.asarray(fo.dequantize_scaled(fo.quantize_scaled(x, E4M3)))).any()
  with pytest.raises(ValueError, match="dtype=.*int8.*not allowed"):
    fo.quantize_scaled(x, jnp.int8)


# ---------------------------------------------------------------------------------------------
# Adam / AdamW: math, dtypes, bytes

@pytest.mark.parametrize("nesterov,eps_root", [(False, 0.0), (True, 1e-10)])
def test_f32_storage_reproduces_optax(key, nesterov, eps_root):
  """Same math as optax.scale_by_adam: with f32 storage the updates agree to f32 rounding,
  so all the error of the default state is storage error."""
  params = _params(key)
  grads = _gradient_stream(jax.random.fold_in(key, 1), params, 12)
  kw = dict(eps_root=eps_root, nesterov=nesterov)
  _, ours = _run(fo.scale_by_adam(mu_dtype=jnp.float32, nu_dtype=jnp.float32, **kw), params, grads)
  _, ref = _run(optax.scale_by_adam(**kw), params, grads)
  assert _step_errors(ours, ref).max() < 1e-5


def test_state_is_stored_in_e4m3_and_fp16(key):
  params = _params(key)
  tx = fo.adamw(1e-3)
  state, _ = _run(tx, params, _gradient_stream(key, params, 3))
  adam_state = state[0]
  assert isinstance(adam_state, fo.ScaleByAdamState) and adam_state.count.dtype == jnp.int32
  for mu, nu in zip(jax.tree.leaves(adam_state.mu, is_leaf=fo.is_scaled),
                    jax.tree.leaves(adam_state.nu, is_leaf=fo.is_scaled)):
    assert mu.data.dtype == E4M3 and nu.data.dtype == F16
    assert mu.scale.dtype == nu.scale.dtype == jnp.float32 and mu.scale.shape == ()
    assert np.asarray(nu.data, np.float32).min() >= 0 and np.count_nonzero(np.asarray(mu.data, np.float32))
  other = fo.scale_by_adam(mu_dtype=E5M2, nu_dtype=jnp.bfloat16).init(params)
  assert other.mu["w"].data.dtype == E5M2 and other.nu["w"].data.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="mu_dtype=.*int8.*not allowed"):
    fo.adamw(1e-3, mu_dtype=jnp.int8)
  with pytest.raises(ValueError, match="b2=1.0 is not allowed"):
    fo.adam(1e-3, b2=1.0)


def _model_params():
  """Shapes of a small decoder-like model (~2.5M params, 10 tensors incl. a scalar)."""
  s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  return {"embed": s(8192, 128), "ln": s(128), "attn": {"qkv": s(128, 384), "out": s(128, 128)},
          "mlp": {"up": s(128, 512), "up_b": s(512), "down": s(512, 128), "down_b": s(128)},
          "head": s(128, 8192), "temperature": s()}


def test_bytes_per_parameter_optimizer_3_training_state_6():
  params = _model_params()
  n, n_tensors = fo.num_params(params), len(jax.tree.leaves(params))
  opt_state = jax.eval_shape(fo.adamw(1e-3).init, params)
  master = jax.eval_shape(fo.init_master, params)
  fp8_grads = jax.eval_shape(fo.quantize_updates, params)
  opt, m, g = fo.tree_bytes(opt_state), fo.tree_bytes(master), fo.tree_bytes(fp8_grads)
  # Every byte counted: payloads, f32 scales (per tensor) and int32 counters.
  assert opt == 3 * n + 2 * 4 * n_tensors + 4       # mu 1 + nu 2 per element
  assert m == 2 * n + 2 * 4 * n_tensors + 2 * 4     # FP16 master (+ scale, amax per tensor; counts)
  assert g == 1 * n + 4 * n_tensors                 # FP8 gradient
  print(f"bytes/param: optimizer {opt / n:.5f}, O2 training state {(opt + m + g) / n:.5f}")
  assert opt / n <= 3.0001 and (opt + m + g) / n <= 6.0002
  ref = fo.tree_bytes(jax.eval_shape(optax.adamw(1e-3).init, params))
  assert ref / n >= 8  # optax.adamw keeps 8 bytes of f32 state per parameter


# ---------------------------------------------------------------------------------------------
# Update error vs optax.adamw on fresh random gradients

CASES = [("gauss", 1.0), ("elem8", 1.0), ("elem8", 1e-2), ("row8", 1.0)]


def _run_cases(tx, params, streams):
  """_run over a leading axis of gradient streams (one compilation for all cases)."""
  return jax.jit(jax.vmap(lambda gs: _run(tx, params, gs)))(streams)


def test_update_error_vs_optax_adamw_below_10_percent(key):
  """Fresh gradients, 40 steps; per case gaussian, 8 decades of magnitude per element (top
  1 and 1e-2) and per row. Ours < 10% everywhere; MS-AMP's state far above on 8 decades."""
  params = _params(key)
  streams = [_gradient_stream(jax.random.fold_in(key, i), params, 40, d, t)
             for i, (d, t) in enumerate(CASES)]
  streams = jax.tree.map(lambda *x: jnp.stack(x), *streams)
  _, ref = _run_cases(optax.adamw(1e-3), params, streams)
  states, ours = _run_cases(fo.adamw(1e-3), params, streams)
  _, naive = _run_cases(_msamp_adamw(1e-3), params, streams)
  case = lambda tree, i: jax.tree.map(lambda x: x[i], tree)
  for i, (dist, top) in enumerate(CASES):
    err = _step_errors(case(ours, i), case(ref, i))
    naive_err = _step_errors(case(naive, i), case(ref, i)).max()
    print(f"{dist} top={top:g}: fp8jax max {err.max():.4f} (last {err[-1]:.4f}), "
          f"MS-AMP port {naive_err:.4f}")
    assert 0.01 < err.max() < 0.10  # FP8 storage really happened, and stays bounded
    if dist != "gauss":
      assert naive_err > 0.25  # the test can fail: the baseline design does
    m, v = fo.adam_moments(case(states, i)[0])
    assert np.all(np.asarray(m["w"])[np.asarray(v["w"]) == 0] == 0)


# Storage layouts explored for issue 4 (docs/optim.md), simulated in numpy (ml_dtypes FP8 /
# FP16 casts): after every step of an f32 Adam, (m, v) are replaced by their storage round
# trip; the update uses the f32 moments of the step, as fp8jax does.
def _rt(x, dtype, axis=None):
  """Quantize-dequantize with a just-in-time scale (amax -> payload max) per tensor or per
  row (`axis=-1`)."""
  fmax = float(jnp.finfo(dtype).max)
  amax = np.max(np.abs(x), axis=axis, keepdims=axis is not None)
  scale = np.where(amax > 0, np.maximum(amax / fmax, np.finfo(np.float32).tiny), 1.0)
  q = np.clip(x / scale, -fmax, fmax).astype(dtype)
  return (q.astype(np.float32) * scale).astype(np.float32)


def _rt_blocks(x, dtype, block=128):
  return _rt(x.reshape(-1, block), dtype, axis=-1).reshape(x.shape)


def _normalised(m, v):
  r = _rt(np.sqrt(v), F16)
  return _rt(np.where(r > 0, m / np.where(r > 0, r, 1), 0), E4M3) * r, r * r


LAYOUTS = {  # name: (roundtrip of (m, v), bytes per element incl. f32 scales of m and v)
    "m E4M3, v FP16 (MS-AMP)": (lambda m, v: (_rt(m, E4M3), _rt(v, F16)), 3),
    "m E4M3, sqrt(v) FP16": (lambda m, v: (_rt(m, E4M3), _rt(np.sqrt(v), F16) ** 2), 3),
    "block-128: m E4M3, v FP16": (lambda m, v: (_rt_blocks(m, E4M3), _rt_blocks(v, F16)),
                                  3 + 8 / 128),
    "block-128: m E4M3, sqrt(v) FP16": (
        lambda m, v: (_rt_blocks(m, E4M3), _rt_blocks(np.sqrt(v), F16) ** 2), 3 + 8 / 128),
    "m/sqrt(v) E4M3, sqrt(v) FP16, amax scales": (_normalised, 3),
}


def _simulated_adam(roundtrip, grads, b1=0.9, b2=0.999, eps=1e-8):
  m = v = np.zeros(grads.shape[1:], np.float32)
  out = []
  for t, g in enumerate(grads, 1):
    m, v = (b1 * m + (1 - b1) * g).astype(np.float32), (b2 * v + (1 - b2) * g * g).astype(np.float32)
    out.append(m / (1 - b1 ** t) / (np.sqrt(v / (1 - b2 ** t)) + eps))
    m, v = roundtrip(m, v)
  return np.stack(out)


def test_storage_layouts_measured(key):
  """The table of docs/optim.md: max per-step update error of each layout vs f32 Adam over
  30 steps of fresh gradients (per case as in the test above)."""
  streams = np.stack([np.asarray(_gradient_stream(jax.random.fold_in(key, i), {"w": jnp.zeros(SHAPE)},
                                                  30, d, t)["w"]) for i, (d, t) in enumerate(CASES)])
  ref = [_simulated_adam(lambda m, v: (m, v), s) for s in streams]
  errors = lambda us: [_step_errors(u, r).max() for u, r in zip(us, ref)]
  table = {name: (errors([_simulated_adam(rt, s) for s in streams]), nbytes)
           for name, (rt, nbytes) in LAYOUTS.items()}
  tx = fo.scale_by_adam()
  ours = jax.jit(jax.vmap(lambda gs: _run(tx, {"w": gs[0]}, {"w": gs})[1]["w"]))(streams)
  chosen_name = "fp8jax: m/sqrt(v) E4M3, sqrt(v) FP16, bound scales"
  table[chosen_name] = (errors(np.asarray(ours)), 3)
  print("\n| layout | bytes/param | " + " | ".join(f"{d} top={t:g}" for d, t in CASES) + " |")
  for name, (errs, nbytes) in table.items():
    print(f"| {name} | {nbytes:.3f} | " + " | ".join(f"{e:.1%}" for e in errs) + " |")
  chosen = table[chosen_name][0]
  assert max(chosen) < 0.10
  for name, (errs, nbytes) in table.items():
    if name.startswith("m/sqrt") or name == chosen_name:
      continue
    assert max(errs) > 0.25, name  # every unnormalised layout fails some case
    assert all(c < e + 0.01 for c, e in zip(chosen, errs)), name  # and never wins by > 1%


def test_second_moment_never_zero_where_first_is_not(key):
  """Gradients spanning 16 decades in one tensor, beyond FP16's range: elements whose root
  second moment flushes have a first moment of exactly zero, and no update explodes."""
  params = {"w": jnp.zeros(SHAPE)}
  k1, k2 = jax.random.split(key)
  mag = 10.0 ** jax.random.uniform(k2, SHAPE, minval=-16.0, maxval=0.0)
  grads = {"w": jax.random.normal(k1, (10,) + SHAPE) * mag}
  state, ours = _run(fo.scale_by_adam(), params, grads)
  _, ref = _run(optax.scale_by_adam(), params, grads)
  m, v = fo.adam_moments(state)
  m, v = np.asarray(m["w"]), np.asarray(v["w"])
  assert np.mean(v == 0) > 0.05  # the test reaches flushed second moments
  assert np.all(m[v == 0] == 0)
  assert np.all(np.isfinite(np.asarray(ours["w"])))
  assert np.abs(np.asarray(ours["w"])).max() <= 1.05 * np.abs(np.asarray(ref["w"])).max()


# ---------------------------------------------------------------------------------------------
# Edge cases

def _adam64(grads, b1=0.9, b2=0.999, eps=1e-8):
  """Float64 Adam updates (numpy) for a list of gradient arrays."""
  m = v = 0.0
  out = []
  for t, g in enumerate(grads, 1):
    g = np.asarray(g, np.float64)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    out.append(m / (1 - b1 ** t) / (np.sqrt(v / (1 - b2 ** t)) + eps))
  return out


@pytest.mark.parametrize("magnitude", [1e-30, 1e30])
def test_subnormal_scale_and_huge_gradients(key, magnitude):
  """1e-30 and 1e30 gradients: finite state, updates equal float64 Adam within 10% (optax
  itself overflows g*g at 1e30 and returns zero updates there)."""
  grads = jax.random.normal(key, (5,) + SHAPE) * magnitude
  state, ours = _run(fo.scale_by_adam(), {"w": jnp.zeros(SHAPE)}, {"w": grads})
  ref = _adam64(list(grads))
  for t in range(5):
    assert rel_err(ours["w"][t], ref[t]) < 0.10
  assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(state))
  assert float(state.nu["w"].scale) > 0 and np.count_nonzero(np.asarray(state.nu["w"].data))


def test_zero_gradients_then_real_ones(key):
  params = _params(key, ("w", "b"))
  zeros = jax.tree.map(lambda p: jnp.zeros((4,) + p.shape), params)
  grads = jax.tree.map(lambda z, g: jnp.concatenate([z, g]), zeros,
                       _gradient_stream(key, params, 20))
  state, ours = _run(fo.scale_by_adam(), params, grads)
  _, ref = _run(optax.scale_by_adam(), params, grads)
  assert all(np.all(np.asarray(x)[:4] == 0) for x in jax.tree.leaves(ours))
  assert _step_errors(jax.tree.map(lambda x: x[4:], ours), jax.tree.map(lambda x: x[4:], ref)).max() < 0.10
  assert int(state.count) == 24


def test_non_finite_gradients_skip_the_step(key):
  """A step with any inf/NaN gradient (one element of one leaf, or an FP8 gradient with a NaN
  scale) returns zero updates and leaves the whole state unchanged, schedule count included;
  the next finite step is bit-identical to one taken as if the bad step never happened."""
  params = _params(key)
  tx = fo.adamw(optax.linear_schedule(1e-3, 1e-4, 10), weight_decay=0.1)
  gs = [jax.tree.map(lambda x: x[t], _gradient_stream(key, params, 3)) for t in range(3)]
  update = jax.jit(tx.update)
  _, state = update(gs[0], tx.init(params), params)
  u_skip, _ = update(gs[2], state, params)
  assert np.isfinite(_flat(u_skip)).all()
  fp8_nan_scale = fo.quantize_updates(gs[1])
  fp8_nan_scale["b"] = ScaledArray(fp8_nan_scale["b"].data, jnp.float32(jnp.nan))
  bads = [{**gs[1], "w": gs[1]["w"].at[5, 7].set(bad)} for bad in (np.nan, np.inf, -np.inf)]
  for bad_g in bads + [{**gs[1], "s": jnp.float32(np.nan)}]:
    u_bad, state_after = update(bad_g, state, params)
    assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(u_bad))
    for a, b in zip(jax.tree.leaves(state_after), jax.tree.leaves(state)):
      assert a.dtype == b.dtype and np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    u_next, _ = update(gs[2], state_after, params)
    assert np.array_equal(_flat(u_next), _flat(u_skip))
  u_bad, state_after = jax.jit(tx.update)(fp8_nan_scale, state, params)
  assert all(np.all(np.asarray(u) == 0) for u in jax.tree.leaves(u_bad))
  assert all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
             for a, b in zip(jax.tree.leaves(state_after), jax.tree.leaves(state)))


def test_empty_pytrees_and_scalar_params(key):
  tx = fo.adamw(1e-3)
  for empty in ({}, [], (), {"a": {}, "b": []}):
    state = tx.init(empty)
    updates, _ = tx.update(empty, state, empty)
    assert jax.tree.leaves(updates) == []
  params = {"scalar": jnp.float32(1.5), "one": jnp.ones((1,)), "none": jnp.zeros((0, 3))}
  grads = jax.tree.map(lambda p: jax.random.normal(key, (6,) + p.shape), params)
  _, ours = _run(fo.adamw(1e-3), params, grads)
  _, ref = _run(optax.adamw(1e-3), params, grads)
  assert ours["scalar"].shape == (6,) and ours["none"].shape == (6, 0, 3)
  # Two elements: no norm to average over, so the bound is on each update, in units of lr.
  assert np.abs(_flat(ours) - _flat(ref)).max() < 0.1 * 1e-3


# ---------------------------------------------------------------------------------------------
# Composition with optax, FP8 gradients, jit with donation

def _chains():
  sched = optax.warmup_cosine_decay_schedule(1e-5, 1e-3, 5, 30, 1e-4)
  mask = lambda p: {"w": True, "b": False, "s": False}
  return {
      "clip_by_global_norm": lambda adamw: optax.chain(optax.clip_by_global_norm(1.0), adamw(1e-3)),
      "MultiSteps": lambda adamw: optax.MultiSteps(adamw(1e-3), every_k_schedule=3),
      "masked": lambda adamw: optax.masked(adamw(1e-3), mask),
      "schedules": lambda adamw: adamw(sched, weight_decay=optax.linear_schedule(0.1, 0.0, 30),
                                       mask=mask),
  }


@pytest.mark.parametrize("name", list(_chains()))
def test_chains_with_optax(key, name):
  build = _chains()[name]
  params = _params(key)
  grads = _gradient_stream(jax.random.fold_in(key, 1), params, 30, "elem8")
  _, ours = _run(build(fo.adamw), params, grads)
  _, ref = _run(build(optax.adamw), params, grads)
  steps = np.arange(30) if name != "MultiSteps" else np.arange(2, 30, 3)
  pick = lambda tree: jax.tree.map(lambda x: x[steps], tree)
  assert _step_errors(pick(ours), pick(ref)).max() < 0.10
  if name == "MultiSteps":  # in-between steps are exactly zero in both
    assert np.all(_flat(jax.tree.map(lambda x: x[np.arange(0, 30, 3)], ours)) == 0)


def test_fp8_gradients_are_accepted_directly(key):
  params = _params(key)
  g0, g = [jax.tree.map(lambda x: x[t], _gradient_stream(key, params, 2)) for t in range(2)]
  g8 = fo.quantize_updates(g)
  assert all(x.data.dtype == E4M3 for x in jax.tree.leaves(g8, is_leaf=fo.is_scaled))
  tx = fo.adamw(1e-3)
  _, state = jax.jit(tx.update)(g0, tx.init(params), params)  # 2nd step: not just sign(g)
  u8, s8 = jax.jit(tx.update)(g8, state, params)
  u_deq, s_deq = jax.jit(tx.update)(fo.dequantize_tree(g8), state, params)
  assert rel_err(_flat(u8), _flat(u_deq)) < 1e-6  # same math (up to f32 op fusion)
  m8, v8 = fo.adam_moments(s8[0])
  m_deq, v_deq = fo.adam_moments(s_deq[0])
  # Stored FP16 roots may differ by one rounding where the two programs fuse differently.
  assert rel_err(_flat(m8), _flat(m_deq)) < 1e-3 and rel_err(_flat(v8), _flat(v_deq)) < 1e-4
  assert u8["w"].dtype == jnp.float32
  u32, _ = jax.jit(tx.update)(g, state, params)
  assert 0.001 < rel_err(_flat(u8), _flat(u32)) < 0.10
  clipped = optax.chain(fo.dequantize_updates(), optax.clip_by_global_norm(1.0), fo.adamw(1e-3))
  uc, _ = jax.jit(clipped.update)(g8, clipped.init(params), params)
  ref = optax.chain(optax.clip_by_global_norm(1.0), fo.adamw(1e-3))
  ur, _ = jax.jit(ref.update)(fo.dequantize_tree(g8), ref.init(params), params)
  assert np.allclose(_flat(uc), _flat(ur), rtol=1e-6, atol=0)


def test_jit_with_donation(key):
  params = _params(key)
  tx = fo.adamw(1e-3)
  grads = _gradient_stream(key, params, 3)

  def step(params, state, g):
    u, state = tx.update(g, state, params)
    return optax.apply_updates(params, u), state

  donated = jax.jit(step, donate_argnums=(0, 1))
  plain = jax.jit(step)
  copy = lambda tree: jax.tree.map(jnp.copy, tree)
  p1, s1 = copy(params), tx.init(params)
  p2, s2 = copy(params), tx.init(params)
  for t in range(3):
    g = jax.tree.map(lambda x: x[t], grads)
    old = jax.tree.leaves((p1, s1))
    p1, s1 = donated(p1, s1, g)
    assert all(x.is_deleted() for x in old)  # buffers really donated
    p2, s2 = plain(p2, s2, g)
  assert rel_err(_flat(p1), _flat(p2)) < 1e-6
  for a, b in zip(jax.tree.leaves(s1, is_leaf=fo.is_scaled), jax.tree.leaves(s2, is_leaf=fo.is_scaled)):
    _assert_same_stored(a, b) if fo.is_scaled(a) else np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# Sharding (8 CPU devices)

def _shard(tree, mesh, specs):
  return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


@pytest.mark.parametrize("axis_type", ["Auto", "Explicit"])
def test_sharded_states_follow_params_and_match_unsharded(key, axis_type):
  assert jax.device_count() == 8
  mesh = jax.make_mesh((4, 2), ("data", "model"),
                       axis_types=(getattr(jax.sharding.AxisType, axis_type),) * 2)
  params = _params(key, ("w", "b"))
  specs = {"w": P("data", "model"), "b": P("model")}
  g = jax.tree.map(lambda x: x[0], _gradient_stream(key, params, 1, "row8"))
  tx = fo.adamw(1e-3)

  def step(master, state, g):
    params = fo.master_params(master)
    u, state = tx.update(g, state, params)
    return fo.apply_master_updates(master, u), state, u

  ref_master, ref_state, ref_u = jax.jit(step)(fo.init_master(params), tx.init(params), g)
  with jax.set_mesh(mesh):
    ps, gs = _shard(params, mesh, specs), _shard(g, mesh, specs)
    master, state = fo.init_master(ps), tx.init(ps)
    assert state[0].mu["w"].data.sharding.is_equivalent_to(ps["w"].sharding, 2)
    assert state[0].nu["b"].data.sharding.is_equivalent_to(ps["b"].sharding, 1)
    master, state, u = jax.jit(step, donate_argnums=(0, 1))(master, state, gs)
  for ours, ref in ((state[0].mu, ref_state[0].mu), (state[0].nu, ref_state[0].nu),
                    (master.params, ref_master.params)):
    for name in params:
      assert ours[name].data.sharding.is_equivalent_to(ps[name].sharding, ps[name].ndim)
      assert ours[name].scale.sharding.is_fully_replicated  # one scale per tensor
      _assert_same_stored(ours[name], ref[name])
  assert rel_err(_flat(u), _flat(ref_u)) < 1e-6


def test_shard_map_agrees_scales_over_axis_names(key):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros((32,))}
  g = {"w": jax.random.normal(key, (64, 32)) * jnp.repeat(10.0 ** -jnp.arange(8.0), 8)[:, None],
       "b": jax.random.normal(key, (32,))}
  sa = lambda s: fo.ScaledArray(s, P())
  state_specs = fo.ScaleByAdamState(P(), {"w": sa(P("data")), "b": sa(P())},
                                    {"w": sa(P("data")), "b": sa(P())})
  in_specs = ({"w": P("data"), "b": P()}, state_specs)
  ref_u, ref_state = jax.jit(fo.scale_by_adam().update)(g, fo.scale_by_adam().init(params))

  def sharded(tx, check_vma=True):
    f = jax.shard_map(lambda g, s: tx.update(g, s), mesh=mesh, in_specs=in_specs,
                      out_specs=in_specs, check_vma=check_vma)
    with jax.set_mesh(mesh):
      g_s = _shard(g, mesh, in_specs[0])
      s_s = _shard(tx.init(params), mesh, state_specs)
      return jax.jit(f)(g_s, s_s)

  for tx, check_vma in ((fo.scale_by_adam(axis_names=("data",)), False),  # named explicitly
                        (fo.scale_by_adam(), True)):  # found from the varying axes
    u, state = sharded(tx, check_vma)
    _assert_same_stored(state.nu["w"], ref_state.nu["w"])
    _assert_same_stored(state.mu["w"], ref_state.mu["w"])
    assert rel_err(u["w"], ref_u["w"]) < 1e-6
  # Without agreement each device would scale its shard alone (the test can fail):
  _, alone = sharded(fo.scale_by_adam(), check_vma=False)
  scales = [float(s.data) for s in alone.nu["w"].scale.addressable_shards]
  assert len(set(scales)) > 1


# ---------------------------------------------------------------------------------------------
# FP16 master weights

@functools.partial(jax.jit, static_argnames="rounding")
def _grow_with(master, w, rounding):
  """1000 steps of an update of 1e-4 of each weight's initial size."""
  def step(m, _):
    return fo.apply_master_updates(m, {"w": 1e-4 * w}, rounding=rounding), None
  return jax.lax.scan(step, master, None, length=1000)[0]


def test_master_weights_keep_updates_of_1e_4_of_a_weight(key):
  """FP16's ulp is 5e-4..1e-3 of a weight: round-to-nearest loses an update of 1e-4 of the
  weight every step; stochastic rounding keeps it: 1000 steps move every weight by ~0.1x
  (each weight within ~8% of that: a rounding random walk of ~10 ulps; the sum within 1%)."""
  k1, k2 = jax.random.split(key)
  w = jax.random.normal(k1, (256, 64)) * 10.0 ** jax.random.uniform(k2, (256, 64), minval=-4, maxval=0)
  master = fo.init_master({"w": w})
  assert master.params["w"].data.dtype == F16
  w0 = np.asarray(fo.master_params(master)["w"], np.float64)
  assert rel_err(w0, np.asarray(w, np.float64)) < 5e-4
  want = w0 * 1000 * 1e-4  # the update is 1e-4 * w per step, w fixed
  moved = {r: np.asarray(fo.master_params(_grow_with(master, w, r))["w"], np.float64) - w0
           for r in fo.master.ROUNDINGS}
  err_sr, err_rtn = rel_err(moved["stochastic"], want), rel_err(moved["nearest"], want)
  print(f"accumulated-update error: stochastic {err_sr:.4f}, nearest {err_rtn:.4f}")
  assert err_sr < 0.15  # per-weight rounding noise of ~10 ulps over 1000 steps, unbiased
  assert err_rtn > 0.9  # MS-AMP's round-to-nearest loses it (the test can fail)
  drift = np.sum(moved["stochastic"] * np.sign(want)) / np.sum(np.abs(want))
  assert abs(drift - 1) < 0.01  # unbiased


def test_master_weights_unchanged_by_non_finite_and_zero_updates(key):
  w = jax.random.normal(key, (64, 64))
  master = fo.init_master({"w": w, "step": jnp.int32(3)})
  apply = jax.jit(fo.apply_master_updates)
  for u in (jnp.zeros((64, 64)), jnp.zeros((64, 64)).at[1, 2].set(jnp.nan)):
    new = apply(master, {"w": u, "step": jnp.int32(0)})
    assert np.array_equal(np.asarray(new.params["w"].data, np.float32),
                          np.asarray(master.params["w"].data, np.float32))
    assert float(new.params["w"].scale) == float(master.params["w"].scale)
  assert int(new.params["step"]) == 3  # non-float leaves pass through
  with pytest.raises(ValueError, match="rounding='up' is not allowed"):
    fo.apply_master_updates(master, {"w": w, "step": 0}, rounding="up")


def master_params_z(master):
  return fo.master_params(master)["z"]


def test_master_weights_scale_chosen_before_the_update_follows_growth_and_zero_tensors(key):
  """The write scale comes from the amax after the previous update (16x headroom): weights
  that grow 10x in one step, and a zero tensor that starts moving, are stored exactly to
  FP16 precision; a shrinking tensor's scale follows it down. `finite=` replaces the check."""
  k1, k2 = jax.random.split(key)
  w = jax.random.normal(k1, (128, 64))
  u = jax.random.normal(k2, (128, 64)) * 3e-3
  master = fo.init_master({"w": w, "z": jnp.zeros((128, 64))})
  apply = jax.jit(fo.apply_master_updates, static_argnames="rounding")
  for grow_w, uz in ((9.0, u), (0.0, 12.0 * u), (-0.9, u)):  # w: x10, x1, x0.1
    before = jax.tree.map(lambda a: np.asarray(a, np.float64), fo.master_params(master))
    uw = grow_w * fo.master_params(master)["w"] + (u if grow_w == 0 else 0)
    master = apply(master, {"w": uw, "z": uz}, rounding="nearest")
    want = {"w": before["w"] + np.asarray(uw, np.float64),
            "z": before["z"] + np.asarray(uz, np.float64)}
    got = fo.master_params(master)
    for name in ("w", "z"):
      amax = np.abs(want[name]).max()
      assert float(master.amax[0 if name == "w" else 1]) == pytest.approx(amax, rel=1e-2)
      assert rel_err(got[name], want[name]) < 1e-3  # FP16 rounding only, nothing clipped
  # The scale follows the shrink at the next update (exactly: powers of two, zero update).
  after = apply(master, {"w": jnp.zeros_like(u), "z": jnp.zeros_like(u)}, rounding="nearest")
  assert float(after.params["w"].scale) < float(master.params["w"].scale) / 4
  assert np.array_equal(fo.master_params(after)["w"], fo.master_params(master)["w"])
  assert int(master.clipped) == 0
  # Growing 1000x in one step (a diverging run) clips at the headroom and is counted.
  grown = apply(master, {"w": u, "z": 1e3 * master_params_z(master)}, rounding="nearest")
  assert int(grown.clipped) == 1
  limit = float(grown.params["z"].scale) * 65504
  assert float(jnp.max(jnp.abs(fo.master_params(grown)["z"]))) == pytest.approx(limit)
  # finite=False: nothing changes (no pass over the updates); finite=True: same as checked.
  same = apply(master, {"w": u, "z": u}, rounding="nearest")
  given = jax.jit(lambda m, up: fo.apply_master_updates(m, up, rounding="nearest",
                                                        finite=True))(master, {"w": u, "z": u})
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), same, given))
  skipped = jax.jit(lambda m, up: fo.apply_master_updates(m, up, finite=False))(
      master, {"w": u, "z": u})
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), skipped, master))


# ---------------------------------------------------------------------------------------------
# Parity on a small real model

class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(64, use_bias=False)(x))
    x = nn.gelu(nn.Dense(64, use_bias=False)(x))
    return nn.Dense(4)(x)


def test_parity_mlp_regression_300_steps(key):
  """Teacher function y = sin(2 x W) + cos(x_a * x_b)/2 + noise on 2048 Gaussian inputs,
  16 -> 64 -> 64 -> 4 GELU MLP (bias on the output), 300 AdamW steps (warmup-cosine lr, weight decay 1e-2, batch
  128), same data order. Metrics vs optax.adamw: final full-data loss within 5%, per-step
  minibatch loss within 5%, and the parameter trajectory: ||p - p_optax|| / ||p_optax - p0||
  < 15%. Run for fp8jax.optim.adamw alone and for O2 (FP16 master + FP8 gradients + adamw)."""
  kx, kt, ki, kn, kb = jax.random.split(key, 5)
  model = _MLP()

  @jax.jit
  def data_and_init():
    x = jax.random.normal(kx, (2048, 16))
    w = jax.random.normal(kt, (16, 4)) / 4
    y = jnp.sin(2 * x @ w) + 0.5 * jnp.cos(x[:, :4] * x[:, 4:8]) \
        + 0.01 * jax.random.normal(kn, (2048, 4))
    return x, y, model.init(ki, x[:1])["params"]

  x, y, p0 = data_and_init()
  loss_fn = lambda p, x, y: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
  steps, batch = 300, 128
  lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, steps, 3e-4)

  def train(tx, o2=False):
    def step(carry, i):
      p, s = carry
      params = fo.master_params(p) if o2 else p
      perm = jax.random.permutation(jax.random.fold_in(kb, i // 16), 2048)
      idx = jax.lax.dynamic_slice(perm, ((i % 16) * batch,), (batch,))
      loss, g = jax.value_and_grad(loss_fn)(params, x[idx], y[idx])
      if o2:
        g = fo.quantize_updates(g)  # FP8 E4M3 + scale, as FP8 gradient communication sends
      u, s = tx.update(g, s, params)
      p = fo.apply_master_updates(p, u) if o2 else optax.apply_updates(p, u)
      return (p, s), loss

    @jax.jit
    def run():
      start = (fo.init_master(p0) if o2 else p0, tx.init(p0))
      (p, _), losses = jax.lax.scan(step, start, jnp.arange(steps))
      return (fo.master_params(p) if o2 else p), losses

    p, losses = run()
    return p, np.asarray(losses)

  ref_p, ref_losses = train(optax.adamw(lr, weight_decay=1e-2))
  full = lambda p: float(jax.jit(loss_fn)(p, x, y))
  moved = _flat(ref_p) - _flat(p0)
  # it learns (the reference itself: 0.503 of the start with seed 1365178649)
  assert full(ref_p) < 0.6 * float(np.mean(ref_losses[:5]))
  for o2 in (False, True):
    p, losses = train(fo.adamw(lr, weight_decay=1e-2), o2)
    final = abs(full(p) / full(ref_p) - 1)
    per_step = np.max(np.abs(losses / ref_losses - 1))
    traj = float(np.linalg.norm(_flat(p) - _flat(ref_p)) / np.linalg.norm(moved))
    print(f"O2={o2}: final loss {full(p):.4f} vs {full(ref_p):.4f} ({final:.2%}), "
          f"max per-step loss deviation {per_step:.2%}, trajectory {traj:.2%}")
    assert final < 0.05 and per_step < 0.05 and traj < 0.15
    assert traj > 1e-3  # FP8 state really was used (f32 storage gives ~2e-6)


def test_index_bits_high_bits_are_uniform_over_elements_and_over_seeds():
  """The stochastic-rounding bits (the top 13 for FP16) are uniform across a tensor's
  elements for one seed and across steps' seeds for one element (chi-square, 16 bins)."""
  from fp8jax.kernels.rounding import index_bits
  over_elements = np.asarray(index_bits(jnp.arange(1 << 16, dtype=jnp.uint32), 12345))
  over_seeds = np.asarray(jax.vmap(lambda s: index_bits(jnp.uint32(777), s))(
      jnp.arange(1 << 14, dtype=jnp.uint32)))
  for bits in (over_elements, over_seeds):
    counts = np.bincount(bits >> 28, minlength=16)
    expected = counts.sum() / 16
    assert np.sum((counts - expected) ** 2 / expected) < 37.7, counts  # p > 1e-3 at 15 dof
    top13 = (bits >> 19).astype(np.float64) / (1 << 13)
    assert abs(top13.mean() - 0.5) < 0.01
