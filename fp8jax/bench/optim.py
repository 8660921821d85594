"""``fp8jax bench optim``: one optimizer step (update + apply) of level O2's optimizer against
``optax.adamw``, side by side in one process on the same parameters and gradients.

Parameters: ``--params`` (default 2^30) split into ``--tensors`` 2-D f32 tensors, drawn
normal x 0.02; gradients normal x 1e-3. Each step is a jitted function with the parameters
and optimizer state donated; it runs 3 warm-up steps, then ``--iters`` steps each waited for
(median) and the best of 3 runs of ``--iters`` steps launched back to back (as in training,
where the host's dispatch overlaps the device).

Modes:
  optax            ``optax.adamw``: f32 parameters, gradients and moments (baseline)
  o2               ``fp8jax.optim.adamw`` (E4M3 m/sqrt(v), FP16 sqrt(v)) composed with FP16
                   master weights (``apply_master_updates``, stochastic rounding) on FP8 E4M3
                   gradients with per-tensor scales
  o2_fused         the same step through ``fp8jax.optim.fused.adamw_master_step`` (one Pallas
                   kernel per tensor on GPUs), which checks the gradients itself
  o2_fused_finite  the same with the finiteness flag passed in (as training passes the
                   clipping norm's)
  clip_optax       ``optax.clip_by_global_norm(1.0)`` then ``optax.adamw`` (baseline of the
                   clip_ rows)
  clip_o2_fused    global-norm clipping of the FP8 gradients (into their scales), then the
                   fused step, finite from the norm (the Trainer's O2 update)
  fp8jax           ``fp8jax.optim.adamw`` alone on f32 parameters and gradients

Columns: ms waited for and back to back with their ratios to the baseline (time / baseline
time: below 1 is faster), the first step's parameter change against the baseline's
(||dp - dp_base|| / ||dp_base||: a step that did nothing shows 1), persistent bytes per
parameter (parameters, optimizer state, gradients) and the compiled step's temporaries.
"""
from __future__ import annotations

import gc
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fp8jax import optim as fo
from fp8jax.bench import report
from fp8jax.bench.timing import back_to_back_ms, memory_gib, time_calls
from fp8jax.optim.fused import adamw_master_step

PARAMS, SMALL_PARAMS = 2**30, 2**16
TENSORS, SMALL_TENSORS = 16, 2
ITERS, SMALL_ITERS = 20, 3
LR, WEIGHT_DECAY = 1e-4, 0.1
MODES = ("optax", "o2", "o2_fused", "o2_fused_finite", "clip_optax",
         "clip_o2_fused", "fp8jax")
DEFAULT_MODES = MODES[:6]
BASELINES = ("optax", "clip_optax")
F32_MODES = ("optax", "clip_optax", "fp8jax")  # f32 parameters and gradients
COLUMNS = (report.Column("ms", "ms waited for"), report.Column("x_base", "time vs baseline"),
           report.Column("b2b_ms", "ms back to back"),
           report.Column("x_base_b2b", "time vs baseline (b2b)"),
           report.Column("update_err", "update vs baseline", ".2e"),
           report.Column("bytes_per_param", "bytes/param", ".3g"),
           report.Column("temp_gib", "temp GiB", ".3g"))


def add_arguments(parser) -> None:
  """The subject's flags."""
  parser.add_argument("--params", type=int, default=None, metavar="N",
                      help="parameters in all (default 2^30; --small 2^16)")
  parser.add_argument("--tensors", type=int, default=None, metavar="K",
                      help=f"2-D tensors they are split into (default {TENSORS}; --small "
                           f"{SMALL_TENSORS})")
  parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                      help=f"comma-separated, of {', '.join(MODES)} (default: all but fp8jax)")


def prepare(args) -> Callable[[Callable[[str], None]], list[report.Table]]:
  """The subject from parsed flags (``small``, ``iters``, ``seed`` and :func:`add_arguments`'
  flags), checked: ``log -> tables`` (`log` prints a progress line)."""
  n = args.params if args.params is not None else (SMALL_PARAMS if args.small else PARAMS)
  k = args.tensors if args.tensors is not None else (SMALL_TENSORS if args.small else TENSORS)
  if k < 1 or n < k:
    raise ValueError(f"bench optim: --params {n} --tensors {k}: need 1 <= tensors <= params")
  modes = tuple(dict.fromkeys(m.strip() for m in args.modes.split(",") if m.strip()))
  bad = [m for m in modes if m not in MODES] or ([] if modes else [""])
  if bad:
    raise ValueError(f"bench optim: --modes {args.modes!r}: unknown mode {bad[0]!r}; known: "
                     f"{', '.join(MODES)}")
  iters = args.iters or (SMALL_ITERS if args.small else ITERS)
  return lambda log: [measure(shapes(n, k), modes, iters, args.seed, log=log)]


def shapes(n_params: int, n_tensors: int) -> list[tuple[int, int]]:
  """`n_tensors` equal 2-D shapes (rows x 4096, 1024 or fewer columns) of about `n_params`
  elements in all."""
  per = max(n_params // n_tensors, 1)
  cols = 4096 if per >= 4096 * 64 else 1024 if per >= 1024 * 8 else per
  return [(max(per // cols, 1), cols)] * n_tensors


def baseline_of(mode: str) -> str:
  """The baseline a mode's ratios divide by."""
  return "clip_optax" if mode.startswith("clip_") else "optax"


def clip_scaled(grads, max_norm: float):
  """(FP8 gradients with scales times min(1, max_norm / global norm), the global norm)."""
  leaves = jax.tree.leaves(grads, is_leaf=fo.is_scaled)
  norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.data.astype(jnp.float32))) * g.scale ** 2
                      for g in leaves))
  factor = jnp.minimum(1.0, max_norm / norm)
  return jax.tree.map(lambda g: g._replace(scale=g.scale * factor), grads,
                      is_leaf=fo.is_scaled), norm


def optimizer(mode: str) -> optax.GradientTransformation:
  """The optax transformation a mode's state belongs to."""
  if mode == "optax":
    return optax.adamw(LR, weight_decay=WEIGHT_DECAY)
  if mode == "clip_optax":
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(LR, weight_decay=WEIGHT_DECAY))
  return fo.adamw(LR, weight_decay=WEIGHT_DECAY)


def step_fn(mode: str, tx: optax.GradientTransformation):
  """jit of ``(params or master weights, optimizer state, grads) -> (new params, new state)``
  with the first two donated."""
  if mode in F32_MODES:
    def step(params, state, grads):
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state
  elif mode == "o2":
    def step(master, state, grads):
      updates, state = tx.update(grads, state, fo.master_params(master))
      return fo.apply_master_updates(master, updates, finite=fo.all_finite(grads)), state
  else:
    def step(master, state, grads):
      finite = None
      if mode == "o2_fused_finite":
        finite = jnp.bool_(True)
      elif mode == "clip_o2_fused":
        grads, norm = clip_scaled(grads, 1.0)
        finite = jnp.isfinite(norm)
      return adamw_master_step(grads, state, master, learning_rate=LR,
                               weight_decay=WEIGHT_DECAY, finite=finite)
  return jax.jit(step, donate_argnums=(0, 1))


def inputs(mode: str, shapes_, seed: int):
  """(params or FP16 master weights, optimizer state, gradients or FP8 gradients, tx)."""
  keys = jax.random.split(jax.random.key(seed), 2 * len(shapes_))
  draw = jax.jit(lambda k, s, scale: jax.random.normal(k, s, jnp.float32) * scale,
                 static_argnums=(1, 2))
  params = {f"t{i:03d}": draw(keys[2 * i], s, 0.02) for i, s in enumerate(shapes_)}
  grads = {f"t{i:03d}": draw(keys[2 * i + 1], s, 1e-3) for i, s in enumerate(shapes_)}
  tx = optimizer(mode)
  state = jax.jit(tx.init)(params)
  if mode not in F32_MODES:
    params = jax.jit(fo.init_master, donate_argnums=0)(params)
    grads = jax.jit(lambda g: jax.tree.map(
        lambda x: fo.quantize_scaled(x, jnp.float8_e4m3fn), g), donate_argnums=0)(grads)
  return params, state, grads, tx


def _f32_params(mode: str, params):
  if mode in F32_MODES:
    return jax.tree.map(lambda a: a.copy(), params)
  return jax.jit(fo.master_params)(params)


@jax.jit
def _delta_err(new, old, ref_delta):
  """(||(new - old) - ref||^2, ||ref||^2) summed over the tree, f32."""
  num = sum(jnp.sum(jnp.square((n - o) - r)) for n, o, r in
            zip(jax.tree.leaves(new), jax.tree.leaves(old), jax.tree.leaves(ref_delta)))
  den = sum(jnp.sum(jnp.square(r)) for r in jax.tree.leaves(ref_delta))
  return num, den


def _time_mode(mode: str, shapes_, iters: int, seed: int, ref_deltas: dict) -> report.Row:
  """One mode's row; a baseline's first parameter change is stored in `ref_deltas`."""
  params, state, grads, tx = inputs(mode, shapes_, seed)
  compiled = step_fn(mode, tx).lower(params, state, grads).compile()
  n = sum(int(np.prod(s)) for s in shapes_)
  persistent = fo.tree_bytes(params) + fo.tree_bytes(state) + fo.tree_bytes(grads)
  before = _f32_params(mode, params)
  params, state = compiled(params, state, grads)
  after = _f32_params(mode, params)
  err, base = None, ref_deltas.get(baseline_of(mode))
  if mode in BASELINES:
    ref_deltas[mode] = jax.tree.map(jnp.subtract, after, before)
  elif base is not None:
    num, den = (float(v) for v in _delta_err(after, before, base))
    err = float(np.sqrt(num / den)) if den > 0 else float("nan")
  del before, after
  carry = [params, state]

  def one_step():
    carry[:] = compiled(carry[0], carry[1], grads)
    return carry
  timing = time_calls(one_step, iters, warmup=3)
  b2b = back_to_back_ms(one_step, iters)
  return report.Row(mode, {"ms": timing.median, "b2b_ms": b2b, "update_err": err,
                           "bytes_per_param": persistent / n,
                           "temp_gib": memory_gib(compiled)["temp"]},
                    baseline=mode in BASELINES)


def measure(shapes_, modes=DEFAULT_MODES, iters: int = ITERS, seed: int = 0,
            log=print) -> report.Table:
  """The table of `modes` on tensors of `shapes_`."""
  n = sum(int(np.prod(s)) for s in shapes_)
  table = report.Table(
      "optim", f"optimizer step, {n:,} parameters in {len(shapes_)} tensors of "
      f"{shapes_[0][0]} x {shapes_[0][1]}; median of {iters} steps", COLUMNS)
  ref_deltas = {}  # baseline -> its first step's parameter change
  rows = {}
  for mode in sorted(modes, key=lambda m: m not in BASELINES):  # baselines first
    t0 = time.perf_counter()
    rows[mode] = _time_mode(mode, shapes_, iters, seed, ref_deltas)
    gc.collect()  # the mode's arrays are gone before the next mode's are made
    log(f"optim {mode}: {rows[mode].values['ms']:.3f} ms waited for, "
        f"{rows[mode].values['b2b_ms']:.3f} ms back to back ({time.perf_counter() - t0:.1f} s "
        "in all)")
  for mode in modes:
    r = rows[mode]
    base = rows.get(baseline_of(mode))
    r.values["x_base"] = report.ratio(r.values["ms"], base and base.values["ms"])
    r.values["x_base_b2b"] = report.ratio(r.values["b2b_ms"], base and base.values["b2b_ms"])
    table.rows.append(r)
  table.notes.append("ratios are time / baseline time (below 1: faster); clip_ rows against "
                     "clip_optax, the others against optax")
  if jax.default_backend() != "gpu":
    table.notes.append(f"{jax.default_backend()}: the fused modes run the kernel's math "
                       "through XLA here (the Pallas kernel is GPU-only)")
  return table
