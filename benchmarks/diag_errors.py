"""Per-tensor error of the MLP block's outputs/gradients vs f32 HIGHEST: Flax FP8, fp8jax
native, fp8jax forced emulation (same quantized math in f32). Small shape, quick."""
import functools, sys
import jax, jax.numpy as jnp, flax.linen as nn
from flax.linen import fp8_ops
import fp8jax, fp8jax.dot as fdot
from fp8jax.linen import Fp8DotGeneral
sys.path.insert(0, "benchmarks")
from mlp_block import MLP, rel

import os; T, D, F = (int(v) for v in os.environ.get("DIAG_SHAPE", "4096,2048,8192").split(","))
kx, kc, kp = jax.random.split(jax.random.key(1), 3)
x = jax.random.normal(kx, (T, D), jnp.bfloat16); ct = jax.random.normal(kc, (T, D), jnp.bfloat16)
params = MLP(F, D).init(kp, x)["params"]
def block(p, x):
  h = nn.gelu(jnp.dot(x, p["Dense_0"]["kernel"], precision="highest"))
  return jnp.dot(h, p["Dense_1"]["kernel"], precision="highest")
p32 = jax.tree.map(lambda t: t.astype(jnp.float32), params)
y_ref, vjp = jax.vjp(block, p32, x.astype(jnp.float32)); dp_ref, dx_ref = vjp(ct.astype(jnp.float32))
def run(model):
  v = {**model.init(kp, x), "params": params}
  def step(v, x, ct):
    y, vjp = jax.vjp(lambda v, x: model.apply(v, x), v, x); return y, vjp(ct)
  step = jax.jit(step)
  for _ in range(3):
    y, (dv, dx) = step(v, x, ct)
    for col in ("fp8_meta", fp8_ops.OVERWRITE_WITH_GRADIENT):
      if col in dv: v = {**v, col: dv[col]}
  return dict(y=rel(y, y_ref), dx=rel(dx, dx_ref), dW0=rel(dv["params"]["Dense_0"]["kernel"], dp_ref["Dense_0"]["kernel"]),
              dW1=rel(dv["params"]["Dense_1"]["kernel"], dp_ref["Dense_1"]["kernel"])), v
fp8 = functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())
for name in ("bf16", "flax", "fp8jax", "fp8jax_emulated"):
  if name == "fp8jax_emulated": fdot.native_fp8_reason = lambda: "forced"
  model = {"bf16": MLP(F, D), "flax": MLP(F, D, fp8_ops.Fp8DirectDotGeneralOp)}.get(name, MLP(F, D, fp8))
  errs, v = run(model)
  print(f"{name:16s} " + " ".join(f"{k}={e:.3e}" for k, e in errs.items()), flush=True)
  if name.startswith("fp8jax"):
    m = v["fp8_meta"]["Dense_1"]["Fp8DotGeneral_0"]
    print("   Dense_1 scales in/k/og:", float(m["input"].scale), float(m["kernel"].scale), float(m["output_grad"].scale),
          "hist0:", float(m["output_grad"].amax_history[0]))
