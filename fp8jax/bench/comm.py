"""``fp8jax bench comm``: FP8 gradient reduce-scatter (``fp8jax.parallel.collectives``) against
BF16 ``lax.psum_scatter``, side by side in one process over the local devices (>= 2; on CPU
``JAX_NUM_CPU_DEVICES`` sets how many there are).

A 1-D mesh over ``--devices`` local devices; each device holds ``--sizes-mib`` MiB of f32
gradients (one [rows, 1024] tensor, magnitudes lognormal over ~5 decades, drawn on the device)
and, for the tree case, the gradient tree of a GPT-style model (GPU: 24 layers, d=2048, vocab
50304, 243 tensors; ``--small``: embeddings and final norm, d=64, 3 tensors). Every variant is
a jitted ``jax.shard_map`` compiled ahead of time, run 3 times, then ``--iters`` calls each
waited for (median). Delayed scales are the gradients' own amax (warm, as after a step of
automatic scaling).

Variants: ``bf16 psum_scatter (f32 in)`` (the baseline: the cast to bf16 inside the timed
function), ``(bf16 in)``, ``fp8 plain all_to_all`` (amax, pmax, cast, all_to_all, f32 sum in
plain jnp), ``fp8 current`` (``fp8_reduce_scatter``: amax agreed this step), ``fp8 delayed``
(scale given), ``fp8 delayed, 4 chunks``, ``fp8 delayed -> bf16``, ``fp8 auto``
(``fp8_reduce_scatter_auto``: delayed scale, saturation statistics, state update); for the
tree: the same per leaf and as ``fp8_reduce_scatter_tree``'s one buffer.

Columns: ms, time against the baseline (below 1 is faster), the error against a float64 sum
on the host (first size only) and the payload types the compiled program's collectives move.
"""
from __future__ import annotations

import re
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from fp8jax.bench import report
from fp8jax.bench.timing import time_calls
from fp8jax.parallel.collectives import (CommScaling, fp8_reduce_scatter,
                                         fp8_reduce_scatter_auto, fp8_reduce_scatter_tree)

AX = "d"
E4M3 = jnp.float8_e4m3fn
SIZES_MIB, SMALL_SIZES_MIB = (256, 1024), (1,)
MODEL, SMALL_MODEL = (24, 2048, 50304, 2048), (0, 64, 128, 32)  # layers, d, vocab, context
ITERS, SMALL_ITERS = 20, 3
BASELINE, TREE_BASELINE = "bf16 psum_scatter (f32 in)", "bf16 psum_scatter per leaf"
COLUMNS = (report.Column("ms", "ms", ".3f"), report.Column("x_base", "time vs bf16"),
           report.Column("error", "error vs f64", ".3e"), report.Column("wire", "wire"))


def add_arguments(parser) -> None:
  """The subject's flags."""
  parser.add_argument("--sizes-mib", default=None, metavar="M1,M2,...",
                      help="f32 MiB per device, comma-separated (default 256,1024; --small 1)")
  parser.add_argument("--no-tree", action="store_true", help="skip the model gradient tree")
  parser.add_argument("--devices", type=int, default=None, metavar="N",
                      help="use the first N local devices (default: all)")


def prepare(args) -> Callable[[Callable[[str], None]], list[report.Table]]:
  """The subject from parsed flags (``small``, ``iters``, ``seed`` and :func:`add_arguments`'
  flags), checked: ``log -> tables`` (`log` prints a progress line), which raises
  :class:`fp8jax.bench.report.Skipped` with fewer than 2 devices."""
  devices = jax.local_devices()
  n = args.devices if args.devices is not None else len(devices)
  if n < 1 or n > len(devices):
    raise ValueError(f"bench comm: --devices {n}: this process has {len(devices)} local "
                     "device(s)")
  text = args.sizes_mib or ",".join(map(str, SMALL_SIZES_MIB if args.small else SIZES_MIB))
  try:
    sizes = [int(s) for s in text.split(",") if s.strip()]
  except ValueError:
    sizes = []
  if not sizes or min(sizes) < 1:
    raise ValueError(f"bench comm: --sizes-mib {text!r}: use whole MiB >= 1, comma-separated")
  iters = args.iters or (SMALL_ITERS if args.small else ITERS)
  model = SMALL_MODEL if args.small else MODEL

  def run(log):
    if n < 2:
      hint = " (on CPU: JAX_NUM_CPU_DEVICES=8)" if devices[0].platform == "cpu" else ""
      given = "found" if args.devices is None else "given"
      raise report.Skipped(f"needs >= 2 devices, {given} {n} {devices[0].device_kind}{hint}")
    mesh = jax.make_mesh((n,), (AX,), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=devices[:n])
    tables = [measure_flat(mesh, mib, iters, args.seed + i, check=i == 0, log=log)
              for i, mib in enumerate(sizes)]
    if not args.no_tree:
      tables.append(measure_tree(mesh, model, iters, args.seed, log=log))
    return tables
  return run


# ----------------------------------------------------------------------------- variants

def bf16_psum_scatter(x):
  return lax.psum_scatter(x.astype(jnp.bfloat16), AX, tiled=True)


def bf16_psum_scatter_bf16_in(x):
  return lax.psum_scatter(x, AX, tiled=True)


def fp8_plain_all_to_all(x):
  """The straightforward FP8 path, with no attention to fusion or wire type."""
  n = lax.axis_size(AX)
  scale = lax.pmax(jnp.max(jnp.abs(x)), AX) / 448.0
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


# ----------------------------------------------------------------------------- harness

def _smap(mesh, fn, in_specs, out_specs):
  return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))


def wire(hlo_text: str) -> str:
  """The payload types of the data-moving collectives in compiled HLO text (scalars left
  out), e.g. 'all-to-all:u8'; async '-start' ops count only where no plain op of that kind
  exists."""
  plain, start = [], []
  for line in hlo_text.splitlines():
    m = re.search(r"= \(*([a-z0-9]+)\[([0-9,]*)\].*? (all-to-all|reduce-scatter|all-gather|"
                  r"all-reduce|collective-permute)(-start)?\(", line)
    if m and m.group(2) not in ("", "1"):
      (start if m.group(4) else plain).append(f"{m.group(3)}:{m.group(1)}")
  ops = {op.split(":")[0] for op in plain}
  kinds = plain + [k for k in start if k.split(":")[0] not in ops]
  counts = {k: kinds.count(k) for k in sorted(set(kinds))}
  return " ".join(f"{k}x{v}" if v > 1 else k for k, v in counts.items()) or "-"


def _time(fn, args, iters):
  """(median ms, output, wire types) of `fn` compiled ahead of time."""
  compiled = fn.lower(*args).compile()
  out = compiled(*args)
  timing = time_calls(lambda: compiled(*args), iters, warmup=2)
  return timing.median, out, wire(compiled.as_text())


def _grads(mesh, shape, seed: int):
  """f32 gradients sharded over dim 0, lognormal magnitudes over ~5 decades, made on the
  devices."""
  def make(key):
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, shape) * jnp.exp(1.5 * jax.random.normal(k2, shape))
  return jax.jit(make, out_shardings=NamedSharding(mesh, P(AX)))(jax.random.key(seed))


def _title(what: str, mesh) -> str:
  return f"{what}, {mesh.size} x {mesh.devices.flat[0].device_kind}"


def _rows(table, variants, iters, log, reference=None):
  base = None
  for name, fn, args in variants:
    t0 = time.perf_counter()
    ms, out, moved = _time(fn, args, iters)
    base = base if base is not None else ms
    err = None
    if reference is not None:
      y = out[0] if isinstance(out, tuple) else out
      got = np.asarray(jax.device_get(y)).astype(np.float64)
      err = float(np.linalg.norm(got - reference) / np.linalg.norm(reference))
    table.rows.append(report.Row(name, {"ms": ms, "x_base": report.ratio(ms, base),
                                        "error": err, "wire": moved},
                                 baseline=len(table.rows) == 0))
    log(f"comm {name}: {ms:.3f} ms ({time.perf_counter() - t0:.1f} s with compile)")
    del out


def measure_flat(mesh, mib: int, iters: int = ITERS, seed: int = 0, check: bool = True,
                 log=print) -> report.Table:
  """The table of every variant on `mib` MiB of f32 gradients per device of `mesh`; with
  `check`, each result's error against a float64 sum on the host."""
  n, cols = mesh.size, 1024
  rows = max(mib * 2**20 // 4 // cols // n * n, n)
  x = _grads(mesh, (n * rows, cols), seed)
  xb = jax.jit(lambda a: a.astype(jnp.bfloat16))(x)
  amax = float(jnp.max(jnp.abs(x)))
  scale = jnp.float32(amax / 448.0)
  state = CommScaling(jnp.float32(amax), jnp.float32(1.0), jnp.int32(0), jnp.float32(0.0))
  d = P(AX)
  variants = [
      (BASELINE, _smap(mesh, bf16_psum_scatter, d, d), (x,)),
      ("bf16 psum_scatter (bf16 in)", _smap(mesh, bf16_psum_scatter_bf16_in, d, d), (xb,)),
      ("fp8 plain all_to_all", _smap(mesh, fp8_plain_all_to_all, d, d), (x,)),
      ("fp8 current", _smap(mesh, fp8_current, d, d), (x,)),
      ("fp8 delayed", _smap(mesh, fp8_delayed, (d, P()), d), (x, scale)),
      ("fp8 delayed, 4 chunks", _smap(mesh, fp8_delayed_chunked, (d, P()), d), (x, scale)),
      ("fp8 delayed -> bf16", _smap(mesh, fp8_delayed_bf16, (d, P()), d), (x, scale)),
      ("fp8 auto (stats+update)", _smap(mesh, fp8_auto, (d, P()), (d, P())), (x, state)),
  ]
  reference = None
  if check:  # rank r holds rows [r*rows, (r+1)*rows): the reduce-scatter is their sum
    reference = np.asarray(jax.device_get(x)).astype(np.float64).reshape(n, rows, cols).sum(0)
  table = report.Table("comm", _title(f"reduce-scatter of {mib} MiB f32 gradients per device",
                                      mesh) + f", median of {iters} calls", COLUMNS)
  _rows(table, variants, iters, log, reference)
  return table


def model_shapes(n_dev: int, model=MODEL) -> dict[str, tuple[int, ...]]:
  """Global gradient shapes of a GPT-style decoder of (layers, d, vocab, context): each
  device holds one full gradient, stacked along dim 0."""
  layers, d, vocab, ctx = model
  shapes = {"embed": (vocab, d), "pos": (ctx, d), "ln_f": (d,)}
  for i in range(layers):
    shapes.update({f"l{i:02d}.qkv": (d, 3 * d), f"l{i:02d}.qkv_b": (3 * d,),
                   f"l{i:02d}.proj": (d, d), f"l{i:02d}.proj_b": (d,),
                   f"l{i:02d}.fc1": (d, 4 * d), f"l{i:02d}.fc1_b": (4 * d,),
                   f"l{i:02d}.fc2": (4 * d, d), f"l{i:02d}.fc2_b": (d,),
                   f"l{i:02d}.ln1": (d,), f"l{i:02d}.ln2": (d,)})
  return {k: (n_dev * s[0],) + s[1:] for k, s in shapes.items()}


def measure_tree(mesh, model=MODEL, iters: int = ITERS, seed: int = 0,
                 log=print) -> report.Table:
  """The table of the per-leaf and one-buffer variants on a model's gradient tree."""
  n = mesh.size
  shapes = model_shapes(n, model)
  tree = {k: _grads(mesh, s, seed + i) for i, (k, s) in enumerate(sorted(shapes.items()))}
  leaves = jax.tree.leaves(tree)
  amaxes = jnp.stack([jnp.max(jnp.abs(a)) for a in leaves])
  scales = amaxes / 448.0
  state = CommScaling(amaxes, jnp.ones_like(amaxes), jnp.zeros(len(leaves), jnp.int32),
                      jnp.zeros_like(amaxes))
  specs = jax.tree.map(lambda _: P(AX), tree)
  variants = [
      (TREE_BASELINE, _smap(mesh, lambda t: jax.tree.map(bf16_psum_scatter, t), (specs,),
                            specs), (tree,)),
      ("fp8 current per leaf", _smap(mesh, lambda t: jax.tree.map(fp8_current, t), (specs,),
                                     specs), (tree,)),
      ("fp8 current, one buffer", _smap(mesh, lambda t: fp8_reduce_scatter_tree(t, AX),
                                        (specs,), specs), (tree,)),
      ("fp8 delayed, one buffer", _smap(
          mesh, lambda t, s: fp8_reduce_scatter_tree(t, AX, scales=s), (specs, P()), specs),
       (tree, scales)),
      ("fp8 delayed, 4 chunks", _smap(
          mesh, lambda t, s: fp8_reduce_scatter_tree(t, AX, scales=s, chunks=4),
          (specs, P()), specs), (tree, scales)),
      ("fp8 auto, one buffer", _smap(mesh, lambda t, s: fp8_reduce_scatter_auto(t, AX, s),
                                     (specs, P()), (specs, P())), (tree, state)),
  ]
  n_params = sum(int(np.prod(s)) for s in shapes.values()) // n
  table = report.Table("comm", _title(f"reduce-scatter of a gradient tree, {len(leaves)} "
                                      f"tensors, {n_params / 1e6:.1f}M f32 parameters per "
                                      "device", mesh) + f", median of {iters} calls", COLUMNS)
  _rows(table, variants, iters, log)
  return table
