"""GPU kernel time of the optimizer steps that ``fp8jax bench optim`` times (GPU).

``fp8jax bench optim`` measures the modes side by side (host clock, waited for and back to
back) and prints the table; this script traces the same steps (``fp8jax.bench.optim``'s
inputs and jitted steps, 2^30 parameters in 16 tensors by default) with ``jax.profiler`` and
prints, per mode, the summed GPU kernel time per step and the kernels launched per step,
optionally listed by name, and can write each compiled step's HLO.

  source benchmarks/gpu_env.sh && python benchmarks/optim/update.py [--modes o2_fused,...] \
      [--params N] [--tensors K] [--iters N] [--kernel-names] [--dump-hlo PREFIX]
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

from benchmarks.common import trace  # noqa: E402
from fp8jax.bench import optim as bo  # noqa: E402


def profile_mode(mode: str, shapes, iters: int, seed: int, kernel_names: bool,
                 dump_hlo: str | None) -> tuple[float, float]:
  """(GPU kernel ms per step, kernels per step) of `mode` after 3 warm-up steps."""
  params, state, grads, tx = bo.inputs(mode, shapes, seed)
  compiled = bo.step_fn(mode, tx).lower(params, state, grads).compile()
  if dump_hlo:
    with open(f"{dump_hlo}.{mode}.hlo.txt", "w") as f:
      f.write(compiled.as_text())
  carry = [params, state]

  def one_step():
    carry[:] = compiled(carry[0], carry[1], grads)
    return tuple(carry)
  for _ in range(3):
    jax.block_until_ready(one_step())
  _, kernels = trace.traced_kernels(one_step, iters)
  if kernel_names:
    counts = collections.Counter(name for name, _, _ in kernels)
    print(f"{mode}: kernels per step by name ({len(counts)} names):")
    for name, c in counts.most_common():
      print(f"  {c / iters:6.1f}  {name[:100]}")
  return trace.kernel_ms(kernels, iters), len(kernels) / iters


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--params", type=int, default=bo.PARAMS)
  ap.add_argument("--tensors", type=int, default=bo.TENSORS)
  ap.add_argument("--iters", type=int, default=bo.ITERS, help="traced steps per mode")
  ap.add_argument("--modes", default=",".join(bo.DEFAULT_MODES),
                  help=f"comma-separated, of {', '.join(bo.MODES)}")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--kernel-names", action="store_true",
                  help="list each mode's GPU kernels per step by name")
  ap.add_argument("--dump-hlo", default=None, metavar="PREFIX",
                  help="write each mode's compiled step to PREFIX.<mode>.hlo.txt")
  args = ap.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("benchmarks/optim/update.py traces GPU kernels; on this backend run "
                     "`fp8jax bench optim --small`")
  shapes = bo.shapes(args.params, args.tensors)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; {len(shapes)} tensors of "
        f"{shapes[0]}; {args.iters} traced steps per mode\n")
  print("| mode | GPU kernel ms | kernels |\n|---|---|---|")
  for mode in (m.strip() for m in args.modes.split(",") if m.strip()):
    ms, launches = profile_mode(mode, shapes, args.iters, args.seed, args.kernel_names,
                                args.dump_hlo)
    print(f"| {mode} | {ms:.2f} | {launches:.0f} |", flush=True)
    gc.collect()


if __name__ == "__main__":
  main()
