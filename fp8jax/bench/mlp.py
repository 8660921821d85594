"""``fp8jax bench mlp``: an MLP block's forward+backward in BF16, with Flax's own FP8 op and
with fp8jax, side by side in one process.

Block ``x[T, D] -> Dense(F) -> GELU -> Dense(D)``, bf16 activations and weights, no bias; one
step computes the gradients of the input, both kernels and the FP8 state, as training does.
Inputs are drawn in f32 and rounded to bf16; the output gradient is that of a mean over all
outputs (normal / (T * D)), so an FP8 state whose scales were never updated would flush it to
zero. Every FP8 mode first runs warm-up steps that carry its FP8 state forward (fp8jax:
``fp8jax.apply_fp8_updates``; Flax: its ``OVERWRITE_WITH_GRADIENT`` collection) and is timed
on the warmed state; a mode whose scales did not change is refused.

Modes:
  bf16               ``nn.Dense`` in bf16 (the baseline)
  flax_fp8           ``nn.Dense(dot_general_cls=flax.linen.Fp8DirectDotGeneralOp)``: Flax's
                     FP8 op (the second baseline; ``Fp8DotGeneralOp`` is deprecated in Flax)
  fp8jax             ``fp8jax.linen.Fp8DotGeneral`` with the recipe ``fp8jax train`` uses (the
                     fused cast+transpose kernel where it runs: one GPU, native FP8)
  fp8jax_xla         ``Recipe()``: the same with XLA's casts (the library's default recipe)
  fp8jax_calibrated  the train recipe with ``calibrated=True``: stored scales only (the
                     Trainer's steady step)
  fp8jax_fastbwd     the train recipe with ``bwd_fast_accumulation=True``
  fp8jax_fastdgrad   the train recipe with ``bwd_fast_accumulation="dgrad"`` (weight
                     gradients exact)
  fp8jax_rowwise     the train recipe with row-wise scaling (``granularity="rowwise"``,
                     current scaling; :mod:`fp8jax.rowwise`): one scale per row of each
                     operand along its GEMM's contraction, unit-scale FP8 GEMMs
  fp8jax_rowwise_torchao  ``fp8jax.recipe.ROWWISE``, torchao's row-wise recipe: E4M3
                     gradients, power-of-two scales, fast accumulation in all three GEMMs
  fp8jax_gelu_in_cast  the train recipe with the GELU computed inside the second GEMM's FP8
                     input cast (``Fp8DotGeneral(lhs_activation="gelu")``, the model's
                     ``fuse_gelu_into_fp8_cast``)
  fp8jax_mlp_op      the block as one ``fp8jax.dot.fp8_mlp_chained`` op (train recipe;
                     ``fp8jax.linen.dense_mlp``, the models' GELU MLP): the
                     GELU inside the second GEMM's input cast and its derivative inside the
                     cast of the gradient entering the first GEMM
  gemms_bf16         the block's six GEMMs alone on bf16 operands (baseline of the gemms rows)
  gemms_fp8          the same GEMMs on FP8 operands cast beforehand, bf16 output
  gemms_fp8_f32out   the same with an f32 GEMM output, scaled, then cast to bf16
  gemms_fp8_tn       the same six FP8 GEMMs with every operand laid out K-major beforehand
                     (the layout cuBLASLt's FP8 GEMM reads; no transpose in the program),
                     backward GEMMs exact: the ceiling of the block's FP8 GEMM time
  gemms_fp8_tn_fast  the same with fast accumulation in all six
  gemms_fp8_rowwise  the six GEMMs of gemms_fp8 with f32 output scaled per row and per
                     column (row-wise scaling's epilogue), then cast to bf16

Columns: median ms per step, TFLOP/s (the six GEMMs' 12 T D F FLOPs), speed-ups over bf16 and
over Flax's FP8 op (gemms rows: over gemms_bf16), cuBLASLt FP8 GEMMs in the compiled program,
the gradient error (max over dx, dW0, dW1 of ||g - g_ref|| / ||g_ref||, reference in f32 at
HIGHEST precision on the same data) and the compiled program's temporary memory.
"""
from __future__ import annotations

import functools
import time
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from fp8jax.bench import report
from fp8jax.bench.timing import FP8_GEMM, custom_calls, memory_gib, rel_err, time_calls
from fp8jax.linen import Fp8DotGeneral, apply_fp8_updates, dense_mlp, dense_mlp_reason
from fp8jax.recipe import ROWWISE, Recipe

SHAPE = (16384, 8192, 28672)  # T, D, F of benchmarks/RESULTS.md
SMALL_SHAPE = (256, 128, 512)
ITERS, SMALL_ITERS = 15, 3
WARMUP_STEPS = 3
TRAIN_RECIPE = Recipe(fused_cast_transpose=True)  # fp8jax train's fp8 section defaults
RECIPES = {"fp8jax": TRAIN_RECIPE, "fp8jax_xla": Recipe(),
           "fp8jax_calibrated": TRAIN_RECIPE.replace(calibrated=True),
           "fp8jax_fastbwd": TRAIN_RECIPE.replace(bwd_fast_accumulation=True),
           "fp8jax_fastdgrad": TRAIN_RECIPE.replace(bwd_fast_accumulation="dgrad"),
           "fp8jax_rowwise": TRAIN_RECIPE.replace(granularity="rowwise", scaling="current"),
           "fp8jax_rowwise_torchao": ROWWISE}
GELU_IN_CAST = "fp8jax_gelu_in_cast"
MLP_OP = "fp8jax_mlp_op"
BLOCK_MODES = ("bf16", "flax_fp8") + tuple(RECIPES) + (GELU_IN_CAST, MLP_OP)
GEMM_MODES = ("gemms_bf16", "gemms_fp8", "gemms_fp8_f32out", "gemms_fp8_tn",
              "gemms_fp8_tn_fast", "gemms_fp8_rowwise")
MODES = BLOCK_MODES + GEMM_MODES
DEFAULT_MODES = ("bf16", "flax_fp8", "fp8jax", MLP_OP, "fp8jax_xla", "fp8jax_fastdgrad")
FLAX_FP8_COLLECTION = fp8_ops.OVERWRITE_WITH_GRADIENT
COLUMNS = (report.Column("ms", "ms (median)"), report.Column("tflops", "TFLOP/s", ".4g"),
           report.Column("x_bf16", "speed-up vs bf16"),
           report.Column("x_flax", "speed-up vs Flax FP8"),
           report.Column("fp8_gemms", "cuBLASLt FP8 GEMMs"),
           report.Column("grad_err", "grad error", ".2e"),
           report.Column("temp_gib", "temp GiB", ".3g"))


class MLP(nn.Module):
  """Dense(hidden) -> GELU -> Dense(model), bf16, no bias, the given dot_general_cls;
  `gelu_in_cast`: the second GEMM's dot_general_cls applies the GELU itself (it must take
  ``lhs_activation``); `one_op_recipe`: with it, the two FP8 Dense layers run as one op
  (``fp8jax.linen.dense_mlp``, as the models' GELU MLP does) on the same variables."""
  hidden: int
  model: int
  dot_general_cls: object = None
  gelu_in_cast: bool = False
  one_op_recipe: Recipe | None = None

  @nn.compact
  def __call__(self, x):
    names = ("Dense_0", "Dense_1")
    if self.one_op_recipe is not None and dense_mlp_reason(self, x, names) is None:
      return dense_mlp(self, x, self.one_op_recipe, "gelu", jnp.bfloat16, names)
    kw = dict(use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
              dot_general_cls=self.dot_general_cls)
    h = nn.Dense(self.hidden, **kw)(x)
    if self.gelu_in_cast:
      return nn.Dense(self.model, **{**kw, "dot_general_cls": functools.partial(
          self.dot_general_cls, lhs_activation="gelu")})(h)
    return nn.Dense(self.model, **kw)(nn.gelu(h))


def add_arguments(parser) -> None:
  """The subject's flags."""
  parser.add_argument("--tokens", type=int, default=None, metavar="T",
                      help=f"rows of x (default {SHAPE[0]}; --small {SMALL_SHAPE[0]})")
  parser.add_argument("--model", type=int, default=None, metavar="D",
                      help=f"model width (default {SHAPE[1]}; --small {SMALL_SHAPE[1]})")
  parser.add_argument("--hidden", type=int, default=None, metavar="F",
                      help=f"hidden width (default {SHAPE[2]}; --small {SMALL_SHAPE[2]})")
  parser.add_argument("--modes", default=",".join(DEFAULT_MODES),
                      help=f"comma-separated, of {', '.join(MODES)} (default: "
                           f"{','.join(DEFAULT_MODES)})")


def prepare(args) -> Callable[[Callable[[str], None]], list[report.Table]]:
  """The subject from parsed flags (``small``, ``iters``, ``seed`` and :func:`add_arguments`'
  flags), checked: ``log -> tables`` (`log` prints a progress line)."""
  base = SMALL_SHAPE if args.small else SHAPE
  shape = tuple(v if v is not None else d for v, d in
                zip((args.tokens, args.model, args.hidden), base))
  for name, v in zip(("--tokens", "--model", "--hidden"), shape):
    if v < 1:
      raise ValueError(f"bench mlp: {name} {v}: must be >= 1")
  modes = parse_modes(args.modes)
  iters = args.iters or (SMALL_ITERS if args.small else ITERS)
  return lambda log: [measure(*shape, modes=modes, iters=iters, seed=args.seed, log=log)]


def parse_modes(text: str) -> tuple[str, ...]:
  """The modes of a comma-separated list; ValueError naming an unknown one."""
  modes = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
  bad = [m for m in modes if m not in MODES]
  if bad or not modes:
    raise ValueError(f"bench mlp: --modes {text!r}: unknown mode {bad[0]!r}; known: "
                     f"{', '.join(MODES)}" if bad else
                     f"bench mlp: --modes {text!r}: name at least one of {', '.join(MODES)}")
  return modes


def make_model(mode: str, hidden: int, model: int) -> nn.Module:
  """The block of a block mode."""
  if mode == "bf16":
    return MLP(hidden, model)
  if mode == "flax_fp8":
    return MLP(hidden, model, fp8_ops.Fp8DirectDotGeneralOp)
  if mode in (GELU_IN_CAST, MLP_OP):
    return MLP(hidden, model, functools.partial(Fp8DotGeneral, recipe=TRAIN_RECIPE), True,
               TRAIN_RECIPE if mode == MLP_OP else None)
  return MLP(hidden, model, functools.partial(Fp8DotGeneral, recipe=RECIPES[mode]))


def block_step(model: MLP):
  """jit of ``(variables, x, ct) -> (d variables, dx, y)``: forward and backward of the block
  (the FP8 state's cotangent is its updated value). The output y is returned so that its
  GEMM stays in the program, as a training step's loss keeps it."""
  def step(variables, x, ct):
    y, vjp = jax.vjp(model.apply, variables, x)
    return vjp(ct) + (y,)
  return jax.jit(step)


def carry_fp8_state(variables: dict, grads: dict) -> dict:
  """`variables` with their FP8 state replaced by its updated value from `grads` (fp8jax's
  collection and Flax's ``OVERWRITE_WITH_GRADIENT`` collection)."""
  variables = apply_fp8_updates(variables, grads)
  if FLAX_FP8_COLLECTION in variables:
    variables = {**variables, FLAX_FP8_COLLECTION: grads[FLAX_FP8_COLLECTION]}
  return variables


def scale_leaves(variables: dict) -> dict[str, jax.Array]:
  """{path: value} of every FP8 scale (a leaf whose path names a scale) outside params."""
  out = {}
  for name, tree in variables.items():
    if name == "params":
      continue
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      key = name + jax.tree_util.keystr(path)
      if "scale" in key:
        out[key] = leaf
  return out


def reference_grads(params, x, ct):
  """(param grads, dx) of the block in f32 at HIGHEST precision."""
  def block(p, x):
    h = nn.gelu(jnp.dot(x, p["Dense_0"]["kernel"], precision="highest"))
    return jnp.dot(h, p["Dense_1"]["kernel"], precision="highest")
  @jax.jit
  def grads(params, x, ct):
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)  # noqa: E731
    return jax.vjp(block, f32(params), f32(x))[1](f32(ct))
  return grads(params, x, ct)


def _gemm(a, b, contract, scale, out_dtype, fast: bool):
  """scale * (a . b) contracting a's axis contract[0] with b's contract[1], cast to bf16."""
  dn = (((contract[0],), (contract[1],)), ((), ()))
  precision = jax.lax.Precision.DEFAULT if fast else jax.lax.Precision.HIGHEST
  y = jax.lax.dot_general(a, b, dn, precision=precision, preferred_element_type=out_dtype)
  return (y * scale.astype(out_dtype)).astype(jnp.bfloat16)


def gemms_step(out_dtype):
  """jit of the block's six GEMMs on prepared operands: forward x W0, h W1; input gradients
  g_y W1^T, g_h W0^T; weight gradients h^T g_y, x^T g_h. FP8 operands go straight into
  ``lax.dot_general`` (XLA rewrites that to cuBLASLt FP8 GEMMs on GPUs)."""
  def step(x, w0, h, w1, gy, gh, scale):
    fp8 = x.dtype != jnp.bfloat16
    return (_gemm(x, w0, (1, 0), scale, out_dtype, True),
            _gemm(h, w1, (1, 0), scale, out_dtype, True),
            _gemm(gy, w1, (1, 1), scale, out_dtype, not fp8),
            _gemm(gh, w0, (1, 1), scale, out_dtype, not fp8),
            _gemm(h, gy, (0, 0), scale, out_dtype, not fp8),
            _gemm(x, gh, (0, 0), scale, out_dtype, not fp8))
  return jax.jit(step)


def gemms_rowwise_step():
  """jit of :func:`gemms_step`'s six FP8 GEMMs as row-wise scaling runs them: f32 output
  times a scale per row and per column (vectors over T, D, F), cast to bf16; backward GEMMs
  exact."""
  def mm(a, b, contract, scale_a, scale_b, fast):
    dn = (((contract[0],), (contract[1],)), ((), ()))
    precision = jax.lax.Precision.DEFAULT if fast else jax.lax.Precision.HIGHEST
    y = jax.lax.dot_general(a, b, dn, precision=precision, preferred_element_type=jnp.float32)
    return (y * scale_a[:, None] * scale_b[None, :]).astype(jnp.bfloat16)

  def step(x, w0, h, w1, gy, gh, s_t, s_d, s_f):
    return (mm(x, w0, (1, 0), s_t, s_f, True), mm(h, w1, (1, 0), s_t, s_d, True),
            mm(gy, w1, (1, 1), s_t, s_f, False), mm(gh, w0, (1, 1), s_t, s_d, False),
            mm(h, gy, (0, 0), s_f, s_d, False), mm(x, gh, (0, 0), s_d, s_f, False))
  return jax.jit(step)


def rowwise_operands(args, key):
  """The operands of :func:`gemms_rowwise_step` from :func:`gemm_operands`' (x, W0, h, W1,
  g_y, g_h, scale): the FP8 operands and scale vectors over T, D, F (drawn near 1)."""
  x, w0, h, w1, gy, gh, _ = args
  t, d, f = x.shape[0], x.shape[1], w0.shape[1]
  scales = [1 + 0.1 * jax.random.uniform(k, (n,)) for k, n in
            zip(jax.random.split(key, 3), (t, d, f))]
  return (x, w0, h, w1, gy, gh, *scales)


def gemms_tn_step(fast_bwd: bool):
  """jit of the six GEMMs of :func:`gemms_step` on operands laid out K-major (TN): forward
  x[T, D] . W0^T[F, D], h[T, F] . W1^T[D, F]; input gradients g_y[T, D] . W1[F, D],
  g_h[T, F] . W0[D, F]; weight gradients h^T[F, T] . g_y^T[D, T], x^T[D, T] . g_h^T[F, T];
  every contraction over both operands' last axis."""
  def step(x, w0t, h, w1t, gy, gh, w0, w1, ht, gyt, xt, ght, scale):
    tn = lambda a, b, fast: _gemm(a, b, (1, 1), scale, jnp.bfloat16, fast)  # noqa: E731
    return (tn(x, w0t, True), tn(h, w1t, True), tn(gy, w1, fast_bwd), tn(gh, w0, fast_bwd),
            tn(ht, gyt, fast_bwd), tn(xt, ght, fast_bwd))
  return jax.jit(step)


def tn_operands(args):
  """The operands of :func:`gemms_tn_step` from :func:`gemm_operands`' (x, W0, h, W1, g_y,
  g_h, scale): the transposed copies made (and materialised) beforehand."""
  x, w0, h, w1, gy, gh, scale = args
  t = jax.jit(lambda *a: tuple(jnp.transpose(v) for v in a))
  w0t, w1t, ht, gyt, xt, ght = t(w0, w1, h, gy, x, gh)
  return (x, w0t, h, w1t, gy, gh, w0, w1, ht, gyt, xt, ght, scale)


def gemm_operands(mode: str, x, params, key):
  """(x, W0, h, W1, g_y, g_h, scale) in the mode's operand types (h, g_h drawn afresh; the
  gradients at unit scale: these rows time GEMMs, not scaling)."""
  kh, kg, ky = jax.random.split(key, 3)
  t, f = x.shape[0], params["Dense_0"]["kernel"].shape[1]
  draw = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16)  # noqa: E731
  args = (x, params["Dense_0"]["kernel"], draw(kh, (t, f)), params["Dense_1"]["kernel"],
          draw(ky, x.shape), draw(kg, (t, f)))
  if mode != "gemms_bf16":
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    args = jax.jit(lambda *a: tuple(v.astype(d) for v, d in zip(a, (e4, e4, e4, e4, e5, e5))))(
        *args)
  return args + (jnp.float32(1.0),)


def measure(tokens: int, model: int, hidden: int, modes=DEFAULT_MODES, iters: int = ITERS,
            seed: int = 0, log=print) -> report.Table:
  """The table of `modes` on an MLP block of shape (T, D, F) = (tokens, model, hidden),
  `iters` timed steps each (median)."""
  flops = 12 * tokens * model * hidden
  kx, kc, kp, kg = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(kx, (tokens, model), jnp.float32).astype(jnp.bfloat16)
  ct = (jax.random.normal(kc, (tokens, model), jnp.float32) / (tokens * model)).astype(
      jnp.bfloat16)
  params = MLP(hidden, model).init(kp, x)["params"]
  ref = reference_grads(params, x, ct) if any(m in BLOCK_MODES for m in modes) else None
  table = report.Table(
      "mlp", f"MLP block forward+backward, T={tokens} D={model} F={hidden} "
      f"({flops / 1e12:.3g} TFLOP per step), median of {iters} steps", COLUMNS)
  for mode in modes:
    t0 = time.perf_counter()
    if mode in GEMM_MODES:
      values = _time_gemms(mode, x, params, kg, iters)
    else:
      values = _time_block(mode, x, ct, params, ref, kp, iters)
    values["tflops"] = flops / values["ms"] / 1e9
    table.rows.append(report.Row(mode, values, baseline=mode in ("bf16", "flax_fp8",
                                                                 "gemms_bf16")))
    log(f"mlp {mode}: {values['ms']:.3f} ms ({time.perf_counter() - t0:.1f} s with compile "
        "and warm-up)")
  for r in table.rows:
    base = table.row("gemms_bf16" if r.label in GEMM_MODES else "bf16")
    flax = table.row("flax_fp8")
    r.values["x_bf16"] = report.ratio(base and base.values["ms"], r.values["ms"])
    r.values["x_flax"] = (report.ratio(flax.values["ms"], r.values["ms"])
                          if flax and r.label not in GEMM_MODES else None)
  table.notes.append("speed-up = baseline ms / ms; gemms_* rows against gemms_bf16")
  if jax.default_backend() != "gpu":
    table.notes.append(f"{jax.default_backend()}: FP8 GEMMs are emulated here; the speed "
                       "columns say nothing about a GPU")
  return table


def warm_block(mode: str, x, ct, params, key):
  """(compiled block step, warmed variables) of a block mode: the FP8 state carried through
  WARMUP_STEPS steps on (x, ct); RuntimeError when a scale did not move (cold scales)."""
  net = make_model(mode, params["Dense_0"]["kernel"].shape[1], x.shape[1])
  variables = {**net.init(key, x), "params": params}
  compiled = block_step(net).lower(variables, x, ct).compile()
  initial = scale_leaves(variables)
  if mode != "bf16" and not initial:
    raise RuntimeError(f"bench mlp {mode}: no FP8 scale found in the variables "
                       f"({', '.join(sorted(variables))}); cannot check that they are warm")
  for _ in range(WARMUP_STEPS):  # carry the FP8 state: delayed scales see this data
    dv, _, _ = compiled(variables, x, ct)
    variables = carry_fp8_state(variables, dv)
  stale = [k for k, v in scale_leaves(variables).items() if bool(jnp.all(v == initial[k]))]
  if stale:
    raise RuntimeError(f"bench mlp {mode}: FP8 scales not updated by {WARMUP_STEPS} warm-up "
                       f"steps: {', '.join(stale)}; timing would run on cold scales")
  return compiled, variables


def gemms_program(mode: str, x, params, key):
  """(compiled step, its operands) of a gemms_* mode."""
  args = gemm_operands(mode, x, params, key)
  if mode.startswith("gemms_fp8_tn"):
    args, step = tn_operands(args), gemms_tn_step(mode == "gemms_fp8_tn_fast")
  elif mode == "gemms_fp8_rowwise":
    args, step = rowwise_operands(args, key), gemms_rowwise_step()
  else:
    step = gemms_step(jnp.float32 if mode == "gemms_fp8_f32out" else jnp.bfloat16)
  return step.lower(*args).compile(), args


def _time_block(mode, x, ct, params, ref, key, iters) -> dict:
  compiled, variables = warm_block(mode, x, ct, params, key)
  dv, dx, _ = compiled(variables, x, ct)
  ref_p, ref_dx = ref
  err = max(rel_err(dx, ref_dx), *(rel_err(dv["params"][k]["kernel"], ref_p[k]["kernel"])
                                   for k in ("Dense_0", "Dense_1")))
  timing = time_calls(lambda: compiled(variables, x, ct), iters, warmup=1)
  return {"ms": timing.median, "fp8_gemms": custom_calls(compiled.as_text()).get(FP8_GEMM, 0),
          "grad_err": err, "temp_gib": memory_gib(compiled)["temp"]}


def _time_gemms(mode, x, params, key, iters) -> dict:
  compiled, args = gemms_program(mode, x, params, key)
  timing = time_calls(lambda: compiled(*args), iters)
  return {"ms": timing.median, "fp8_gemms": custom_calls(compiled.as_text()).get(FP8_GEMM, 0),
          "grad_err": None, "temp_gib": memory_gib(compiled)["temp"]}
