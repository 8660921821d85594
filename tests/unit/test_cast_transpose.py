"""Fused FP8 cast+transpose+amax kernel (Pallas interpreter on CPU) vs the XLA path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import scaling
from fp8jax.kernels import cast_transpose as ct
from conftest import rel_err

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def _inputs(key, shape, dtype, fmt):
  """Normal values spread over ~12 binades, 5% of them 2**-24 times smaller, and a scale that
  saturates the largest values and flushes the tiny ones to zero / subnormals."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  x = jax.random.normal(k1, shape) * jnp.exp2(jax.random.uniform(k2, shape, minval=-8, maxval=4))
  x = jnp.where(jax.random.uniform(k4, shape) < 0.05, x * 2.0**-24, x).astype(dtype)
  amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
  scale = amax / scaling.fp8_max(fmt) * float(jax.random.uniform(k3, (), minval=0.3, maxval=0.6))
  return x, jnp.float32(scale)


def _bits(a):
  return np.asarray(a).view(np.uint8)


def _assert_same_cast(out, ref):
  """Bit-identical q (NaN where the reference has NaN: payload bits may differ), q_t == q^T,
  identical amax (NaN iff the reference is NaN)."""
  (q, qt, amax), (rq, _, ramax) = out, ref
  assert q.dtype == rq.dtype and q.shape == rq.shape
  nan = np.isnan(np.asarray(rq, np.float32))
  np.testing.assert_array_equal(np.isnan(np.asarray(q, np.float32)), nan)
  np.testing.assert_array_equal(_bits(q)[~nan], _bits(rq)[~nan])
  np.testing.assert_array_equal(_bits(qt), np.swapaxes(_bits(q), -1, -2))
  assert amax.dtype == jnp.float32 and amax.shape == ()
  assert np.isnan(float(ramax)) == np.isnan(float(amax))
  if not np.isnan(float(ramax)):
    assert float(amax) == float(ramax)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape,dtype,block", [
    ((256, 384), jnp.bfloat16, (64, 128)),
    ((2, 128, 256), jnp.float32, (128, 128)),
    ((96, 64), jnp.float16, (32, 32)),
])
def test_kernel_matches_xla_reference(key, fmt, shape, dtype, block):
  x, scale = _inputs(key, shape, dtype, fmt)
  out = ct.cast_transpose_amax(x, scale, fmt, interpret=True, block_m=block[0], block_k=block[1])
  ref = ct.cast_transpose_reference(x, scale, fmt)
  _assert_same_cast(out, ref)
  np.testing.assert_array_equal(_bits(ref[0]), _bits(scaling.quantize(x, scale, fmt)))
  assert float(out[2]) == float(scaling.compute_amax(x))
  q = np.asarray(out[0], np.float32)
  fmax = scaling.fp8_max(fmt)
  assert (np.abs(q) == fmax).any()  # the largest values saturated (scale < amax / fmax) ...
  if not (dtype == jnp.float16 and fmt == jnp.float8_e5m2):  # f16 cannot go below E5M2's range
    assert ((q == 0) & (np.asarray(x, np.float32) != 0)).any()  # ... and some flushed to zero


@pytest.mark.parametrize("fmt", FORMATS)
def test_nan_and_inf_never_vanish(key, fmt):
  x, scale = _inputs(key, (128, 128), jnp.bfloat16, fmt)
  rows = jax.random.randint(key, (3,), 0, 128)
  x_inf = x.at[rows[0], 5].set(jnp.inf).at[rows[1], 77].set(-jnp.inf)
  out = ct.cast_transpose_amax(x_inf, scale, fmt, interpret=True, block_m=64, block_k=64)
  _assert_same_cast(out, ct.cast_transpose_reference(x_inf, scale, fmt))
  assert float(out[2]) == np.inf
  q = np.asarray(out[0], np.float32)
  assert q[int(rows[0]), 5] == scaling.fp8_max(fmt) and q[int(rows[1]), 77] == -scaling.fp8_max(fmt)
  # One NaN in one tile of many: the amax is NaN, and only that element of q / q_t is NaN.
  x_nan = x_inf.at[rows[2], 100].set(jnp.nan)
  out = ct.cast_transpose_amax(x_nan, scale, fmt, interpret=True, block_m=64, block_k=64)
  _assert_same_cast(out, ct.cast_transpose_reference(x_nan, scale, fmt))
  assert np.isnan(float(out[2]))
  assert np.isnan(np.asarray(out[0], np.float32)).sum() == 1
  assert np.isnan(np.asarray(out[1], np.float32)[100, int(rows[2])])
  # A NaN with its sign bit set (the amax takes the magnitudes' bits) is NaN too.
  neg_nan = jax.lax.bitcast_convert_type(jnp.uint16(0xFFC1), jnp.bfloat16)
  out = ct.cast_transpose_amax(x_inf.at[rows[2], 100].set(neg_nan), scale, fmt, interpret=True,
                               block_m=64, block_k=64)
  assert np.isnan(float(out[2])) and np.isnan(np.asarray(out[0], np.float32)).sum() == 1


def test_dispatch_and_bad_input():
  x = jnp.ones((256, 128), jnp.bfloat16)
  reason = ct.kernel_reason(x.shape, x.dtype, jnp.float8_e4m3fn)
  if jax.default_backend() == "gpu":
    assert reason is None
  else:
    assert "not gpu" in reason
  with ct.interpret_anywhere():
    assert ct.kernel_reason(x.shape, x.dtype, jnp.float8_e4m3fn) is None
    assert "multiple of the block" in ct.kernel_reason((256, 100), x.dtype, jnp.float8_e4m3fn)
    assert "bf16/f16/f32" in ct.kernel_reason(x.shape, jnp.int8, jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match="float8_e4m3fn or float8_e5m2"):
    ct.cast_transpose_amax(x, jnp.float32(1), jnp.int8, interpret=True)
  with pytest.raises(ValueError, match="multiple of the block"):
    ct.cast_transpose_amax(x[:, :100], jnp.float32(1), jnp.float8_e4m3fn, interpret=True)


def _grads(x, w, g, dn, meta, recipe):
  """(y, dx, dw, new meta) of one fp8_dot_general call."""
  f = lambda x, w, m: fp8jax.fp8_dot_general(x, w, dn, m, recipe)
  y, vjp = jax.vjp(f, x, w, meta)
  return (y, *vjp(g))


CASES = [  # (x shape, w shape, dimension numbers): nn.Dense on [B, T, D], a batched GEMM
    ((2, 128, 256), (256, 128), (((2,), (0,)), ((), ()))),
    ((2, 128, 128), (2, 128, 256), (((2,), (1,)), ((0,), (0,)))),
]


@pytest.mark.parametrize("scaling_mode", ["delayed", "current"])
@pytest.mark.parametrize("x_shape,w_shape,dn", CASES)
def test_fp8_dot_fused_flag_changes_nothing(key, scaling_mode, x_shape, w_shape, dn):
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, x_shape, jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(k2, w_shape, jnp.float32) * 0.05).astype(jnp.bfloat16)
  y_shape = jax.eval_shape(lambda: jax.lax.dot_general(x, w, dn)).shape
  g = (jax.random.normal(k3, y_shape, jnp.float32) * 1e-3).astype(jnp.bfloat16)
  off = fp8jax.Recipe(scaling=scaling_mode, amax_history_len=4)
  on = off.replace(fused_cast_transpose=True)
  with ct.interpret_anywhere():
    jaxpr = str(jax.make_jaxpr(lambda *a: _grads(*a, dn, fp8jax.init_dot_meta(on), on))(x, w, g))
    run_on = jax.jit(lambda x, w, g, m: _grads(x, w, g, dn, m, on))
    run_off = jax.jit(lambda x, w, g, m: _grads(x, w, g, dn, m, off))
    meta = fp8jax.init_dot_meta(off)
    for step in range(2):  # never-observed meta (just-in-time scale), then delayed scales
      a, b = run_on(x * (step + 1), w, g, meta), run_off(x * (step + 1), w, g, meta)
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
      meta = b[3]
  assert jaxpr.count("pallas_call") == 2  # x in the forward, g in the backward


def test_fused_dot_error_vs_float64(key):
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (256, 256), jnp.float32)
  w = jax.random.normal(k2, (256, 128), jnp.float32) * 0.1
  g = jax.random.normal(k3, (256, 128), jnp.float32)
  dn = (((1,), (0,)), ((), ()))
  recipe = fp8jax.Recipe(fused_cast_transpose=True)
  with ct.interpret_anywhere():
    outs = jax.jit(lambda x, w, g: _grads(x, w, g, dn, fp8jax.init_dot_meta(recipe), recipe))(
        x, w, g)[:3]
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  refs = (x64 @ w64, g64 @ w64.T, x64.T @ g64)
  bf = lambda a: np.asarray(jnp.asarray(a, jnp.bfloat16), np.float64)
  bf16 = (bf(x) @ bf(w), bf(g) @ bf(w).T, bf(x).T @ bf(g))
  for name, o, r, b, bound in zip(("y", "dx", "dw"), outs, refs, bf16, (0.08, 0.15, 0.15)):
    e = rel_err(o, r)
    assert e < bound, (name, e)
    assert e > 3 * rel_err(b, r), (name, e)  # FP8 happened
