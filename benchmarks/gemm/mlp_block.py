"""Times an MLP block's forward+backward in BF16, with Flax's FP8 op and with fp8jax (GPU).

Block: x[T, D] -> Dense(F) -> GELU -> Dense(D), bf16 activations and weights, gradients of
input and both weights (and of the FP8 state, as training does). Default shape is an
LLM-scale one: T=16384, D=8192, F=28672.

  python benchmarks/gemm/mlp_block.py [--tokens T --model D --hidden F --iters N] [--modes ...]

Modes (each fp8jax mode is `fp8jax.linen.Fp8DotGeneral` with one `fp8jax.Recipe`):

  bf16               nn.Dense in bf16
  flax_fp8           Flax's Fp8DirectDotGeneralOp
  fp8jax             Recipe(): delayed scaling, just-in-time scale for a never-observed state
  fp8jax_calibrated  Recipe(calibrated=True): stored scales only (the Trainer's steady step)
  fp8jax_fastbwd     Recipe(bwd_fast_accumulation=True): fast accumulation in backward GEMMs
  fp8jax_fused       Recipe(fused_cast_transpose=True): the fused cast+transpose+amax kernel
  gemms_bf16         the block's six GEMMs alone (fwd, dgrad, wgrad of both), bf16 operands
  gemms_fp8          the same GEMMs with FP8 operands cast beforehand (E4M3, E5M2 gradients),
                     bf16 GEMM output: what the FP8 GEMMs cost without casts or scaling state
  gemms_fp8_f32out   the same with an f32 GEMM output, scaled in f32, then cast to bf16

Prints one row per mode: median ms per step, TFLOP/s, speed-up over bf16 and over Flax's
Fp8DirectDotGeneralOp, number of cuBLASLt FP8 GEMMs in the compiled program, the relative
error of the gradients vs an f32 (HIGHEST precision) computation of the same block (block
modes) and the compiled program's temporary memory.
XLA_FLAGS are read once per process: run the script once per flag set (see gpu_env.sh).
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
import flax.linen as nn  # noqa: E402
from flax.linen import fp8_ops  # noqa: E402

import fp8jax  # noqa: E402
from benchmarks.common.hlo import custom_calls  # noqa: E402
from fp8jax.linen import Fp8DotGeneral  # noqa: E402

FP8_GEMM = "__cublas$lt$matmul$f8"
RECIPES = {"fp8jax": fp8jax.Recipe(), "fp8jax_calibrated": fp8jax.Recipe(calibrated=True),
           "fp8jax_fastbwd": fp8jax.Recipe(bwd_fast_accumulation=True),
           "fp8jax_fused": fp8jax.Recipe(fused_cast_transpose=True)}
GEMM_MODES = ("gemms_bf16", "gemms_fp8", "gemms_fp8_f32out")
DEFAULT_MODES = ("bf16,flax_fp8,fp8jax,fp8jax_calibrated,fp8jax_fastbwd,gemms_bf16,gemms_fp8,"
                 "gemms_fp8_f32out")


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


def make_model(mode: str, hidden: int, model: int) -> MLP:
  if mode == "bf16":
    return MLP(hidden, model)
  if mode == "flax_fp8":
    return MLP(hidden, model, fp8_ops.Fp8DirectDotGeneralOp)
  if mode in RECIPES:
    return MLP(hidden, model, functools.partial(Fp8DotGeneral, recipe=RECIPES[mode]))
  raise SystemExit(f"--modes: unknown mode {mode!r}; use any of {DEFAULT_MODES}, fp8jax_fused")


def _gemm(a, b, contract, scale, out_dtype, fast: bool):
  """scale * (a @ b) contracting a's axis contract[0] with b's contract[1], cast to bf16."""
  dn = (((contract[0],), (contract[1],)), ((), ()))
  precision = jax.lax.Precision.DEFAULT if fast else jax.lax.Precision.HIGHEST
  y = jax.lax.dot_general(a, b, dn, precision=precision, preferred_element_type=out_dtype)
  return (y * scale.astype(out_dtype)).astype(jnp.bfloat16)


def gemms_step(out_dtype):
  """The block's six GEMMs on prepared operands: forward x@W0, h@W1; input gradients
  g_y@W1^T, g_h@W0^T; weight gradients h^T@g_y, x^T@g_h. FP8 operands are fed straight to
  ``lax.dot_general`` (XLA rewrites that to cuBLASLt FP8 GEMMs)."""
  def step(x, w0, h, w1, gy, gh, scale):
    fp8 = x.dtype != jnp.bfloat16
    return (_gemm(x, w0, (1, 0), scale, out_dtype, True),
            _gemm(h, w1, (1, 0), scale, out_dtype, True),
            _gemm(gy, w1, (1, 1), scale, out_dtype, not fp8),
            _gemm(gh, w0, (1, 1), scale, out_dtype, not fp8),
            _gemm(h, gy, (0, 0), scale, out_dtype, not fp8),
            _gemm(x, gh, (0, 0), scale, out_dtype, not fp8))
  return jax.jit(step)


def gemm_operands(mode: str, x, params, h, gy, gh):
  """(x, W0, h, W1, g_y, g_h, scale) in the mode's operand types."""
  w0, w1 = params["Dense_0"]["kernel"], params["Dense_1"]["kernel"]
  args = (x, w0, h, w1, gy, gh)
  if mode == "gemms_bf16":
    return args + (jnp.float32(1.0),)
  e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  cast = jax.jit(lambda *a: tuple(v.astype(t) for v, t in zip(a, (e4, e4, e4, e4, e5, e5))))
  return cast(*args) + (jnp.float32(1.0),)


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


def time_block(mode, x, ct, params, ref, kp, hidden, model, iters):
  """(median ms, min ms, #FP8 GEMMs, gradient error, temp GiB) of one block mode."""
  net = make_model(mode, hidden, model)
  variables = {**net.init(kp, x), "params": params}
  step = make_step(net)
  t0 = time.perf_counter()
  compiled = step.lower(variables, x, ct).compile()
  print(f"  {mode}: compiled in {time.perf_counter() - t0:.1f} s", flush=True)
  calls = custom_calls(compiled.as_text())
  print(f"  {mode}: custom calls {calls}", flush=True)
  # Two steps with state carried so delayed scales are warm, as in training.
  for _ in range(2):
    dv, dx = step(variables, x, ct)
    for col in ("fp8_meta", fp8_ops.OVERWRITE_WITH_GRADIENT):
      if col in dv:
        variables = {**variables, col: dv[col]}
  dv, dx = step(variables, x, ct)
  ref_dp, ref_dx = ref
  err = max(rel(dx, ref_dx),
            *(rel(dv["params"][k]["kernel"], ref_dp[k]["kernel"]) for k in ("Dense_0", "Dense_1")))
  med, best = median_ms(step, (variables, x, ct), iters)
  return med, best, calls.get(FP8_GEMM, 0), err, temp_gib(compiled)


def time_gemms(mode, x, ct, params, key, hidden, iters):
  """The same row for the GEMMs-only modes (no gradient error: no block is computed)."""
  kh, kg = jax.random.split(key)
  h = jax.random.normal(kh, (x.shape[0], hidden), jnp.float32).astype(jnp.bfloat16)
  gh = jax.random.normal(kg, (x.shape[0], hidden), jnp.float32).astype(jnp.bfloat16)
  args = gemm_operands(mode, x, params, h, ct, gh)
  step = gemms_step(jnp.float32 if mode == "gemms_fp8_f32out" else jnp.bfloat16)
  compiled = step.lower(*args).compile()
  calls = custom_calls(compiled.as_text())
  print(f"  {mode}: custom calls {calls}", flush=True)
  med, best = median_ms(step, args, iters)
  return med, best, calls.get(FP8_GEMM, 0), None, temp_gib(compiled)


def temp_gib(compiled) -> float:
  mem = compiled.memory_analysis()
  return getattr(mem, "temp_size_in_bytes", 0) / 2**30 if mem is not None else float("nan")


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, default=16384)
  p.add_argument("--model", type=int, default=8192)
  p.add_argument("--hidden", type=int, default=28672)
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--modes", default=DEFAULT_MODES, help="comma separated (see the docstring)")
  a = p.parse_args()
  T, D, F = a.tokens, a.model, a.hidden
  flops = 3 * 2 * (2 * T * D * F)  # fwd + dgrad + wgrad of two GEMMs
  print(f"devices: {[d.device_kind for d in jax.devices()]}  jax {jax.__version__}")
  print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
  print(f"MLP block T={T} D={D} F={F}: {flops / 1e12:.1f} TFLOP per fwd+bwd")

  kx, kc, kp, kg = jax.random.split(jax.random.key(0), 4)
  # Drawn in f32, then rounded: bf16 draws take only ~128 distinct values, whose systematic
  # FP8 rounding errors add up coherently over long contractions.
  x = jax.random.normal(kx, (T, D), jnp.float32).astype(jnp.bfloat16)
  ct = jax.random.normal(kc, (T, D), jnp.float32).astype(jnp.bfloat16)
  params = MLP(F, D).init(kp, x)["params"]

  # f32 reference gradients (HIGHEST precision) of the same block on the same data.
  def ref_step(p, x, ct):
    def block(p, x):
      h = nn.gelu(jnp.dot(x, p["Dense_0"]["kernel"], precision="highest"))
      return jnp.dot(h, p["Dense_1"]["kernel"], precision="highest")
    _, vjp = jax.vjp(block, p, x)
    return vjp(ct)
  p32 = jax.tree.map(lambda t: t.astype(jnp.float32), params)
  ref = jax.jit(ref_step)(p32, x.astype(jnp.float32), ct.astype(jnp.float32))

  rows = []
  base = {}
  for mode in a.modes.split(","):
    if mode in GEMM_MODES:
      row = time_gemms(mode, x, ct, params, kg, F, a.iters)
    else:
      row = time_block(mode, x, ct, params, ref, kp, F, D, a.iters)
    base.setdefault(mode, row[0])
    rows.append((mode,) + row)

  print()
  print(f"{'mode':17s} {'ms(med)':>9s} {'ms(min)':>9s} {'TFLOP/s':>8s} {'xBF16':>6s} "
        f"{'xFlax':>6s} {'#f8gemm':>7s} {'grad err':>9s} {'temp GiB':>8s}")
  for mode, med, best, n_f8, err, temp in rows:
    ref_mode = "gemms_bf16" if mode in GEMM_MODES else "bf16"
    xb = base[ref_mode] / med if ref_mode in base else float("nan")
    xf = base["flax_fp8"] / med if "flax_fp8" in base else float("nan")
    e = "-" if err is None else f"{err:.2e}"
    print(f"{mode:17s} {med:9.2f} {best:9.2f} {flops / med / 1e9:8.0f} {xb:6.2f} {xf:6.2f} "
          f"{n_f8:7d} {e:>9s} {temp:8.2f}")


if __name__ == "__main__":
  main()
