"""Where the fused O2 optimizer kernel's time goes: variants of it on one tensor, one GPU.

  python benchmarks/optim/adam_kernel.py [--n 268435456] [--iters 20]

Times, on one tensor of N elements (E4M3 gradient, E4M3 u, FP16 r, FP16 master weight): the
shipped kernel in place (``fp8jax.kernels.adam_update.adam_master_update``, donated), the
same per-element math (``update_math``: a skipped step is a ``pl.when``) in a pallas_call
written here at several tilings and without the block amax, a copy kernel moving the same
bytes (the bandwidth ceiling of a 1-D Pallas/Triton kernel), the same per-element function
through XLA (``update_reference``), and the amax passes the step runs before the kernel.
Prints GPU kernel ms per call (from a profiler trace) and GB/s of the 11 bytes/element the
update must move.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import trace  # noqa: E402
from fp8jax.kernels import adam_update as K  # noqa: E402


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
  _, kernels = trace.traced_kernels(lambda: fn(*args), iters)
  return trace.kernel_ms(kernels, iters)


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
  """A jitted pallas_call of the update kernel's math: "math" (as shipped), "no-amax" (the
  block amax not computed) or "copy" (the same bytes moved, no math)."""
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
    index = (pl.program_id(0).astype(jnp.uint32) * jnp.uint32(block)
             + lax.broadcasted_iota(jnp.uint32, (block,), 0))

    def write():
      new_mu, new_nu, new_w, mag = K.update_math(g_ref[...], mu_ref[...], nu_ref[...],
                                                 w_ref[...], s, seed_ref[0], index, 0.9, 0.999)
      mu_out[...] = new_mu
      nu_out[...] = new_nu
      w_out[...] = new_w
      if variant == "no-amax":
        amax_out[...] = jnp.zeros((1,), jnp.float32)
      else:
        amax_out[...] = jnp.broadcast_to(jnp.max(mag), (1,))
    pl.when(s[K.S_OK] > 0)(write)

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
  print(f"{dev.device_kind}, jax {jax.__version__}, N={n:,}, "
        f"11 B/element = {moved / 2**30:.2f} GiB")
  rows = [("xla update_reference (one fusion?)", _time(jax.jit(_xla_update), *x,
                                                        iters=args.iters))]
  if jax.default_backend() != "gpu":
    print(f"{rows[0][0]}: {rows[0][1]:.3f} ms; not a GPU: kernels skipped")
    return
  variants = [("copy", 2048, 8, 1), ("math", 2048, 8, 1), ("no-amax", 2048, 8, 1),
              ("math", 1024, 4, 1), ("math", 2048, 4, 1), ("math", 4096, 8, 1),
              ("math", 1024, 8, 1)]
  for v, block, warps, stages in variants:
    try:
      ms = _time(_kernel_call(v, block, warps, stages), *x, iters=args.iters)
      rows.append((f"pallas {v} {block}x{warps} st{stages}", ms))
    except Exception as e:  # noqa: BLE001
      rows.append((f"pallas {v} {block}x{warps} st{stages}: {type(e).__name__} "
                   f"{str(e)[:120]}", None))
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
  carry = [state]

  def one_call():
    carry[0] = shipped(*carry[0])
    return carry[0]
  state, kernels = trace.traced_kernels(one_call, args.iters)
  ms = trace.kernel_ms(kernels, args.iters)
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
