"""FP8 gradient collectives inside shard_map over 2 / 4 / 8 CPU devices, against float64."""
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from conftest import rel_err
from fp8jax.optim.scaled import ScaledArray
from fp8jax.parallel.collectives import (CommStats, comm_scales, fp8_all_gather,
                                         fp8_reduce_scatter, fp8_reduce_scatter_auto,
                                         fp8_reduce_scatter_tree, init_comm_scaling,
                                         update_comm_scaling)

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2


def _mesh(shape, names):
  n = int(np.prod(shape))
  return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape),
                       devices=jax.devices()[:n])


def _grads(key, n, shape, decades=True):
  """n ranks' gradients, f32[n, *shape], like data-parallel gradients of one tensor: per element
  a shared direction plus per-rank noise, times a magnitude shared by the ranks and lognormal
  over the elements (exp(1.5 N(0,1)): about 5 decades at 1e5 elements)."""
  k1, k2, k3 = jax.random.split(key, 3)
  common = jax.random.normal(k1, shape)
  noise = jax.random.normal(k2, (n,) + shape)
  mag = jnp.exp(1.5 * jax.random.normal(k3, shape)) if decades else 1.0
  return np.array((0.5 * common + noise) * mag, np.float32)


def _sharded(mesh, xs, spec_axes):
  """Rank-major concatenation of xs[r] along dim 0, sharded over `spec_axes`."""
  return jax.device_put(xs.reshape((-1,) + xs.shape[2:]), NamedSharding(mesh, P(spec_axes)))


def _run(mesh, fn, x, in_axes, out_specs):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(in_axes), out_specs=out_specs))(x)


def _ref_reduce_scatter(xs):
  """float64 sum over ranks of xs[r]: psum_scatter(tiled=True) over dim 0, rank-major."""
  return xs.astype(np.float64).sum(0)


def _fp8_ring(xs, dtype):
  """Emulated per-hop FP8 ring (what psum on FP8 / MS-AMP's FP8 NCCL ring does): each rank
  casts with a scale n times coarser (the sum must stay in range) and the partial sum is
  rounded back to FP8 at every hop. Returns the f64 sum over ranks."""
  n = xs.shape[0]
  fmax = float(ml_dtypes.finfo(dtype).max)
  scale = n * np.abs(xs).max() / fmax
  q = lambda v: np.clip(v / scale, -fmax, fmax).astype(dtype).astype(np.float64) * scale
  partial = q(xs[0].astype(np.float64))
  for r in range(1, n):
    partial = q(partial + q(xs[r].astype(np.float64)))
  return partial


def test_reduce_scatter_is_psum_scatter_tuple_axes_other_dimension(key):
  """8 ranks as a (2, 4) mesh, tuple axis name, scatter_dimension=1, bf16 input."""
  mesh = _mesh((2, 4), ("a", "b"))
  xs = _grads(key, 8, (24, 64, 16))
  xs_bf16 = xs.astype(jnp.bfloat16)
  x = _sharded(mesh, xs_bf16, ("a", "b"))
  fn = lambda x: (fp8_reduce_scatter(x, ("a", "b"), scatter_dimension=1),
                  lax.psum_scatter(x.astype(jnp.float32), ("a", "b"), scatter_dimension=1,
                                   tiled=True))
  got, exact = _run(mesh, fn, x, ("a", "b"), (P(("a", "b")), P(("a", "b"))))
  assert got.shape == exact.shape == (8 * 24, 8, 16) and got.dtype == jnp.float32
  # rank r holds chunk r of dim 1 of the sum over ranks
  ref = xs_bf16.astype(np.float64).sum(0)  # [24, 64, 16]
  ref_scattered = np.concatenate(np.split(ref, 8, axis=1), axis=0)
  assert rel_err(exact, ref_scattered) < 1e-6
  assert 5e-3 < rel_err(got, ref_scattered) < 0.05


@pytest.mark.parametrize("dtype, bound", [(E4M3, 0.045), (E5M2, 0.09)])
def test_error_bounded_and_flat_in_ranks_unlike_fp8_ring(key, dtype, bound):
  """Three draws of heavy-tailed gradients per rank count; the ring is judged by its summed
  error relative to ours on the same draws (one draw's raw ring error need not rise with the
  ranks: seed 594969247 gave 0.047 at 2 ranks and 0.041 at 8; one draw's ratio to ours swings
  with ours: seed 5 gave 3.1 at 2 ranks)."""
  errs, ring_ratio, bf16_errs = {}, {}, {}
  for n in (2, 4, 8):
    mesh = _mesh((n,), ("d",))
    ours = jax.jit(jax.shard_map(lambda x: fp8_reduce_scatter(x, "d", dtype=dtype), mesh=mesh,
                                 in_specs=P("d"), out_specs=P("d")))
    ring = []
    for _ in range(3):
      key, k = jax.random.split(key)
      xs = _grads(k, n, (256, 512))
      ref = _ref_reduce_scatter(xs)
      x = _sharded(mesh, xs, "d")
      got = ours(x)
      bf16 = _run(mesh, lambda x: lax.psum_scatter(x.astype(jnp.bfloat16), "d", tiled=True),
                  x, "d", P("d"))
      err, bf16_err = rel_err(got, ref), rel_err(bf16.astype(jnp.float32), ref)
      assert 4 * bf16_err < err < bound  # really FP8, and bounded
      errs.setdefault(n, []).append(err)
      bf16_errs.setdefault(n, []).append(bf16_err)
      ring.append(rel_err(_fp8_ring(xs, dtype), ref))
    ring_ratio[n] = sum(ring) / sum(errs[n])
  print("fp8 all_to_all", errs, "fp8 ring / ours", ring_ratio, "bf16", bf16_errs)
  mean = {n: float(np.mean(e)) for n, e in errs.items()}
  assert max(mean[4], mean[8]) < 1.25 * mean[2]  # does not grow with the ranks
  # the per-hop FP8 ring's error does grow: ~1.5-2.0x ours at 2 ranks, ~2.9-4.0x at 8 (26
  # draws of 3; the closest pair 1.98 -> 2.90); a ring that did not grow would sit near 1x
  assert ring_ratio[8] > 1.3 * ring_ratio[2]
  assert ring_ratio[8] > 2


def _eqns(jaxpr):
  """Every equation of a (closed) jaxpr, nested ones (shard_map, pjit, cond) included."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
  for eqn in jaxpr.eqns:
    yield eqn
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
          yield from _eqns(sub)


def _wire_dtypes(fn, x, collective):
  """For each `collective` in fn's jaxpr: the payload type its uint8 operand was bitcast from."""
  eqns = list(_eqns(jax.make_jaxpr(fn)(x)))
  made_by = {id(v): e for e in eqns for v in e.outvars}
  found = []
  for e in eqns:
    if e.primitive.name == collective:
      (v,) = e.invars
      src = made_by.get(id(v))
      assert v.aval.dtype == np.uint8 and src.primitive.name == "bitcast_convert_type"
      found.append(src.invars[0].aval.dtype)
  return found


@pytest.mark.parametrize("dtype, hlo_name", [(E4M3, "f8e4m3fn"), (E5M2, "f8e5m2")])
def test_wire_payload_is_fp8(key, dtype, hlo_name):
  """The collectives move the FP8 payload as its 1-byte pattern (uint8); the only all-reduce
  is the f32 pmax of the amax; no FP8 array is ever summed by a collective."""
  mesh = _mesh((4,), ("d",))
  x = _sharded(mesh, _grads(key, 4, (16, 32)), "d")
  for fn, collective, hlo_op in [
      (lambda x: fp8_reduce_scatter(x, "d", dtype=dtype), "all_to_all", "all-to-all("),
      (lambda x: fp8_all_gather(x, "d", dtype=dtype), "all_gather", "all-gather(")]:
    smap = jax.shard_map(fn, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    assert _wire_dtypes(smap, x, collective) == [np.dtype(dtype)]
    hlo = jax.jit(smap).lower(x).compile().as_text().splitlines()
    moves = [l for l in hlo if hlo_op in l]
    assert len(moves) == 1 and re.search(r"= \(?u8\[", moves[0]), moves
    reduces = [l for l in hlo if "all-reduce(" in l or "reduce-scatter(" in l]
    assert len(reduces) == 1 and "f32[1]" in reduces[0], reduces
    assert hlo_name not in " ".join(moves + reduces)


def test_tree_one_collective_per_leaf_scales(key):
  """Leaves of very different magnitudes keep their own scale; one all_to_all for the tree."""
  n = 4
  mesh = _mesh((n,), ("d",))
  k1, k2, k3 = jax.random.split(key, 3)
  tree = {"w": _grads(k1, n, (32, 64)), "b": _grads(k2, n, (256,), decades=False) * 1e-6,
          "e": _grads(k3, n, (16, 3, 5), decades=False) * 1e3}
  xs = {k: _sharded(mesh, v, "d") for k, v in tree.items()}
  specs = {k: P("d") for k in tree}
  fn = jax.shard_map(lambda t: fp8_reduce_scatter_tree(t, "d", with_stats=True), mesh=mesh,
                     in_specs=(specs,), out_specs=(specs, P()))
  (out, stats), text = jax.jit(fn)(xs), jax.jit(fn).lower(xs).as_text()
  assert text.count("all_to_all") == 1
  for j, (k, v) in enumerate(sorted(tree.items())):  # leaf order of a dict: sorted keys
    ref = v.astype(np.float64).sum(0)
    assert out[k].shape == ref.shape
    assert 1e-3 < rel_err(out[k], ref) < 0.05, k
    np.testing.assert_allclose(stats.amax[j], np.abs(v).max(), rtol=1e-6)
  assert np.all(np.asarray(stats.saturated) == 0)  # current scaling never saturates


def test_chunked_all_to_all_gives_the_same_result(key):
  """`chunks` splits the wire into several all_to_alls (pipelining) without changing a bit."""
  mesh = _mesh((4,), ("d",))
  tree = {"a": _grads(key, 4, (32, 30)), "b": _grads(jax.random.fold_in(key, 1), 4, (16, 7),
                                                      decades=False)}
  xs = {k: _sharded(mesh, v, "d") for k, v in tree.items()}
  specs = {k: P("d") for k in tree}
  one, three = (jax.jit(jax.shard_map(lambda t, c=c: fp8_reduce_scatter_tree(t, "d", chunks=c),
                                      mesh=mesh, in_specs=(specs,), out_specs=specs))
                for c in (1, 3))
  assert three.lower(xs).as_text().count("all_to_all") == 3
  for k, v in tree.items():
    np.testing.assert_array_equal(three(xs)[k], one(xs)[k])
    assert rel_err(one(xs)[k], v.astype(np.float64).sum(0)) < 0.05


def test_all_gather_dequantized_and_scaled_payload(key):
  mesh = _mesh((8,), ("d",))
  xs = _grads(key, 8, (6, 40))
  x = jax.device_put(jnp.asarray(np.concatenate(list(xs), axis=1)), NamedSharding(mesh, P(None, "d")))
  fn = lambda x: (fp8_all_gather(x, "d", axis=1),
                  fp8_all_gather(x, "d", axis=1, dtype=E5M2, return_scaled=True))
  per_rank = lambda x: jax.tree.map(lambda a: a[None], fn(x))  # every rank's copy, stacked
  got, scaled = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P(None, "d"),
                                      out_specs=P("d")))(x)
  got, data, scales = np.asarray(got), np.asarray(scaled.data), np.asarray(scaled.scale)
  ref = np.concatenate(list(xs), axis=1)  # the gathered tensor
  assert got.shape == (8,) + ref.shape
  np.testing.assert_array_equal(got, np.broadcast_to(got[0], got.shape))  # ranks agree
  assert 5e-3 < rel_err(got[0], ref) < 0.045
  assert isinstance(scaled, ScaledArray) and scaled.data.dtype == E5M2
  assert scaled.scale.shape == (8,) and scaled.scale.dtype == jnp.float32
  np.testing.assert_allclose(scales, np.abs(ref).max() / 57344.0, rtol=1e-6)
  assert 1e-2 < rel_err(data[3].astype(np.float32) * scales[3], ref) < 0.09


def test_delayed_scale_reports_saturation(key):
  n = 4
  mesh = _mesh((n,), ("d",))
  xs = _grads(key, n, (32, 64))
  amax = float(np.abs(xs).max())
  scale = np.float32(amax / 4 / 448.0)  # a scale for a 4x smaller amax: some values clip
  fn = lambda x: fp8_reduce_scatter(x, "d", scale=scale, with_stats=True)
  got, stats = _run(mesh, fn, _sharded(mesh, xs, "d"), "d", (P("d"), P()))
  expected = np.mean(np.abs(xs) / scale >= 448 + 16)
  assert expected > 1e-4
  np.testing.assert_allclose(stats.saturated, expected, rtol=1e-6)
  np.testing.assert_allclose(stats.amax, amax, rtol=1e-6)
  clipped = np.clip(xs, -448 * scale, 448 * scale).astype(np.float64).sum(0)
  assert rel_err(got, clipped) < 0.05  # saturated values are clipped, the rest is exact-ish


def test_nan_gradient_is_never_silent(key):
  mesh = _mesh((2,), ("d",))
  xs = _grads(key, 2, (8, 16))
  xs[1, 3, 5] = np.nan
  got, stats = _run(mesh, lambda x: fp8_reduce_scatter(x, "d", with_stats=True),
                    _sharded(mesh, xs, "d"), "d", (P("d"), P()))
  assert np.isnan(np.asarray(got)).any() and not np.isfinite(stats.amax)


def test_auto_scaling_halves_on_saturation_and_grows_back(key):
  """Steps see one gradient magnitude pattern with fresh signs (so the amax is steady, as in
  training), except one step where 0.1% of the values jump 8x above the previous amax."""
  n, interval = 4, 3
  mesh = _mesh((n,), ("d",))
  fn = jax.jit(jax.shard_map(
      lambda x, s: fp8_reduce_scatter_auto(x, "d", s, growth_interval=interval),
      mesh=mesh, in_specs=(P("d"), P()), out_specs=(P("d"), P())))
  key, kb = jax.random.split(key)
  base = np.abs(_grads(kb, n, (64, 64)))
  state = init_comm_scaling()
  history = []
  for step in range(6):
    key, k, ks = jax.random.split(key, 3)
    xs = base * np.asarray(jax.random.rademacher(k, base.shape), np.float32)
    ref = xs.astype(np.float64).sum(0)
    if step == 1:  # the spike: delayed scale from step 0, pre-scale 1, so these clip
      idx = np.asarray(jax.random.choice(ks, xs.size, (xs.size // 1000,), replace=False))
      xs.reshape(-1)[idx] = 8 * float(state.amax)
      ref = np.clip(xs, -float(state.amax), float(state.amax)).astype(np.float64).sum(0)
    out, state = fn(_sharded(mesh, xs, "d"), state)
    history.append((float(state.pre_scale), float(state.saturated), int(state.clean_steps)))
    assert rel_err(out, ref) < 0.05, (step, rel_err(out, ref))
    np.testing.assert_allclose(state.amax, np.abs(xs).max(), rtol=1e-6)
  print(history)
  assert history[0] == (1.0, 0.0, 1)  # first step: current scaling, nothing saturates
  np.testing.assert_allclose(history[1][1], 0.001, rtol=0.1)
  assert history[1][0] == 0.5 and history[1][2] == 0  # halved on saturation
  assert [h[0] for h in history] == [1.0, 0.5, 0.5, 0.5, 1.0, 1.0]  # x2 after 3 clean steps
  assert [h[1] for h in history[2:]] == [0.0] * 4
  # the delayed scale follows the recorded amax and the pre-scale
  np.testing.assert_allclose(comm_scales(state), float(state.amax) / float(state.pre_scale) / 448,
                             rtol=1e-6)


def test_update_rule_threshold_cap_and_nonfinite():
  s = init_comm_scaling(3)._replace(amax=jnp.ones(3), pre_scale=jnp.array([1.0, 0.25, 1.0]),
                                    clean_steps=jnp.array([0, 1, 1], jnp.int32))
  st = CommStats(jnp.array([2.0, 3.0, jnp.inf]), jnp.array([1e-5, 1e-5, 0.0]))
  new = update_comm_scaling(s, st, growth_interval=2)
  np.testing.assert_array_equal(new.pre_scale, [1.0, 0.5, 1.0])  # at 1e-5 exactly: clean
  np.testing.assert_array_equal(new.clean_steps, [1, 0, 0])  # grew (reset); inf: not clean
  np.testing.assert_array_equal(new.amax, [2.0, 3.0, 1.0])  # inf keeps the previous amax
  over = update_comm_scaling(new, CommStats(jnp.ones(3), jnp.array([2e-5, 0.0, 0.5])))
  np.testing.assert_array_equal(over.pre_scale, [0.5, 0.5, 0.5])


@pytest.mark.parametrize("call, match", [
    (lambda x: fp8_reduce_scatter(x.astype(jnp.int32), "d"), "dtype int32; only floating"),
    (lambda x: fp8_reduce_scatter(x[:3], "d"), r"dimension 0 \(3\) is not divisible by the "
                                               "axis size 2"),
    (lambda x: fp8_reduce_scatter(x, "d", scatter_dimension=2), "scatter_dimension=2 is out of "
                                                                "range"),
    (lambda x: fp8_reduce_scatter(x, "d", dtype=jnp.float16), "dtype=<class 'jax.numpy.float16'>"
                                                              " is not allowed"),
    (lambda x: fp8_reduce_scatter(x, "d", out_dtype=jnp.int8), "out_dtype=.* is not allowed"),
    (lambda x: fp8_reduce_scatter(x, "d", chunks=0), "chunks=0 is not allowed; use an int >= 1"),
    (lambda x: fp8_reduce_scatter_tree([x, x[:, :2]], "d", scales=jnp.ones(3)),
     r"scales has shape \(3,\); use a scalar or one scale per leaf, shape \(2,\)"),
    (lambda x: fp8_reduce_scatter_tree({"w": x, "n": x[:1]}, "d"),
     r"leaf 0 \(\['n'\]\) has shape \(1, 4\), whose dimension 0 \(1\) is not divisible"),
    (lambda x: fp8_all_gather(x, "d", axis=-3), "axis=-3 is out of range"),
    (lambda x: fp8_all_gather(x, "d", dtype="int8"), "dtype='int8' is not allowed"),
    (lambda x: fp8_reduce_scatter_auto([x, x], "d", init_comm_scaling()),
     r"state has shape \(\) but the tree has 2 leaves"),
])
def test_bad_inputs_give_clear_errors(key, call, match):
  mesh = _mesh((2,), ("d",))
  x = _sharded(mesh, _grads(key, 2, (8, 4)), "d")
  with pytest.raises(ValueError, match=match):
    _run(mesh, call, x, "d", P("d"))


def test_update_rule_bad_factors():
  s, st = init_comm_scaling(), CommStats(jnp.ones(()), jnp.zeros(()))
  with pytest.raises(ValueError, match="backoff_factor=1.5 must be in"):
    update_comm_scaling(s, st, backoff_factor=1.5)
  with pytest.raises(ValueError, match="threshold=2 must be in"):
    update_comm_scaling(s, st, threshold=2)
