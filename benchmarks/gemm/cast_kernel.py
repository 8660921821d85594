"""Fused FP8 cast+transpose+amax kernel vs XLA's passes, and its effect on an MLP block (GPU).

  source benchmarks/gpu_env.sh && python benchmarks/gemm/cast_kernel.py

(a) x[M, K] bf16 -> (q, q_t, amax) in E4M3: the Pallas kernel (several tilings) vs the XLA
    reference (compute_amax + quantize + transposed copy), checked bit-equal on the device;
    ms per call and GB/s counting 2 bytes read + 2 fp8 bytes written per element.
(b) MLP block forward+backward (``fp8jax.bench.mlp``'s block) with Recipe.fused_cast_transpose
    False vs True: median ms, ratio, number of Triton (Pallas) and cuBLASLt FP8 calls, and
    the largest relative difference of the gradients between the two.
Each part runs under try/except, so one failure still prints the rest.
"""
from __future__ import annotations

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
  print(f"devices: {[dv.device_kind for dv in jax.devices()]}  jax {jax.__version__}  "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  t0 = time.perf_counter()
  for part in (part_a, part_b):
    try:
      part()
    except Exception:  # noqa: BLE001
      print(f"{part.__name__}: FAILED\n{traceback.format_exc()[-2500:]}", flush=True)
  print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
  main()
