"""Stacking the unrolled layers' weight gradients into their [L, ...] leaves (GPU).

  source benchmarks/gpu_env.sh && python benchmarks/train/layer_grad_stack.py [--layers 24] \
      [--shapes 8192x2048,2048x8192,2048x6144]

With unrolled layers each layer's weight gradient is its own GEMM output, and the backward of
``fp8jax.models.layers.unstack_layers`` stacks them into the stacked parameter's gradient.
Times, per call, L bf16 GEMMs (a[i] @ b[i], K = 256, outputs of each shape) and then:

- nothing more (the GEMMs alone, their outputs returned as L arrays);
- ``jnp.stack`` (one concatenation of L operands);
- ``fp8jax.models.layers.stack_layers`` (L in-place updates of one buffer).

Both stacks must be bit-equal. The copy's cost is a stack's time minus the GEMMs'; the
bandwidth column counts one read and one write of the stacked bytes. Milliseconds per call:
median of 5 rounds of 20 back-to-back calls.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks.common import calls  # noqa: E402
from fp8jax.models.layers import stack_layers  # noqa: E402

ms_per_call = functools.partial(calls.ms_per_call, calls=20)


def _gemms(a, b):
  return [jnp.dot(a[i], b[i], preferred_element_type=jnp.bfloat16) for i in range(a.shape[0])]


def main():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=24)
  p.add_argument("--shapes", default="8192x2048,2048x8192,2048x6144",
                 help="comma-separated MxN of each layer's gradient")
  a = p.parse_args()
  variants = {"gemms": jax.jit(_gemms),
              "jnp.stack": jax.jit(lambda a, b: jnp.stack(_gemms(a, b))),
              "stack_layers": jax.jit(lambda a, b: stack_layers(*_gemms(a, b)))}
  print(f"{jax.devices()[0].device_kind}, L = {a.layers}, bf16, ms per call\n")
  print("| gradient [L, M, N] | GEMMs alone | + jnp.stack | + stack_layers | copy: jnp.stack "
        "| copy: stack_layers | stack_layers GB/s |")
  print("|---|---|---|---|---|---|---|")
  for shape in a.shapes.split(","):
    m, n = (int(s) for s in shape.split("x"))
    ka, kb = jax.random.split(jax.random.key(0))
    x = jax.random.normal(ka, (a.layers, m, 256), jnp.bfloat16)
    y = jax.random.normal(kb, (a.layers, 256, n), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(variants["jnp.stack"](x, y), np.float32),
                                  np.asarray(variants["stack_layers"](x, y), np.float32))
    t = {k: ms_per_call(f, (x, y)) for k, f in variants.items()}
    copy = {k: t[k] - t["gemms"] for k in ("jnp.stack", "stack_layers")}
    gb = 2 * a.layers * m * n * 2 / 1e9
    print(f"| [{a.layers}, {m}, {n}] | {t['gemms']:.3f} | {t['jnp.stack']:.3f} | "
          f"{t['stack_layers']:.3f} | {copy['jnp.stack']:.3f} | {copy['stack_layers']:.3f} | "
          f"{gb / copy['stack_layers'] * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
  main()
