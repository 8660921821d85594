"""Fused FP8 cast+transpose+amax kernel vs XLA's passes, and its effect on an MLP block (GPU).

  source benchmarks/gpu_env.sh && python benchmarks/gemm/cast_kernel.py [--parts a,b,c]

(a) x[M, K] bf16 -> (q, q_t, amax) in E4M3: the Pallas kernel (several tilings) vs the XLA
    reference (compute_amax + quantize + transposed copy), checked bit-equal on the device;
    ms per call and GB/s counting 2 bytes read + 2 fp8 bytes written per element.
(b) MLP block forward+backward (``fp8jax.bench.mlp``'s block) with Recipe.fused_cast_transpose
    False vs True: median ms, ratio, number of Triton (Pallas) and cuBLASLt FP8 calls, and
    the largest relative difference of the gradients between the two.
(c) The kernel against copy ceilings at the same bytes (x[M, K] bf16 read, 2 bytes written
    per element): a device memcpy (``jnp.copy``), XLA's elementwise ``x + 1`` and transpose,
    the shipped kernel (plain and with GELU inside), and the same kernel with zeros stored in
    place of the transposed copy (what the transpose itself costs); three rounds, ms each.
Each part runs under try/except, so one failure still prints the rest; ``--parts a,c`` picks.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import fp8jax  # noqa: E402
from benchmarks.common.calls import ms_per_call  # noqa: E402
from fp8jax.bench import mlp as mb  # noqa: E402
from fp8jax.bench.timing import FP8_GEMM, custom_calls, rel_err, time_calls  # noqa: E402
from fp8jax.kernels import cast_transpose as ct  # noqa: E402

SHAPES = [(16384, 2048), (16384, 8192), (2048, 8192)]
TILINGS = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 4), (128, 128, 8)]
FMT = jnp.float8_e4m3fn


def _same(out, ref) -> bool:
  """q bit-equal (NaN positions equal), q_t == q^T, amax equal."""
  q, qt, a = (np.asarray(v) for v in out)
  rq, rqt, ra = (np.asarray(v) for v in ref)
  nan = np.isnan(rq.astype(np.float32))
  ok = np.array_equal(np.isnan(q.astype(np.float32)), nan)
  ok &= np.array_equal(q.view(np.uint8)[~nan], rq.view(np.uint8)[~nan])
  ok &= np.array_equal(qt.view(np.uint8), q.view(np.uint8).T)
  return bool(ok and (float(a) == float(ra) or (np.isnan(a) and np.isnan(ra))))


def part_a():
  print("\n(a) cast+transpose+amax, bf16 -> E4M3 (ms per call, GB/s at 4 bytes/element)")
  print(f"{'M x K':>13s} {'impl':>16s} {'ms':>8s} {'GB/s':>7s} {'x XLA':>6s} {'bit-equal':>9s}")
  ref_fn = jax.jit(functools.partial(ct.cast_transpose_reference, fmt=FMT))
  for m, k in SHAPES:
    try:
      x = jax.random.normal(jax.random.key(m + k), (m, k), jnp.float32).astype(jnp.bfloat16)
      x = x.at[7, 3].set(jnp.inf)  # saturating value; amax = inf path is exercised
      scale = jnp.float32(float(jnp.max(jnp.abs(x[8:]).astype(jnp.float32))) / 448.0)
      gb = 4.0 * m * k / 1e9
      ref = ref_fn(x, scale)
      t_ref = ms_per_call(ref_fn, (x, scale))
      print(f"{m:6d}x{k:<6d} {'xla':>16s} {t_ref:8.3f} {gb / t_ref * 1e3:7.0f} {1.0:6.2f} "
            f"{'ref':>9s}", flush=True)
      for bm, bk, warps in TILINGS:
        name = f"pallas {bm}x{bk}/w{warps}"
        try:
          fn = jax.jit(functools.partial(ct.cast_transpose_amax, fmt=FMT, block_m=bm,
                                         block_k=bk, num_warps=warps))
          same = _same(fn(x, scale), ref)
          t = ms_per_call(fn, (x, scale))
          print(f"{'':13s} {name:>16s} {t:8.3f} {gb / t * 1e3:7.0f} {t_ref / t:6.2f} "
                f"{str(same):>9s}", flush=True)
        except Exception as e:  # noqa: BLE001
          print(f"{'':13s} {name:>16s} FAILED: {type(e).__name__}: {str(e)[:600]}", flush=True)
    except Exception:  # noqa: BLE001
      print(f"{m}x{k}: FAILED\n{traceback.format_exc()[-2000:]}", flush=True)


def _no_transpose_kernel(block_m: int, block_k: int, num_warps: int):
  """x[M, K] -> (q, zeros[K, M], amax): the shipped kernel's loads, math and stores, with the
  transposed copy's tile stored as zeros (same bytes written, no transposition)."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as plt
  from fp8jax import scaling

  def kernel(inv_ref, x_ref, q_ref, qt_ref, amax_ref):
    x = x_ref[...].astype(jnp.float32)
    q_ref[...] = ct._clip_keeping_nan(x * inv_ref[...], scaling.fp8_max(FMT)).astype(FMT)
    qt_ref[...] = jnp.zeros(qt_ref.shape, FMT)
    amax_ref[...] = ct._tile_amax(x)

  @jax.jit
  def fn(x, scale):
    m, k = x.shape
    q, qt, partial = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((m, k), FMT), jax.ShapeDtypeStruct((k, m), FMT),
                   jax.ShapeDtypeStruct((m // block_m, k // block_k), jnp.float32)),
        grid=(m // block_m, k // block_k),
        in_specs=[pl.BlockSpec((None,), lambda i, j: (0,)),
                  pl.BlockSpec((block_m, block_k), lambda i, j: (i, j))],
        out_specs=(pl.BlockSpec((block_m, block_k), lambda i, j: (i, j)),
                   pl.BlockSpec((block_k, block_m), lambda i, j: (j, i)),
                   pl.BlockSpec((None, None), lambda i, j: (i, j))),
        compiler_params=plt.CompilerParams(num_warps=num_warps))((1.0 / scale).reshape(1), x)
    return q, qt, jnp.max(partial)
  return fn


def part_c():
  print("\n(c) the kernel against copy ceilings (ms per call, three rounds; GB/s of the best at "
        "4 bytes/element)")
  for m, k in SHAPES[:2]:
    x = jax.random.normal(jax.random.key(m + k), (m, k), jnp.float32).astype(jnp.bfloat16)
    scale = jnp.float32(4.0 / 448.0)
    gb = 4.0 * m * k / 1e9
    fns = {
        "memcpy (jnp.copy)": (jax.jit(jnp.copy), (x,)),
        "XLA x + 1": (jax.jit(lambda v: v + jnp.bfloat16(1)), (x,)),
        "XLA transpose": (jax.jit(lambda v: jnp.swapaxes(v, 0, 1)), (x,)),
        "kernel": (jax.jit(functools.partial(ct.cast_transpose_amax, fmt=FMT)), (x, scale)),
        "kernel, GELU inside": (jax.jit(functools.partial(
            ct.cast_transpose_amax, fmt=FMT, activation="gelu")), (x, scale)),
        "kernel, zeros for q_t": (_no_transpose_kernel(ct.BLOCK_M, ct.BLOCK_K, ct.NUM_WARPS),
                                  (x, scale)),
    }
    times = {name: [] for name in fns}
    for _ in range(3):  # rounds interleave the variants: drift shows as spread, not as bias
      for name, (fn, args) in fns.items():
        times[name].append(ms_per_call(fn, args))
    print(f"{m:6d}x{k}")
    for name, ts in times.items():
      print(f"  {name:24s} {' '.join(f'{t:.4f}' for t in ts)}  {gb / min(ts) * 1e3:6.0f}",
            flush=True)


def part_b():
  from fp8jax.linen import Fp8DotGeneral
  print("\n(b) MLP block fwd+bwd, Recipe.fused_cast_transpose False vs True")
  print(f"{'T,D,F':>18s} {'fused':>6s} {'ms(med)':>8s} {'x off':>6s} {'#triton':>7s} "
        f"{'#f8gemm':>7s} {'max rel diff':>12s}")
  for t_, d, f in [(16384, 2048, 8192), (16384, 8192, 28672)]:
    try:
      kx, kc, kp = jax.random.split(jax.random.key(0), 3)
      x = jax.random.normal(kx, (t_, d), jnp.float32).astype(jnp.bfloat16)
      ct_ = jax.random.normal(kc, (t_, d), jnp.float32).astype(jnp.bfloat16)
      params = mb.MLP(f, d).init(kp, x)["params"]
      base, first = None, None
      for fused in (False, True):
        recipe = fp8jax.Recipe(fused_cast_transpose=fused)
        model = mb.MLP(f, d, functools.partial(Fp8DotGeneral, recipe=recipe))
        variables = {**model.init(kp, x), "params": params}
        step = mb.block_step(model)
        calls = custom_calls(step.lower(variables, x, ct_).compile().as_text())
        n_tri = sum(v for k_, v in calls.items() if "triton" in k_)
        for _ in range(2):  # warm delayed scales, as in training
          dv, _, _ = step(variables, x, ct_)
          variables = mb.carry_fp8_state(variables, dv)
        out = step(variables, x, ct_)
        grads = [out[1]] + [out[0]["params"][k]["kernel"] for k in ("Dense_0", "Dense_1")]
        if first is None:
          first, diff = grads, 0.0
        else:
          diff = max(rel_err(a, b) for a, b in zip(grads, first))
        med = time_calls(lambda: step(variables, x, ct_), 10).median
        base = base or med
        print(f"{f'{t_},{d},{f}':>18s} {str(fused):>6s} {med:8.2f} {base / med:6.2f} {n_tri:7d} "
              f"{calls.get(FP8_GEMM, 0):7d} {diff:12.2e}", flush=True)
    except Exception:  # noqa: BLE001
      print(f"{t_},{d},{f}: FAILED\n{traceback.format_exc()[-2500:]}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--parts", default="a,b,c", help="comma-separated parts to run (a, b, c)")
  parts = {"a": part_a, "b": part_b, "c": part_c}
  chosen = parser.parse_args().parts.split(",")
  if unknown := [p for p in chosen if p not in parts]:
    parser.error(f"unknown parts {unknown}; choose from {sorted(parts)}")
  print(f"devices: {[dv.device_kind for dv in jax.devices()]}  jax {jax.__version__}  "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  t0 = time.perf_counter()
  for part in (parts[p] for p in chosen):
    try:
      part()
    except Exception:  # noqa: BLE001
      print(f"{part.__name__}: FAILED\n{traceback.format_exc()[-2500:]}", flush=True)
  print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
