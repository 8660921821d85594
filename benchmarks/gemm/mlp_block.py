"""Times an MLP block's forward+backward in BF16, with Flax's FP8 op and with fp8jax.

Block: x[T, D] -> Dense(F) -> GELU -> Dense(D), bf16 activations and weights, gradients of
input and both weights (and of the FP8 state, as training does). Default shape is the
LLM-scale one of the foundation issue: T=16384, D=8192, F=28672.

  python benchmarks/mlp_block.py [--tokens T --model D --hidden F --iters N]

Prints one row per mode: median ms per step, TFLOP/s, speed-up over bf16 and over Flax's
Fp8DirectDotGeneralOp, number of cuBLASLt FP8 GEMMs in the compiled program, and the relative
error of the gradients vs an f32 (HIGHEST precision) computation of the same block.
XLA_FLAGS are read once per process: run the script once per flag set (see run_gpu.sh).
"""
from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
from flax.linen import fp8_ops

import fp8jax
import fp8jax.dot as fdot
import fp8jax.scaling as fscaling
from fp8jax.linen import Fp8DotGeneral

FP8_GEMM = "__cublas$lt$matmul$f8"
_ORIGINAL_MM = fdot._mm


class MLP(nn.Module):
  hidden: int
  model: int
  dot_general_cls: object = None

  @nn.compact
  def __call__(self, x):
    kw = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
              dot_general_cls=self.dot_general_cls)
    h = nn.gelu(nn.Dense(self.hidden, **kw)(x))
    return nn.Dense(self.model, **kw)(h)


def _mm_f32_out(a, b, contract, scale, out_dtype, native, fast_accum, out_sharding=None):
  """GEMM variant: f32 GEMM output, scaled in f32, then cast (more temp memory)."""
  if not native:
    return _ORIGINAL_MM(a, b, contract, scale, out_dtype, native, fast_accum, out_sharding)
  batch = ((0,), (0,)) if a.ndim == 3 else ((), ())
  dn = (((contract[0],), (contract[1],)), batch)
  precision = jax.lax.Precision.DEFAULT if fast_accum else jax.lax.Precision.HIGHEST
  y = jax.lax.dot_general(a, b, dn, precision=precision, preferred_element_type=jnp.float32)
  return (y * scale).astype(out_dtype)


def _mm_fast_bwd(a, b, contract, scale, out_dtype, native, fast_accum, out_sharding=None):
  """GEMM variant: fast (reduced-precision) accumulation in the backward GEMMs too."""
  return _ORIGINAL_MM(a, b, contract, scale, out_dtype, native, True, out_sharding)


VARIANTS = {"fp8jax_f32out": _mm_f32_out, "fp8jax_fastbwd": _mm_fast_bwd}
_ORIGINAL_SCALE_FOR_CAST = fscaling.scale_for_cast


def _delayed_only(meta, amax, recipe, fmt):
  """Scale variant: pure delayed scaling, no just-in-time scale for a never-observed meta
  (quantization then needs no pass over the tensor before its amax is known)."""
  return meta.scale


def custom_calls(hlo: str) -> dict:
  """{custom-call target: count} in compiled HLO text."""
  import re
  out = {}
  for t in re.findall(r'custom_call_target="([^"]+)"', hlo):
    out[t] = out.get(t, 0) + 1
  return out


def make_step(model):
  def step(variables, x, ct):
    def f(v, x):
      return model.apply(v, x)
    y, vjp = jax.vjp(f, variables, x)
    return vjp(ct)
  return jax.jit(step)


def median_ms(fn, args, iters):
  jax.block_until_ready(fn(*args))
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(ts)), 1e3 * float(np.min(ts))


def rel(a, b):
  a = np.asarray(a, np.float32).astype(np.float64)
  b = np.asarray(b, np.float32).astype(np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", type=int, default=16384)
  p.add_argument("--model", type=int, default=8192)
  p.add_argument("--hidden", type=int, default=28672)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--modes", default="bf16,flax_fp8,fp8jax,fp8jax_nofallback,fp8jax_fastbwd,fp8jax_f32out")
  a = p.parse_args()
  T, D, F = a.tokens, a.model, a.hidden
  flops = 3 * 2 * (2 * T * D * F)  # fwd + dgrad + wgrad of two GEMMs
  print(f"devices: {[d.device_kind for d in jax.devices()]}  jax {jax.__version__}")
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"MLP block T={T} D={D} F={F}: {flops / 1e12:.1f} TFLOP per fwd+bwd")

  kx, kc, kp = jax.random.split(jax.random.key(0), 3)
  # Drawn in f32, then rounded: bf16 draws take only ~128 distinct values, whose systematic
  # FP8 rounding errors add up coherently over long contractions.
  x = jax.random.normal(kx, (T, D), jnp.float32).astype(jnp.bfloat16)
  ct = jax.random.normal(kc, (T, D), jnp.float32).astype(jnp.bfloat16)
  models = {
      "bf16": MLP(F, D),
      "flax_fp8": MLP(F, D, fp8_ops.Fp8DirectDotGeneralOp),
      "fp8jax": MLP(F, D, functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())),
      "fp8jax_f32out": MLP(F, D, functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())),
      "fp8jax_fastbwd": MLP(F, D, functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())),
      "fp8jax_nofallback": MLP(F, D, functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())),
  }
  params = models["bf16"].init(kp, x)["params"]

  # f32 reference gradients (HIGHEST precision) of the same block on the same data.
  def ref_step(p, x, ct):
    def block(p, x):
      h = nn.gelu(jnp.dot(x, p["Dense_0"]["kernel"], precision="highest"))
      return jnp.dot(h, p["Dense_1"]["kernel"], precision="highest")
    _, vjp = jax.vjp(block, p, x)
    return vjp(ct)
  p32 = jax.tree.map(lambda t: t.astype(jnp.float32), params)
  ref_dp, ref_dx = jax.jit(ref_step)(p32, x.astype(jnp.float32), ct.astype(jnp.float32))

  rows = []
  base = {}
  for mode in a.modes.split(","):
    model = models[mode]
    fdot._mm = VARIANTS.get(mode, _ORIGINAL_MM)
    fscaling.scale_for_cast = (_delayed_only if mode == "fp8jax_nofallback"
                               else _ORIGINAL_SCALE_FOR_CAST)
    variables = model.init(kp, x)
    variables = {**variables, "params": params}
    step = make_step(model)
    t0 = time.perf_counter()
    compiled = step.lower(variables, x, ct).compile()
    print(f"  {mode}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
    calls = custom_calls(compiled.as_text())
    n_f8 = calls.get(FP8_GEMM, 0)
    print(f"  {mode}: custom calls {calls}", flush=True)
    mem = compiled.memory_analysis()
    temp_gib = getattr(mem, "temp_size_in_bytes", 0) / 2**30 if mem is not None else float("nan")
    # Two steps with state carried so delayed scales are warm, as in training.
    for _ in range(2):
      dv, dx = step(variables, x, ct)
      for col in ("fp8_meta", fp8_ops.OVERWRITE_WITH_GRADIENT):
        if col in dv:
          variables = {**variables, col: dv[col]}
    dv, dx = step(variables, x, ct)
    err = max(rel(dx, ref_dx), rel(dv["params"]["Dense_0"]["kernel"], ref_dp["Dense_0"]["kernel"]),
              rel(dv["params"]["Dense_1"]["kernel"], ref_dp["Dense_1"]["kernel"]))
    med, best = median_ms(step, (variables, x, ct), a.iters)
    base.setdefault(mode, med)
    rows.append((mode, med, best, flops / med / 1e9, n_f8, err, temp_gib))
  fdot._mm = _ORIGINAL_MM
  fscaling.scale_for_cast = _ORIGINAL_SCALE_FOR_CAST

  print()
  print(f"{'mode':16s} {'ms(med)':>9s} {'ms(min)':>9s} {'TFLOP/s':>8s} {'xBF16':>6s} "
        f"{'xFlax':>6s} {'#f8gemm':>7s} {'grad err':>9s} {'temp GiB':>8s}")
  for mode, med, best, tf, n_f8, err, temp in rows:
    xb = base["bf16"] / med if "bf16" in base else float("nan")
    xf = base["flax_fp8"] / med if "flax_fp8" in base else float("nan")
    print(f"{mode:16s} {med:9.2f} {best:9.2f} {tf:8.0f} {xb:6.2f} {xf:6.2f} {n_f8:7d} "
          f"{err:9.2e} {temp:8.2f}")


if __name__ == "__main__":
  main()
