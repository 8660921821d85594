"""Times one optimizer step (update + apply) of fp8jax.optim.adamw against optax.adamw.

Default size is issue 4's: 2^30 parameters (split into --tensors 2-D tensors), one device.
Every mode runs side by side in one process on the same gradients; each step is a jitted
function with params and optimizer state donated, timed as the median of --iters steps after
warm-up (each step waited for), and as the best of 3 runs of --iters steps launched back to
back (as in training, where no step is waited for: the host's dispatch overlaps the GPU).
Modes:

  optax        optax.adamw, f32 params, f32 state (m, v), f32 gradients
  fp8jax       fp8jax.optim.adamw: E4M3 m/sqrt(v) + FP16 sqrt(v) state, f32 params and gradients
  fp8jax O2    fp8jax.optim.adamw + FP16 master weights (apply_master_updates, stochastic
               rounding) + FP8 E4M3 gradients with a per-tensor scale (as FP8 gradient
               communication delivers them)
  O2 fused     the same step through fp8jax.optim.fused.adamw_master_step (one Pallas kernel
               per tensor on GPUs); it reads the gradients' FP8 payloads once to check them
  O2 fused, finite given   the same with the finiteness flag passed in (as training passes
               the clipping norm's): nothing but the kernels touches the arrays
  clip+optax   optax.clip_by_global_norm(1.0) then optax.adamw (f32 gradients)
  clip+O2 fused  global-norm clipping of the FP8 gradients (one pass over the payloads; the
               clip factor goes into their scales) then the fused step, finite from the norm

  O2 payload-amax, O2 nearest   experiments: the master weights' scale from a reduction over
               the stored payload instead of the tracked amax; round to nearest instead of
               stochastic rounding (composed path)

  python benchmarks/optim/update.py [--params N] [--tensors T] [--iters K] [--modes ...]
  python benchmarks/optim/update.py --params 1048576 --iters 5     # a quick CPU run

Prints per mode: median ms per step, ratio to optax, effective GB/s (persistent bytes read
and written once per step: params, gradients, state), persistent bytes per parameter, the
compiled step's temporary memory, and on GPU the device's peak bytes in use.
"""
from __future__ import annotations

import argparse
import collections
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fp8jax.optim as fo  # noqa: E402
from benchmarks.common import trace  # noqa: E402

KERNEL_NAMES = False  # --kernel-names: list each traced mode's kernels by name
MODES = ("optax", "fp8jax", "fp8jax O2", "O2 fused", "O2 fused, finite given", "clip+optax",
         "clip+O2 fused", "O2 payload-amax", "O2 nearest")


def clip_scaled(grads, max_norm: float):
  """(grads with scales multiplied by min(1, max_norm / global norm), global norm f32[])."""
  leaves = jax.tree.leaves(grads, is_leaf=fo.is_scaled)
  sq = sum(jnp.sum(jnp.square(g.data.astype(jnp.float32))) * g.scale ** 2 for g in leaves)
  norm = jnp.sqrt(sq)
  factor = jnp.minimum(1.0, max_norm / norm)
  return jax.tree.map(lambda g: g._replace(scale=g.scale * factor), grads,
                      is_leaf=fo.is_scaled), norm


def _shapes(n_params: int, n_tensors: int):
  """`n_tensors` 2-D shapes (rows x 1024-multiples) summing to about `n_params`."""
  per = max(n_params // n_tensors, 1024)
  cols = 4096 if per >= 4096 * 64 else 1024 if per >= 1024 * 8 else per
  rows = max(per // cols, 1)
  return [(rows, cols)] * n_tensors


def _tree(shapes, key, scale):
  keys = jax.random.split(key, len(shapes))
  make = jax.jit(lambda k, s: jax.random.normal(k, s, jnp.float32) * scale, static_argnums=1)
  return {f"t{i:03d}": make(k, s) for i, (k, s) in enumerate(zip(keys, shapes))}


def _step_fn(mode: str, tx):
  """The jitted step (params/master, opt_state, grads) -> (params/master, opt_state)."""
  if "O2 fused" in mode:  # fp8jax.optim.fused: one Pallas kernel per tensor on GPUs
    from fp8jax.optim.fused import adamw_master_step

    def step(master, state, grads):
      finite = None
      if mode == "O2 fused, finite given":
        finite = jnp.bool_(True)
      elif mode == "clip+O2 fused":
        grads, norm = clip_scaled(grads, 1.0)
        finite = jnp.isfinite(norm)
      return adamw_master_step(grads, state, master, learning_rate=1e-4, weight_decay=0.1,
                               finite=finite)
  elif mode.startswith("O2 "):  # experiments: master scale from the payload's amax; RTN
    rounding = "nearest" if mode == "O2 nearest" else "stochastic"

    def step(master, state, grads):
      if mode == "O2 payload-amax":
        master = master._replace(amax=None)  # amax from the stored payload, not tracked
      params = fo.master_params(master)
      updates, state = tx.update(grads, state, params)
      new = fo.apply_master_updates(master, updates, finite=fo.all_finite(grads),
                                    rounding=rounding)
      return (new._replace(amax=jnp.zeros_like(new.amax)) if mode == "O2 payload-amax"
              else new), state
  elif mode == "fp8jax O2":
    def step(master, state, grads):
      params = fo.master_params(master)  # fused into the update, never materialised alone
      updates, state = tx.update(grads, state, params)
      # The optimizer zeroes a non-finite step's updates; the flag is the gradients' check
      # (the same reduction skip_not_finite does), so the update stays one pass.
      return fo.apply_master_updates(master, updates, finite=fo.all_finite(grads)), state
  else:
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  return jax.jit(step, donate_argnums=(0, 1))


def _device_peak():
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use"), stats.get("bytes_in_use")


def _kernel_time(compiled, params, state, grads, iters: int):
  """(params, state, GPU kernel ms per step, kernels per step) from a profiler trace."""
  carry = [params, state]

  def one_step():
    carry[:] = compiled(carry[0], carry[1], grads)
    return tuple(carry)
  _, kernels = trace.traced_kernels(one_step, iters)
  if KERNEL_NAMES:
    counts = collections.Counter(name for name, _, _ in kernels)
    print(f"kernels per step by name ({len(counts)} names):")
    for name, c in counts.most_common():
      print(f"  {c / iters:6.1f}  {name[:100]}")
  return carry[0], carry[1], trace.kernel_ms(kernels, iters), len(kernels) / iters


def run_mode(mode: str, shapes, iters: int, seed: int, dump_hlo: str | None = None,
             profile: bool = False):
  """Median seconds per step and memory facts of one mode."""
  params = _tree(shapes, jax.random.key(seed), 0.02)
  grads = _tree(shapes, jax.random.key(seed + 1), 1e-3)
  if mode == "optax":
    tx = optax.adamw(1e-4, weight_decay=0.1)
  elif mode == "clip+optax":
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.1))
  else:
    tx = fo.adamw(1e-4, weight_decay=0.1)
  state = jax.jit(tx.init)(params)
  if mode not in ("optax", "fp8jax", "clip+optax"):
    params = jax.jit(fo.init_master, donate_argnums=0)(params)
    grads = jax.jit(lambda g: jax.tree.map(  # FP8 E4M3 payloads with a per-tensor scale
        lambda x: fo.quantize_scaled(x, jnp.float8_e4m3fn), g), donate_argnums=0)(grads)
  jax.block_until_ready((params, state, grads))
  step = _step_fn(mode, tx)
  compiled = step.lower(params, state, grads).compile()
  mem = compiled.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  # Fusions in the entry computation of the compiled step (~ kernels launched per step).
  if dump_hlo:
    with open(f"{dump_hlo}.{mode.replace(' ', '_')}.hlo.txt", "w") as f:
      f.write(compiled.as_text())
  entry = compiled.as_text().split("ENTRY", 1)[-1]
  fusions = sum(1 for line in entry.splitlines() if " fusion(" in line)
  persistent = fo.tree_bytes(params) + fo.tree_bytes(state) + fo.tree_bytes(grads)
  for _ in range(3):  # warm-up
    params, state = compiled(params, state, grads)
  jax.block_until_ready((params, state))
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    params, state = compiled(params, state, grads)
    jax.block_until_ready((params, state))
    times.append(time.perf_counter() - t0)
  # Back to back (as inside training, where nothing waits for each step): the host's
  # dispatch overlaps the previous step's kernels.
  pipelined = []
  for _ in range(3):
    t0 = time.perf_counter()
    for _ in range(iters):
      params, state = compiled(params, state, grads)
    jax.block_until_ready((params, state))
    pipelined.append((time.perf_counter() - t0) / iters)
  kernel_ms = launches = None
  if profile and jax.default_backend() == "gpu":
    params, state, kernel_ms, launches = _kernel_time(compiled, params, state, grads, iters)
  o2 = mode not in ("optax", "fp8jax", "clip+optax")
  finite = bool(np.isfinite(np.asarray(jax.tree.leaves(fo.master_params(params) if o2
                                                       else params)[0][:4], np.float32)).all())
  peak, in_use = _device_peak()
  del params, state, grads, compiled, step
  gc.collect()
  return dict(ms=1e3 * float(np.median(times)), pipelined_ms=1e3 * min(pipelined),
              persistent=persistent, temp=temp, peak=peak,
              in_use=in_use, finite=finite, fusions=fusions, kernel_ms=kernel_ms,
              launches=launches)


def _fmt(x, spec: str) -> str:
  return "-" if x is None else format(x, spec)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--params", type=int, default=2 ** 30, help="total parameters (default 2^30)")
  ap.add_argument("--tensors", type=int, default=16, help="number of parameter tensors")
  ap.add_argument("--iters", type=int, default=20, help="timed steps per mode (median)")
  ap.add_argument("--modes", nargs="+", default=list(MODES),
                  help=f"any of {list(MODES)}")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--dump-hlo", default=None, metavar="PREFIX",
                  help="write each mode's compiled step to PREFIX.<mode>.hlo.txt")
  ap.add_argument("--profile", action="store_true",
                  help="also trace each mode on the GPU: kernel ms and kernels per step")
  ap.add_argument("--kernel-names", action="store_true",
                  help="with --profile: list each mode's GPU kernels per step by name")
  args = ap.parse_args(argv)
  global KERNEL_NAMES
  KERNEL_NAMES = args.kernel_names

  shapes = _shapes(args.params, args.tensors)
  n = sum(int(np.prod(s)) for s in shapes)
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind} ({dev.platform}), jax {jax.__version__}; "
        f"{n:,} params in {len(shapes)} tensors of {shapes[0]}; median of {args.iters} steps")
  results = {}
  for mode in args.modes:
    results[mode] = run_mode(mode, shapes, args.iters, args.seed, args.dump_hlo, args.profile)
  base = results.get("optax", {}).get("ms")
  gib = lambda b: "-" if b is None else f"{b / 2 ** 30:.2f}"
  base_pipe = results.get("optax", {}).get("pipelined_ms")
  print("\n| mode | ms (median) | x optax | ms back to back | x optax | GB/s (persistent r+w) | "
        "bytes/param | temp GiB | device peak GiB | finite | fusions | GPU kernel ms | kernels |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for mode, r in results.items():
    ratio = f"{r['ms'] / base:.2f}" if base else "-"
    ratio_pipe = f"{r['pipelined_ms'] / base_pipe:.2f}" if base_pipe else "-"
    # Persistent state is read once and written once (grads only read): a lower bound on traffic.
    grad_bytes = n * (4 if mode in ("optax", "fp8jax", "clip+optax") else 1)
    traffic = 2 * r["persistent"] - grad_bytes
    print(f"| {mode} | {r['ms']:.2f} | {ratio} | {r['pipelined_ms']:.2f} | {ratio_pipe} | "
          f"{traffic / r['ms'] / 1e6:.0f} | "
          f"{r['persistent'] / n:.3f} | {gib(r['temp'])} | {gib(r['peak'])} | {r['finite']} | "
          f"{r['fusions']} | {_fmt(r['kernel_ms'], '.2f')} | {_fmt(r['launches'], '.0f')} |")


if __name__ == "__main__":
  main()
