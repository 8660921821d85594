"""Checks that the Pallas Triton features fp8jax's fused kernels use lower and run on this GPU.

  python benchmarks/pallas_probe.py
"""
import traceback

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:
  from jax.experimental.pallas import triton as plt
except Exception:  # noqa: BLE001
  plt = None


def probe(name, fn):
  try:
    out = fn()
    print(f"OK   {name}: {out}")
  except Exception as e:  # noqa: BLE001
    print(f"FAIL {name}: {type(e).__name__}: {str(e)[:400]}")
    traceback.print_exc(limit=3)


def cast_fp8():
  x = jax.random.normal(jax.random.key(0), (256, 128), jnp.bfloat16) * 100

  def k(x_ref, s_ref, q_ref, qt_ref, a_ref):
    inv = s_ref[0]
    v = x_ref[...].astype(jnp.float32) * inv
    v = jnp.clip(v, -448.0, 448.0)
    q = v.astype(jnp.float8_e4m3fn)
    q_ref[...] = q
    qt_ref[...] = q.T
    a_ref[...] = jnp.broadcast_to(jnp.max(jnp.abs(x_ref[...].astype(jnp.float32))), (1,))

  f = pl.pallas_call(k, grid=(4, 2),
                     in_specs=[pl.BlockSpec((64, 64), lambda i, j: (i, j)),
                               pl.BlockSpec((2,), lambda i, j: (0,))],
                     out_specs=[pl.BlockSpec((64, 64), lambda i, j: (i, j)),
                                pl.BlockSpec((64, 64), lambda i, j: (j, i)),
                                pl.BlockSpec((1,), lambda i, j: (i * 2 + j,))],
                     out_shape=[jax.ShapeDtypeStruct((256, 128), jnp.float8_e4m3fn),
                                jax.ShapeDtypeStruct((128, 256), jnp.float8_e4m3fn),
                                jax.ShapeDtypeStruct((8,), jnp.float32)],
                     compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))
  q, qt, a = jax.jit(f)(x, jnp.array([0.5, 0.0], jnp.float32))
  ref = jnp.clip(x.astype(jnp.float32) * 0.5, -448, 448).astype(jnp.float8_e4m3fn)
  return dict(q_eq=bool((q == ref).all()), qt_eq=bool((qt == ref.T).all()),
              amax_ok=bool(a.max() == jnp.abs(x.astype(jnp.float32)).max()))


def hash_bits():
  n = 4096
  x = jax.random.normal(jax.random.key(1), (n,), jnp.float32)

  def k(x_ref, key_ref, o_ref, b_ref):
    pid = pl.program_id(0).astype(jnp.uint32)
    idx = pid * jnp.uint32(1024) + lax.broadcasted_iota(jnp.uint32, (1024,), 0)
    h = idx ^ key_ref[0]
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    bits = lax.bitcast_convert_type(x_ref[...], jnp.uint32)
    o_ref[...] = lax.bitcast_convert_type((bits + (h >> 19)) & jnp.uint32(0xFFFFE000),
                                          jnp.float32).astype(jnp.float16)
    b_ref[...] = h

  f = pl.pallas_call(k, grid=(n // 1024,),
                     in_specs=[pl.BlockSpec((1024,), lambda i: (i,)),
                               pl.BlockSpec((1,), lambda i: (0,))],
                     out_specs=[pl.BlockSpec((1024,), lambda i: (i,)),
                                pl.BlockSpec((1024,), lambda i: (i,))],
                     out_shape=[jax.ShapeDtypeStruct((n,), jnp.float16),
                                jax.ShapeDtypeStruct((n,), jnp.uint32)],
                     compiler_params=plt.CompilerParams(num_warps=4, num_stages=1))
  key = jnp.array([12345], jnp.uint32)
  o, b = jax.jit(f)(x, key)
  idx = jnp.arange(n, dtype=jnp.uint32)
  h = idx ^ key[0]
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x7FEB352D)
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  ref = lax.bitcast_convert_type((bits + (h >> 19)) & jnp.uint32(0xFFFFE000), jnp.float32).astype(jnp.float16)
  return dict(bits_eq=bool((b == h).all()), out_eq=bool((o == ref).all()))


if __name__ == "__main__":
  print(jax.__version__, jax.devices())
  probe("cast+transpose+amax fp8", cast_fp8)
  probe("uint32 hash + bitcast", hash_bits)
