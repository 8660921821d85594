"""Where the fused O2 optimizer kernel's time goes: variants of it on one tensor, one GPU.

  python benchmarks/adam_kernel_probe.py [--n 268435456] [--iters 20]

Times, on one tensor of N elements (E4M3 gradient, E4M3 u, FP16 r, FP16 master weight):
the kernel as shipped ("when": a skipped step is a pl.when), the previous one ("full hash32":
per-element selects, two hash32 rounds per element), the kernel with parts of its math
removed (stochastic rounding, the block amax), a copy kernel moving the same bytes (the bandwidth ceiling of a
1-D Pallas/Triton kernel), other tilings, the same per-element function through XLA, and the
amax passes the step runs before the kernel. Prints GPU kernel ms per call (from a profiler
trace) and GB/s of the 11 bytes/element the update must move.
"""
from __future__ import annotations

import argparse
import functools
import glob
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.kernels import adam_update as K
from fp8jax.optim.rounding import hash32


def _time(fn, *args, iters: int):
  """Median wall ms per call; on a GPU, GPU kernel ms per call from a profiler trace."""
  out = fn(*args)
  jax.block_until_ready(out)
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    times.append(time.perf_counter() - t0)
  if jax.default_backend() != "gpu":
    return 1e3 * float(np.median(times))
  from profile_step import gpu_kernels
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(iters):
        out = fn(*args)
      jax.block_until_ready(out)
    path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    return sum(us for _, us in gpu_kernels(path)) / iters / 1e3


def _inputs(n: int):
  k = jax.random.split(jax.random.key(0), 4)
  g = (jax.random.normal(k[0], (n,)) * 100).astype(jnp.float8_e4m3fn)
  mu = (jax.random.normal(k[1], (n,)) * 50).astype(jnp.float8_e4m3fn)
  nu = jnp.abs(jax.random.normal(k[2], (n,)) * 1000).astype(jnp.float16)
  w = (jax.random.normal(k[3], (n,)) * 1000).astype(jnp.float16)
  s = jnp.array([1e-5, 1e-2, 1e-6, 50.0, 1e-6, 1e6, 0.1, 3e-5, 1e-8, 0.1, -1e-4, 1.0,
                 1e-5, 1e-5, 1e5], jnp.float32)
  return g, mu, nu, w, s, jnp.array([7], jnp.uint32)


@functools.lru_cache(maxsize=None)
def _kernel_call(variant: str, block: int, warps: int, stages: int):
  """A jitted pallas_call of the update kernel with `variant`'s math."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt
  from jax import lax

  def body(g_ref, mu_ref, nu_ref, w_ref, s_ref, seed_ref, mu_out, nu_out, w_out, amax_out):
    if variant == "copy":
      mu_out[...] = mu_ref[...]
      nu_out[...] = nu_ref[...]
      w_out[...] = (w_ref[...].astype(jnp.float32) + g_ref[...].astype(jnp.float32)
                    ).astype(w_ref.dtype)
      amax_out[...] = jnp.zeros((1,), jnp.float32)
      return
    s = [s_ref[i] for i in range(K.NUM_SCALARS)]
    words = set(variant.split())

    index = (pl.program_id(0).astype(jnp.uint32) * jnp.uint32(block)
             + lax.broadcasted_iota(jnp.uint32, (block,), 0))

    def write():
      saved = K.round_with_bits, K.index_bits
      try:
        if "nearest" in words:
          K.round_with_bits = lambda y, dtype, bits: y.astype(dtype)
        if "no-hash" in words:
          K.index_bits = lambda i, seed: i ^ seed
        if "hash32" in words:  # the previous bits: two rounds of hash32 per element
          K.index_bits = lambda i, seed: hash32(i ^ hash32(seed ^ jnp.uint32(0x9E3779B9)))
        fn = K.update_math if "when" in words else K.update_reference
        new_mu, new_nu, new_w, mag = fn(g_ref[...], mu_ref[...], nu_ref[...], w_ref[...], s,
                                        seed_ref[0], index, 0.9, 0.999)
      finally:
        K.round_with_bits, K.index_bits = saved
      mu_out[...] = new_mu
      nu_out[...] = new_nu
      w_out[...] = new_w
      if "no-amax" in words:
        amax_out[...] = jnp.zeros((1,), jnp.float32)
      else:
        amax_out[...] = jnp.broadcast_to(jnp.max(mag), (1,))
    if "when" in words:
      pl.when(s[K.S_OK] > 0)(write)
    else:
      write()

  def call(g, mu, nu, w, s, seed):
    s = K.scalar_table([s])  # padded to a power of two (a Triton block)
    n = g.shape[0]
    grid = n // block
    vec = pl.BlockSpec((block,), lambda i: (i,))
    return pl.pallas_call(
        body, grid=(grid,),
        in_specs=[vec, vec, vec, vec, pl.BlockSpec(s.shape, lambda i: (0,)),
                  pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=[vec, vec, vec, pl.BlockSpec((1,), lambda i: (i,))],
        out_shape=[jax.ShapeDtypeStruct((n,), mu.dtype), jax.ShapeDtypeStruct((n,), nu.dtype),
                   jax.ShapeDtypeStruct((n,), w.dtype),
                   jax.ShapeDtypeStruct((grid,), jnp.float32)],
        compiler_params=plt.CompilerParams(num_warps=warps, num_stages=stages))(
            g, mu, nu, w, s, seed)
  return jax.jit(call)


def _xla_update(g, mu, nu, w, s, seed):
  index = jnp.arange(g.shape[0], dtype=jnp.uint32)
  m2, v2, w2, mag = K.update_reference(g, mu, nu, w, s, seed[0], index, 0.9, 0.999)
  return m2, v2, w2, jnp.max(mag)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--n", type=int, default=2 ** 28)
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args(argv)
  n = args.n
  x = _inputs(n)
  moved = 11 * n
  dev = jax.devices()[0]
  print(f"{dev.device_kind}, jax {jax.__version__}, N={n:,}, 11 B/element = {moved / 2**30:.2f} GiB")
  rows = [("xla update_reference (one fusion?)", _time(jax.jit(_xla_update), *x,
                                                        iters=args.iters))]
  if jax.default_backend() != "gpu":
    print(f"{rows[0][0]}: {rows[0][1]:.3f} ms; not a GPU: kernels skipped")
    return
  variants = [("full hash32", 2048, 8, 1), ("copy", 2048, 8, 1), ("when hash32", 2048, 8, 1),
              ("when", 2048, 8, 1), ("when no-amax", 2048, 8, 1),
              ("when nearest no-amax", 2048, 8, 1), ("when", 1024, 4, 1), ("when", 2048, 4, 1),
              ("when", 4096, 8, 1), ("when", 1024, 8, 1)]
  for v, block, warps, stages in variants:
    try:
      ms = _time(_kernel_call(v, block, warps, stages), *x, iters=args.iters)
      rows.append((f"pallas {v} {block}x{warps} st{stages}", ms))
    except Exception as e:  # noqa: BLE001
      rows.append((f"pallas {v} {block}x{warps} st{stages}: {type(e).__name__} {str(e)[:120]}", None))
  donated = jax.jit(functools.partial(K.adam_master_update, row=0, offset=0, b1=0.9, b2=0.999),
                    donate_argnums=(1, 2, 3, 6))
  g, mu, nu, w, sc, seed = x
  state = (mu + 0, nu + 0, w + 0, jnp.zeros((n // K.BLOCK,), jnp.float32))
  table = K.scalar_table([sc])

  scales = tuple(jnp.ones((1,), jnp.float32) for _ in range(3))

  def shipped(*state):
    *out, _ = donated(g, *state[:3], table, seed, state[3], scales)
    return tuple(out)
  for _ in range(3):
    state = shipped(*state)
  jax.block_until_ready(state)
  from profile_step import gpu_kernels
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(args.iters):
        state = shipped(*state)
      jax.block_until_ready(state)
    path = glob.glob(os.path.join(d, "**", "perfetto_trace.json.gz"), recursive=True)[0]
    ms = sum(us for _, us in gpu_kernels(path)) / args.iters / 1e3
  rows.append(("shipped kernel, donated (in place)", ms))
  del state
  amax8 = jax.jit(lambda a: jnp.max(jnp.abs(a.astype(jnp.float32))))
  rows.append(("xla amax of E4M3 payload (1 B/elem)", _time(amax8, x[0], iters=args.iters)))
  copy16 = jax.jit(lambda a: a + jnp.float16(1))
  rows.append(("xla f16 a+1 (4 B/elem)", _time(copy16, x[3], iters=args.iters)))
  print("| variant | ms | GB/s of 11 B/elem |")
  print("|---|---|---|")
  for name, ms in rows:
    print(f"| {name} | {'-' if ms is None else f'{ms:.3f}'} | "
          f"{'-' if ms is None else f'{moved / ms / 1e6:.0f}'} |")


if __name__ == "__main__":
  main()
