import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax import Recipe, scaling
from conftest import rel_err

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


@pytest.mark.parametrize("fmt,lo,hi", [(E4M3, 0.01, 0.06), (E5M2, 0.02, 0.12)])
def test_quantize_roundtrip_error_is_fp8_sized(key, fmt, lo, hi):
  x = jax.random.normal(key, (4096,)) * 3.0
  s = scaling.scale_from_amax(scaling.compute_amax(x), jnp.float32(1), fmt)
  q = scaling.quantize(x, s, fmt)
  assert q.dtype == fmt
  err = rel_err(scaling.dequantize(q, s), np.asarray(x, np.float64))
  bf16_err = rel_err(x.astype(jnp.bfloat16), np.asarray(x, np.float64))
  assert lo < err < hi and err > 5 * bf16_err


def test_quantize_saturates_instead_of_nan(key):
  x = jax.random.normal(key, (256,)) * 1000.0
  q = scaling.quantize(x, jnp.float32(1.0), E4M3)
  assert np.isfinite(np.asarray(q, np.float32)).all()
  assert float(jnp.max(jnp.abs(q.astype(jnp.float32)))) == 448.0


@pytest.mark.parametrize("margin", [0, 1, 3])
def test_scale_maps_amax_to_max_over_two_to_margin(key, margin):
  amax = jnp.abs(jax.random.normal(key, ())) + 0.1
  s = scaling.scale_from_amax(amax, jnp.float32(1), E4M3, margin=margin)
  np.testing.assert_allclose(amax / s, 448.0 / 2**margin, rtol=1e-6)


def test_power_of_two_scales_round_up(key):
  amax = jnp.abs(jax.random.normal(key, (64,))) * 100 + 1e-3
  s = jax.vmap(lambda a: scaling.scale_from_amax(a, jnp.float32(1), E4M3, power_of_two=True))(amax)
  log2 = np.log2(np.asarray(s, np.float64))
  np.testing.assert_array_equal(log2, np.round(log2))
  assert (np.asarray(amax / s) <= 448.0).all() and (np.asarray(amax / s) > 224.0).all()


@pytest.mark.parametrize("bad", [0.0, np.inf, -np.inf, np.nan])
def test_zero_inf_nan_amax_keep_previous_scale(bad):
  prev = jnp.float32(0.37)
  assert float(scaling.scale_from_amax(jnp.float32(bad), prev, E4M3)) == pytest.approx(0.37)
  for p2 in (False, True):
    assert float(scaling.scale_from_amax(jnp.float32(bad), prev, E4M3, power_of_two=p2)) == \
        pytest.approx(0.37)
  # a finite amax whose scale under- or overflows f32 keeps the previous scale too
  assert float(scaling.scale_from_amax(jnp.float32(1e-44), prev, E4M3)) == pytest.approx(0.37)
  assert float(scaling.scale_from_amax(jnp.float32(3e38), prev, E4M3, margin=12)) == \
      pytest.approx(0.37)
  meta = fp8jax.Fp8Meta(prev, jnp.zeros(4).at[1].set(2.0))
  new = scaling.update_meta(meta, jnp.float32(bad), Recipe(amax_history_len=4), E4M3)
  assert np.isfinite(np.asarray(new.amax_history)).all()  # non-finite recorded as 0
  assert float(new.amax_history[0]) == 0.0 and float(new.amax_history[2]) == 2.0


def test_history_rolls_and_compute_algos(key):
  amaxes = np.array(jnp.abs(jax.random.normal(key, (6,))) + 0.5)
  amaxes[2] = 10.0  # a spike that 'max' remembers for history_len steps
  for algo in ("max", "most_recent"):
    r = Recipe(amax_history_len=3, amax_compute_algo=algo)
    meta = fp8jax.init_meta(3)
    for t, a in enumerate(amaxes):
      meta = scaling.update_meta(meta, jnp.float32(a), r, E4M3)
      window = amaxes[max(0, t - 2):t + 1][::-1]
      np.testing.assert_allclose(meta.amax_history[:len(window)], window, rtol=1e-6)
      want = window.max() if algo == "max" else a
      np.testing.assert_allclose(meta.scale, want / 448.0, rtol=1e-6)


def test_delayed_saturates_on_a_1000x_jump_current_does_not(key):
  k1, k2 = jax.random.split(key)
  small, big = jax.random.normal(k1, (1024,)), jax.random.normal(k2, (1024,)) * 1000.0
  for scaling_mode, saturates in (("delayed", True), ("current", False)):
    r = Recipe(scaling=scaling_mode)
    meta = scaling.update_meta(fp8jax.init_meta(r.amax_history_len),
                               scaling.compute_amax(small), r, E4M3)
    s = scaling.scale_for_cast(meta, scaling.compute_amax(big), r, E4M3)
    q = np.abs(np.asarray(scaling.quantize(big, s, E4M3), np.float32))
    frac_saturated = float(np.mean(q == 448.0))
    assert (frac_saturated > 0.5) == saturates, (scaling_mode, frac_saturated)
    err = rel_err(scaling.dequantize(scaling.quantize(big, s, E4M3), s), np.asarray(big, np.float64))
    assert (err > 0.5) == saturates


def test_first_cast_of_a_fresh_meta_uses_current_scaling(key):
  g = jax.random.normal(key, (1024,)) * 1e-6  # would flush to zero in E5M2 with scale 1
  r = Recipe()
  s = scaling.scale_for_cast(fp8jax.init_meta(r.amax_history_len), scaling.compute_amax(g), r, E5M2)
  assert rel_err(scaling.dequantize(scaling.quantize(g, s, E5M2), s), np.asarray(g, np.float64)) < 0.12


@pytest.mark.parametrize("recipe", [
    Recipe(), Recipe(amax_history_len=1),
    Recipe(amax_compute_algo="most_recent", margin=2, power_of_two_scales=True)])
def test_stacked_updates_equal_the_updates_one_by_one(key, recipe):
  """One GEMM's three states updated as one stacked update (``update_metas``) give exactly
  what three ``update_meta`` calls give: random histories and scales, a never-observed
  history, and an amax that is 0, inf, NaN or finite; scalar states and states stacked per
  layer; mismatched shapes fall back to one by one."""
  L = recipe.amax_history_len
  fmts = (E4M3, E4M3, E5M2)
  for lead, amaxes in (((), (3.7, np.inf, 0.0)), ((), (np.nan, 1e-3, 250.0)),
                       ((5,), None)):
    ks = jax.random.split(jax.random.fold_in(key, len(lead) + int(amaxes is None)), 6)
    metas = [scaling.Fp8Meta(jnp.exp(jax.random.normal(ks[i], lead)),
                             jnp.abs(jax.random.normal(ks[3 + i], (*lead, L))) * 10 ** i)
             for i in range(3)]
    metas[1] = metas[1]._replace(amax_history=jnp.zeros((*lead, L)))  # never observed
    if amaxes is None:
      amaxes = [jnp.abs(jax.random.normal(jax.random.fold_in(key, 9 + i), lead)) * 100
                for i in range(3)]
      amaxes[2] = amaxes[2].at[0].set(jnp.inf)
    amaxes = [jnp.asarray(a, jnp.float32) for a in amaxes]
    got = scaling.update_metas(metas, amaxes, recipe, fmts)
    for g, m, a, f in zip(got, metas, amaxes, fmts):
      update = lambda m, a, f=f: scaling.update_meta(m, a, recipe, f)  # noqa: E731
      want = (jax.vmap(update) if lead else update)(m, a)  # (per layer, as under nn.scan)
      np.testing.assert_array_equal(g.scale, want.scale)
      np.testing.assert_array_equal(g.amax_history, want.amax_history)
    assert any(not np.array_equal(g.scale, m.scale) for g, m in zip(got, metas))  # updated
  odd = [fp8jax.init_meta(L), fp8jax.init_meta(L + 1)]
  got = scaling.update_metas(odd, [jnp.float32(2.0)] * 2, recipe, fmts[:2])
  assert [g.amax_history.shape for g in got] == [(L,), (L + 1,)]


def test_combine_max_equals_update_with_larger_amax(key):
  r = Recipe(amax_history_len=4)
  base = scaling.update_meta(fp8jax.init_meta(4), jnp.float32(3.0), r, E4M3)
  a, b = (scaling.update_meta(base, jnp.float32(v), r, E4M3) for v in (0.5, 7.0))
  both = fp8jax.combine_max(a, b)
  np.testing.assert_array_equal(both.amax_history, b.amax_history)
  assert float(both.scale) == float(b.scale)
  # A zero-amax update keeps a stale scale; the combination must not pick it up.
  fresh = fp8jax.init_meta(4)
  z, g = (scaling.update_meta(fresh, jnp.float32(v), r, E5M2) for v in (0.0, 2.7e-3))
  assert float(fp8jax.combine_max(z, g).scale) == pytest.approx(2.7e-3 / 57344.0)


def test_amax_pmax_over_mesh_axes_agrees_on_every_device(key):
  mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  x = jax.random.normal(key, (8, 128)) * jnp.arange(1, 9)[:, None]  # shards differ
  x = jax.device_put(x, jax.sharding.NamedSharding(mesh, P("data")))

  def local(x, axes):
    return scaling.compute_amax(x, axes)[None]

  agreed = jax.shard_map(lambda x: local(x, ("data",)), mesh=mesh, in_specs=P("data"),
                         out_specs=P("data"))(x)
  alone = jax.shard_map(lambda x: local(x, ()), mesh=mesh, in_specs=P("data"),
                        out_specs=P("data"))(x)
  assert np.all(np.asarray(agreed) == float(jnp.max(jnp.abs(x))))
  assert len(set(np.asarray(alone).tolist())) > 1  # without pmax, devices disagree


def test_power_of_two_at_least_is_exact():
  """The least power of two >= x for random scales over the f32 range and for exact powers of
  two (exp2(ceil(log2(x))) missed by an ulp on CPU: an FP16 payload then came back as
  1.4999993 for 1.5); non-positive and non-finite values pass through."""
  from fp8jax.scaling import power_of_two_at_least
  rng = np.random.default_rng()
  x = np.concatenate([np.exp2(rng.uniform(-120, 120, 4000)),
                      np.exp2(np.arange(-126, 127, dtype=np.float64))]).astype(np.float32)
  got = np.asarray(power_of_two_at_least(jnp.asarray(x)), np.float64)
  want = 2.0 ** np.ceil(np.log2(x.astype(np.float64)))
  np.testing.assert_array_equal(got, want)
  special = jnp.asarray([0.0, -1.0, np.inf, np.nan], jnp.float32)
  np.testing.assert_array_equal(np.asarray(power_of_two_at_least(special)), np.asarray(special))
