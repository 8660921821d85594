"""Times FP8 gradient reduce-scatter against BF16 ``psum_scatter`` on all local devices.

A 1-D mesh over every local device; each device holds `size` MiB of f32 gradients (one
[rows, 1024] tensor) or, for the tree case, the gradient tree of a GPT-style model (1.3B
parameters on GPU: 24 layers, d=2048, vocab 50304; a small one on CPU). Every variant is a
jitted ``shard_map`` timed side by side in one process: median of --iters calls after warm-up.

  bf16 psum_scatter (f32 in)   lax.psum_scatter(x.astype(bf16)): the cast is inside the timing
  bf16 psum_scatter (bf16 in)  lax.psum_scatter of a bf16 input (no cast)
  fp8 plain all_to_all         amax, pmax, cast, all_to_all, f32 sum of the pieces: unfused jnp
  fp8 current                  fp8_reduce_scatter(x): agreed amax this step (one pmax)
  fp8 delayed                  fp8_reduce_scatter(x, scale=s): scale known before the call
  fp8 delayed, 4 chunks        same, the wire as 4 all_to_alls (cast overlaps the transfer)
  fp8 delayed -> bf16          same, bf16 result
  fp8 auto (stats+update)      fp8_reduce_scatter_auto: delayed scale + saturation stats + state
  tree: per leaf / one buffer  the same for the model's gradient tree (per-leaf collectives vs
                               fp8_reduce_scatter_tree's single all_to_all)

Prints ms, ratio to BF16 psum_scatter (f32 in), the payload type each variant's compiled HLO
moves, and for the smallest size the error of each variant against a float64 host reference.

  source benchmarks/gpu_env.sh && python benchmarks/comm/reduce_scatter.py --budget-s 110
  python benchmarks/comm/reduce_scatter.py --cpu        # 8 CPU devices, small sizes
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _args():
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--cpu", action="store_true", help="run on 8 CPU devices with small sizes")
  p.add_argument("--sizes-mib", default=None, help="per-device f32 MiB, comma separated "
                 "(default 256,1024 on GPU, 1,4 on CPU)")
  p.add_argument("--iters", type=int, default=None,
                 help="timed calls per variant, median (default 20 on GPU, 5 on CPU)")
  p.add_argument("--no-tree", action="store_true", help="skip the model gradient tree case")
  p.add_argument("--budget-s", type=float, default=150.0,
                 help="skip what is left once this many seconds have passed")
  return p.parse_args()


ARGS = _args()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)  # only used when there is no accelerator
if ARGS.cpu:
  jax.config.update("jax_platforms", "cpu")
ARGS.cpu = jax.default_backend() == "cpu"
ARGS.iters = ARGS.iters or (5 if ARGS.cpu else 20)

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from fp8jax.parallel.collectives import (CommScaling, fp8_reduce_scatter,  # noqa: E402
                                         fp8_reduce_scatter_auto, fp8_reduce_scatter_tree)

AX = "d"
E4M3 = jnp.float8_e4m3fn
T0 = time.perf_counter()


# ----------------------------------------------------------------------------- variants

def bf16_psum_scatter(x):
  return lax.psum_scatter(x.astype(jnp.bfloat16), AX, tiled=True)


def bf16_psum_scatter_bf16_in(x):
  return lax.psum_scatter(x, AX, tiled=True)


def fp8_plain_all_to_all(x):
  """The straightforward FP8 path: no attention to fusion or wire type."""
  n = lax.axis_size(AX)
  amax = lax.pmax(jnp.max(jnp.abs(x)), AX)
  scale = amax / 448.0
  q = jnp.clip(x / scale, -448.0, 448.0).astype(E4M3)
  recv = lax.all_to_all(q.reshape((n, -1) + x.shape[1:]), AX, 0, 0, tiled=True)
  return jnp.sum(recv.astype(jnp.float32), axis=0) * scale


def fp8_current(x):
  return fp8_reduce_scatter(x, AX)


def fp8_delayed(x, scale):
  return fp8_reduce_scatter(x, AX, scale=scale)


def fp8_delayed_chunked(x, scale):
  return fp8_reduce_scatter(x, AX, scale=scale, chunks=4)


def fp8_delayed_bf16(x, scale):
  return fp8_reduce_scatter(x, AX, scale=scale, out_dtype=jnp.bfloat16)


def fp8_auto(x, state):
  return fp8_reduce_scatter_auto(x, AX, state)


def tree_bf16(t):
  return jax.tree.map(bf16_psum_scatter, t)


def tree_fp8_per_leaf(t):
  return jax.tree.map(fp8_current, t)


def tree_fp8_one_buffer(t):
  return fp8_reduce_scatter_tree(t, AX)


def tree_fp8_one_buffer_delayed(t, scales):
  return fp8_reduce_scatter_tree(t, AX, scales=scales)


def tree_fp8_one_buffer_delayed_chunked(t, scales):
  return fp8_reduce_scatter_tree(t, AX, scales=scales, chunks=4)


def tree_fp8_auto(t, state):
  return fp8_reduce_scatter_auto(t, AX, state)


# ----------------------------------------------------------------------------- harness

def _smap(mesh, fn, in_specs, out_specs):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def _wire(compiled_text: str) -> str:
  """Payload types of the data-moving collectives in compiled HLO (scalars left out), e.g.
  'all-to-all:u8'; async '-start' ops count only where no plain op of that kind exists."""
  plain, start = [], []
  for line in compiled_text.splitlines():
    m = re.search(r"= \(*([a-z0-9]+)\[([0-9,]*)\].*? (all-to-all|reduce-scatter|all-gather|"
                  r"all-reduce|collective-permute)(-start)?\(", line)
    if m and m.group(2) not in ("", "1"):
      (start if m.group(4) else plain).append(f"{m.group(3)}:{m.group(1)}")
  ops = {op.split(":")[0] for op in plain}
  kinds = plain + [k for k in start if k.split(":")[0] not in ops]
  counts = {k: kinds.count(k) for k in sorted(set(kinds))}
  return " ".join(f"{k}x{v}" if v > 1 else k for k, v in counts.items()) or "-"


def _time(fn, args, iters):
  """(median ms, output, wire types): `fn` compiled once ahead of time, 3 warm-up calls."""
  compiled = fn.lower(*args).compile()
  wire = _wire(compiled.as_text())
  fn = compiled
  out = fn(*args)
  jax.block_until_ready(out)
  for _ in range(2):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(iters):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return float(np.median(times)) * 1e3, out, wire


def _over_budget() -> bool:
  return time.perf_counter() - T0 > ARGS.budget_s


@functools.lru_cache(maxsize=None)
def _maker(mesh, shape):
  def make(key):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, shape) * jnp.exp(1.5 * jax.random.normal(k2, shape))
  return jax.jit(make, out_shardings=NamedSharding(mesh, P(AX)))


def _grads(mesh, shape, seed):
  """f32 gradients sharded over dim 0, lognormal magnitudes over ~5 decades, made on device."""
  return _maker(mesh, tuple(shape))(jax.random.key(seed))


def _model_shapes(n_dev: int):
  """Per-device gradient shapes of a GPT-style decoder (global shapes: dim 0 is sharded)."""
  if ARGS.cpu:
    layers, d, vocab, ctx = 2, 128, 256, 64
  else:
    layers, d, vocab, ctx = 24, 2048, 50304, 2048
  shapes = {"embed": (vocab, d), "pos": (ctx, d), "ln_f": (d,)}
  for i in range(layers):
    shapes.update({f"l{i:02d}.qkv": (d, 3 * d), f"l{i:02d}.qkv_b": (3 * d,),
                   f"l{i:02d}.proj": (d, d), f"l{i:02d}.proj_b": (d,),
                   f"l{i:02d}.fc1": (d, 4 * d), f"l{i:02d}.fc1_b": (4 * d,),
                   f"l{i:02d}.fc2": (4 * d, d), f"l{i:02d}.fc2_b": (d,),
                   f"l{i:02d}.ln1": (d,), f"l{i:02d}.ln2": (d,)})
  # each device holds a full gradient: the global array stacks n_dev of them along dim 0
  return {k: (n_dev * s[0],) + s[1:] for k, s in shapes.items()}


def _rel_err(y, ref):
  y = np.asarray(jnp.asarray(y, jnp.float32), np.float64)
  return float(np.linalg.norm(y - ref) / np.linalg.norm(ref))


def _print_rows(title, rows, base_ms):
  print(f"\n{title}")
  print(f"| {'variant':<30} | {'ms':>8} | {'x BF16':>6} | {'error vs f64':>12} | wire |")
  print(f"|{'-' * 32}|{'-' * 10}|{'-' * 8}|{'-' * 14}|------|")
  for name, ms, err, wire in rows:
    e = f"{err:.3e}" if err is not None else "-"
    r = f"{ms / base_ms:.2f}" if ms is not None else "-"
    m = f"{ms:.3f}" if ms is not None else "skipped"
    print(f"| {name:<30} | {m:>8} | {r:>6} | {e:>12} | {wire} |")
  sys.stdout.flush()


def run_flat(mesh, mib, check):
  n = mesh.size
  cols = 1024
  rows = mib * 2 ** 20 // 4 // cols
  x = _grads(mesh, (n * rows, cols), seed=mib)
  xb = jax.jit(lambda a: a.astype(jnp.bfloat16))(x)
  amax = float(jnp.max(jnp.abs(x)))
  scale = jnp.float32(amax / 448.0)
  state = CommScaling(jnp.float32(amax), jnp.float32(1.0), jnp.int32(0), jnp.float32(0.0))
  d = P(AX)
  variants = [
      ("bf16 psum_scatter (f32 in)", _smap(mesh, bf16_psum_scatter, d, d), (x,)),
      ("bf16 psum_scatter (bf16 in)", _smap(mesh, bf16_psum_scatter_bf16_in, d, d), (xb,)),
      ("fp8 plain all_to_all", _smap(mesh, fp8_plain_all_to_all, d, d), (x,)),
      ("fp8 current", _smap(mesh, fp8_current, d, d), (x,)),
      ("fp8 delayed", _smap(mesh, fp8_delayed, (d, P()), d), (x, scale)),
      ("fp8 delayed, 4 chunks", _smap(mesh, fp8_delayed_chunked, (d, P()), d), (x, scale)),
      ("fp8 delayed -> bf16", _smap(mesh, fp8_delayed_bf16, (d, P()), d), (x, scale)),
      ("fp8 auto (stats+update)", _smap(mesh, fp8_auto, (d, P()), (d, P())), (x, state)),
  ]
  ref = None
  if check:
    host = np.asarray(x, np.float64).reshape(n, rows, cols)
    ref = host.sum(0).reshape(rows, cols)  # rank-major: the global result is the full sum
    del host
  rows_out, base = [], None
  for name, fn, args in variants:
    if _over_budget():
      rows_out.append((name, None, None, "-"))
      continue
    ms, out, wire = _time(fn, args, ARGS.iters)
    base = base or ms
    y = out[0] if isinstance(out, tuple) else out
    err = _rel_err(y, ref) if ref is not None else None
    rows_out.append((name, ms, err, wire))
    del out, y
  _print_rows(f"{mib} MiB f32 gradients per device, {n} devices ({jax.devices()[0].device_kind})",
              rows_out, base)


def run_tree(mesh):
  n = mesh.size
  shapes = _model_shapes(n)
  tree = {k: _grads(mesh, s, seed=i) for i, (k, s) in enumerate(sorted(shapes.items()))}
  n_params = sum(int(np.prod(s)) for s in shapes.values()) // n
  leaves = jax.tree.leaves(tree)
  amaxes = jnp.stack([jnp.max(jnp.abs(a)) for a in leaves])
  scales = amaxes / 448.0
  state = CommScaling(amaxes, jnp.ones_like(amaxes), jnp.zeros(len(leaves), jnp.int32),
                      jnp.zeros_like(amaxes))
  specs = jax.tree.map(lambda _: P(AX), tree)
  variants = [
      ("bf16 psum_scatter per leaf", _smap(mesh, tree_bf16, (specs,), specs), (tree,)),
      ("fp8 current per leaf", _smap(mesh, tree_fp8_per_leaf, (specs,), specs), (tree,)),
      ("fp8 current, one buffer", _smap(mesh, tree_fp8_one_buffer, (specs,), specs), (tree,)),
      ("fp8 delayed, one buffer", _smap(mesh, tree_fp8_one_buffer_delayed, (specs, P()), specs),
       (tree, scales)),
      ("fp8 delayed, 4 chunks", _smap(mesh, tree_fp8_one_buffer_delayed_chunked, (specs, P()),
                                      specs), (tree, scales)),
      ("fp8 auto, one buffer", _smap(mesh, tree_fp8_auto, (specs, P()), (specs, P())),
       (tree, state)),
  ]
  rows_out, base = [], None
  for name, fn, args in variants:
    if _over_budget():
      rows_out.append((name, None, None, "-"))
      continue
    ms, out, wire = _time(fn, args, ARGS.iters)
    base = base or ms
    rows_out.append((name, ms, None, wire))
    del out
  _print_rows(f"gradient tree: {len(leaves)} leaves, {n_params / 1e6:.1f}M f32 parameters "
              f"per device, {n} devices", rows_out, base)


def main():
  devices = jax.devices()
  mesh = jax.make_mesh((len(devices),), (AX,), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=devices)
  sizes = [int(s) for s in (ARGS.sizes_mib or ("1,4" if ARGS.cpu else "256,1024")).split(",")]
  print(f"jax {jax.__version__}, {len(devices)} x {devices[0].device_kind}, "
        f"median of {ARGS.iters} calls; ratios to 'bf16 psum_scatter (f32 in)'")
  for i, mib in enumerate(sizes):
    run_flat(mesh, mib, check=(i == 0))
  if not ARGS.no_tree:
    run_tree(mesh)
  print(f"\ntotal {time.perf_counter() - T0:.1f} s")
  sys.stdout.flush()


if __name__ == "__main__":
  main()
