"""Row-wise FP8 scaling (Recipe(granularity="rowwise"), fp8jax.rowwise): forward and both
gradients against float64 (FP8 ran: error above BF16's, bounded), more accurate than tensor
scaling where rows (tokens) or channels span more range than one FP8 scale covers, one scale
per row, FP8 dot operands in the lowered program, the FP8 state it records, the refusals, and
the Flax APIs and convert() taking it."""
import contextlib
import functools
import io
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fp8jax
import fp8jax.dot as fdot
import fp8jax.linen as flinen
import fp8jax.nnx as fnnx
from conftest import rel_err
from fp8jax import rowwise
from fp8jax.recipe import ROWWISE

RW = fp8jax.Recipe(granularity="rowwise", scaling="current")
TW = fp8jax.Recipe(scaling="current")
DENSE = (((1,), (0,)), ((), ()))
# (lhs shape, rhs shape, dimension_numbers): nn.Dense over a leading batch, a batched GEMM
# (batch axis 0), a contraction over the lhs's first axis.
CASES = [
    ((4, 16, 64), (64, 48), (((2,), (0,)), ((), ()))),
    ((6, 32, 64), (6, 64, 48), (((2,), (1,)), ((0,), (0,)))),
    ((64, 32), (64, 48), (((0,), (0,)), ((), ()))),
]
OUTLIER = 2.0 ** 16  # > E4M3's normal range (448 / 2**-6 = 2**14.8): one scale cannot cover it


def _f64(lhs, rhs, dn, g):
  """(y, dlhs, drhs) of lax.dot_general in float64."""
  with jax.enable_x64():
    l64, r64, g64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (lhs, rhs, g))
    y, vjp = jax.vjp(lambda l, r: jax.lax.dot_general(l, r, dn, precision="highest"), l64, r64)
    return tuple(np.asarray(a) for a in (y, *vjp(g64)))


def _fp8(recipe, lhs, rhs, dn, g):
  """(y, dlhs, drhs) of fp8_dot_general with `recipe`, jitted."""
  def run(l, r, g):
    y, vjp = jax.vjp(lambda l, r: fp8jax.fp8_dot_general(l, r, dn, fp8jax.init_dot_meta(recipe),
                                                        recipe), l, r)
    return (y, *vjp(g))
  return jax.jit(run)(lhs, rhs, g)


def _bf16(lhs, rhs, dn, g):
  def run(l, r, g):
    f = lambda l, r: jax.lax.dot_general(l.astype(jnp.bfloat16), r.astype(jnp.bfloat16), dn,
                                         preferred_element_type=jnp.float32)
    y, vjp = jax.vjp(f, l, r)
    return (y, *vjp(g))
  return jax.jit(run)(lhs, rhs, g)


@pytest.mark.parametrize("lhs_shape,rhs_shape,dn", CASES)
def test_forward_and_gradients_vs_float64(key, lhs_shape, rhs_shape, dn):
  k1, k2, k3 = jax.random.split(key, 3)
  lhs, rhs = jax.random.normal(k1, lhs_shape), jax.random.normal(k2, rhs_shape) * 0.1
  g = jax.random.normal(k3, jax.eval_shape(lambda: jax.lax.dot_general(lhs, rhs, dn)).shape)
  refs = _f64(lhs, rhs, dn, g)
  for name, o, b, ref, bound in zip(("out", "dlhs", "drhs"), _fp8(RW, lhs, rhs, dn, g),
                                    _bf16(lhs, rhs, dn, g), refs, (0.06, 0.1, 0.1)):
    assert o.shape == ref.shape and o.dtype == jnp.float32
    e, e_bf16 = rel_err(o, ref), rel_err(b, ref)
    assert e < bound, (name, e)
    assert e > 3 * e_bf16, (name, e, e_bf16)  # FP8 actually happened


def _outliers(key, where: str):
  """x[256, 128], w[128, 192] * 0.1, g[256, 192] with a few rows of x and g (tokens) or a
  few columns of x (channels) scaled by OUTLIER; and the indices of the others."""
  k1, k2, k3, k4 = jax.random.split(key, 4)
  x, w = jax.random.normal(k1, (256, 128)), jax.random.normal(k2, (128, 192)) * 0.1
  g = jax.random.normal(k3, (256, 192))
  n = x.shape[0] if where == "tokens" else x.shape[1]
  big = np.asarray(jax.random.choice(k4, n, (4,), replace=False))
  if where == "tokens":
    x, g = x.at[big].multiply(OUTLIER), g.at[big].multiply(OUTLIER)
  else:
    x = x.at[:, big].multiply(OUTLIER)
  return x, w, g, np.setdiff1d(np.arange(n), big)


def test_outlier_tokens_crush_the_other_rows_under_tensor_scaling_not_row_wise(key):
  """A few tokens OUTLIER times larger: with one scale per tensor the other tokens' rows of x
  and g sink below E4M3's normal range; with one per row they keep FP8's precision. Compared
  on the other tokens' rows of y and dx (both recipes with E4M3 gradients, as torchao's
  row-wise recipe)."""
  x, w, g, rows = _outliers(key, "tokens")
  ref = _f64(x, w, DENSE, g)
  errs = {}
  for name, recipe in (("tensor", TW), ("rowwise", RW)):
    y, dx, _ = _fp8(recipe.replace(bwd_format="e4m3"), x, w, DENSE, g)
    errs[name] = [rel_err(a[rows], r[rows]) for a, r in ((y, ref[0]), (dx, ref[1]))]
  print(errs)
  for tensor, row in zip(errs["tensor"], errs["rowwise"]):
    assert row < 0.06 and row < 0.5 * tensor, errs


def test_outlier_channels_crush_the_other_weight_gradient_rows_under_tensor_scaling(key):
  """A few channels (columns of x) OUTLIER times larger: the weight gradient contracts the
  tokens, so row-wise scaling casts x per column there and the other channels' rows of dw
  keep FP8's precision; with one scale per tensor they are crushed."""
  x, w, g, channels = _outliers(key, "channels")
  ref = _f64(x, w, DENSE, g)[2][channels]
  errs = {name: rel_err(_fp8(recipe, x, w, DENSE, g)[2][channels], ref)
          for name, recipe in (("tensor", TW), ("rowwise", RW))}
  print(errs)
  assert errs["rowwise"] < 0.1 and errs["rowwise"] < 0.5 * errs["tensor"], errs


def test_each_row_has_its_own_scale(key):
  """A row of x scaled by 2**12 changes only its own output row (bit for bit elsewhere), and
  by exactly 2**12 (power-of-two scales); under tensor scaling every row changes."""
  k1, k2 = jax.random.split(key)
  x, w = jax.random.normal(k1, (32, 64)), jax.random.normal(k2, (64, 48))
  x2 = x.at[3].multiply(2.0 ** 12)
  for recipe, own in ((RW.replace(power_of_two_scales=True), True), (TW, False)):
    f = jax.jit(lambda x: fp8jax.fp8_dot_general(x, w, DENSE, fp8jax.init_dot_meta(recipe),
                                                  recipe))
    y, y2 = np.asarray(f(x)), np.asarray(f(x2))
    others = np.arange(32) != 3
    assert np.array_equal(y[others], y2[others]) == own
    if own:
      np.testing.assert_array_equal(y2[3], y[3] * 2.0 ** 12)


def test_quantize_along_matches_per_row_tensor_scaling(key):
  """quantize_along(x, axis) casts each slice as a tensor-scaled current cast of that slice
  alone would (same scale, same FP8 values)."""
  x = jax.random.normal(key, (8, 32)) * jnp.logspace(-3, 3, 8)[:, None]
  for axis in (0, 1):
    q, s, amax = rowwise.quantize_along(x, axis, RW, RW.fwd_format)
    assert s.shape == amax.shape == (x.shape[1 - axis],)
    for i in range(x.shape[1 - axis]):
      sl = jnp.take(x, i, axis=1 - axis)
      ts = fp8jax.scaling.scale_for_cast(fp8jax.init_meta(1), fp8jax.scaling.compute_amax(sl),
                                         TW, TW.fwd_format)
      np.testing.assert_array_equal(np.float32(s[i]), np.float32(ts))
      np.testing.assert_array_equal(np.asarray(jnp.take(q, i, axis=1 - axis), np.float32),
                                    np.asarray(fp8jax.quantize(sl, ts, TW.fwd_format), np.float32))


def test_zero_and_nan_rows(key):
  """A zero row casts to zeros (scale 1) and stays zero in the output; a NaN row makes only
  its own output row NaN."""
  k1, k2 = jax.random.split(key)
  x, w = jax.random.normal(k1, (16, 32)), jax.random.normal(k2, (32, 16))
  x = x.at[2].set(0.0).at[5, 7].set(jnp.nan)
  y = np.asarray(fp8jax.fp8_dot_general(x, w, DENSE, fp8jax.init_dot_meta(RW), RW))
  assert np.all(y[2] == 0) and np.all(np.isnan(y[5]))
  assert np.all(np.isfinite(np.delete(y, 5, axis=0)))


def _dot_operand_dtypes(hlo: str) -> list[tuple[str, ...]]:
  """The operand element types of every dot_general of a lowered (StableHLO) program."""
  dots = re.findall(r"dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\)", hlo)
  return [tuple(t.rsplit("x", 1)[-1].rstrip(">") for t in pair) for pair in dots]


@pytest.mark.parametrize("recipe", [RW, ROWWISE], ids=["e5m2_grads", "torchao"])
def test_native_program_feeds_fp8_to_every_dot(key, monkeypatch, recipe):
  """Lowered with native FP8: the three GEMMs take FP8 operands (E5M2 x E5M2 never) with
  unit scales, f32 out; forward fast accumulation, backward as the recipe says."""
  monkeypatch.setattr(fdot, "native_fp8_reason", lambda: None)
  x, w = jax.random.normal(key, (32, 64)), jax.random.normal(key, (64, 48))
  f = lambda x, w, m: jnp.sum(fp8jax.fp8_dot_general(x, w, DENSE, m, recipe) ** 2)
  hlo = jax.jit(jax.grad(f, argnums=(0, 1, 2))).lower(x, w, fp8jax.init_dot_meta(recipe)).as_text()
  bwd = "f8E5M2" if recipe.bwd_format == jnp.float8_e5m2 else "f8E4M3FN"
  assert sorted(_dot_operand_dtypes(hlo)) == sorted(
      [("f8E4M3FN", "f8E4M3FN"), (bwd, "f8E4M3FN"), ("f8E4M3FN", bwd)]), hlo
  precisions = re.findall(r"dot_general.*precision = \[(\w+), \w+\].*-> tensor<(\d+)x(\d+)xf32>",
                          hlo)
  want = {("32", "48"): "DEFAULT", ("32", "64"): "DEFAULT" if recipe.dgrad_fast else "HIGHEST",
          ("64", "48"): "DEFAULT" if recipe.wgrad_fast else "HIGHEST"}
  assert {(m, n): p for p, m, n in precisions} == want, precisions


def test_meta_records_tensor_amaxes_and_combines_by_max(key):
  """The FP8 state's cotangent: each role's tensor amax recorded (scales as delayed scaling
  would set them); a second call of the same layer combines by max."""
  k1, k2, k3 = jax.random.split(key, 3)
  x, w = jax.random.normal(k1, (32, 64)) * 3, jax.random.normal(k2, (64, 16))
  g = jax.random.normal(k3, (32, 16)) * 1e-3
  recipe = RW.replace(amax_history_len=4)

  def twice(m):
    y1, m = fp8jax.fp8_dot_general_chained(x, w, DENSE, m, recipe)
    y2, _ = fp8jax.fp8_dot_general_chained(x * 0.5, w, DENSE, m, recipe)
    return y1 + y2

  _, vjp = jax.vjp(twice, fp8jax.init_dot_meta(recipe))
  (new,) = vjp(g)
  for role, t, fmax in (("input", x, 448.0), ("kernel", w, 448.0), ("output_grad", g, 57344.0)):
    m = getattr(new, role)
    amax = float(jnp.max(jnp.abs(t)))
    assert float(m.amax_history[0]) == pytest.approx(amax, rel=1e-6), role
    assert not np.asarray(m.amax_history[1:]).any()
    assert float(m.scale) == pytest.approx(amax / fmax, rel=1e-6)


def test_mlp_op_runs_row_wise_gemms(key):
  """fp8_mlp_chained (and so linen.dense_mlp) with a row-wise recipe: RMSNorm -> GEMM ->
  SwiGLU -> GEMM close to float64 in the output and all gradients; its GEMMs are row-wise
  (the result equals two fp8_dot_general_chained calls)."""
  ks = jax.random.split(key, 5)
  x, gain = jax.random.normal(ks[0], (2, 16, 32)), 1 + 0.1 * jax.random.normal(ks[1], (32,))
  w_in, w_out = jax.random.normal(ks[2], (32, 128)) * 0.2, jax.random.normal(ks[3], (64, 32)) * 0.2
  g = jax.random.normal(ks[4], (2, 16, 32))
  m = fp8jax.init_dot_meta(RW)

  def op(x, gain, w_in, w_out):
    return fp8jax.fp8_mlp_chained(x, w_in, w_out, m, m, RW, "swiglu", norm=(gain, 1e-5))[0]

  def two_calls(x, gain, w_in, w_out):
    h = fp8jax.fp8_dot_general_chained(x, w_in, (((2,), (0,)), ((), ())), m, RW,
                                       lhs_norm=(gain, 1e-5))[0]
    h = fp8jax.kernels.cast_transpose.activate(h, "swiglu")
    return fp8jax.fp8_dot_general_chained(h, w_out, (((2,), (0,)), ((), ())), m, RW)[0]

  def ref(x, gain, w_in, w_out):
    h = fp8jax.kernels.cast_transpose.rms_norm(x, gain, 1e-5) @ w_in
    return fp8jax.kernels.cast_transpose.activate(h, "swiglu") @ w_out

  args = (x, gain, w_in, w_out)
  outs = [jax.jit(lambda *a, f=f: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, *a)))(*args)
          for f in (op, two_calls)]
  with jax.enable_x64():
    args64 = [jnp.asarray(np.asarray(a, np.float64)) for a in args]
    y64, vjp64 = jax.vjp(ref, *args64)
    refs = (y64, *vjp64(jnp.asarray(np.asarray(g, np.float64))))
  for a, b, r in zip(*outs, refs):
    np.testing.assert_array_equal(a, b)
    assert rel_err(a, np.asarray(r)) < 0.15


def test_refusals_are_one_line():
  for kwargs, match in (({"granularity": "rowwise"}, "use scaling='current'"),
                        ({"granularity": "block"}, "granularity='block' is not allowed")):
    with pytest.raises(ValueError, match=match) as e:
      fp8jax.Recipe(**kwargs)
    assert "\n" not in str(e.value)
  x, w = jnp.ones((16, 32)), jnp.ones((32, 16))
  wc = fdot.cast_weight(w, fp8jax.init_meta(16), TW)
  with pytest.raises(ValueError, match="weight_cast is not supported with"):
    fp8jax.fp8_dot_general_chained(x, w, DENSE, fp8jax.init_dot_meta(RW), RW, weight_cast=wc)
  mesh = jax.make_mesh((len(jax.devices()),), ("fsdp",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  home = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  gathered = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  with pytest.raises(ValueError, match="ZeRO-3 weight gathers"):
    fp8jax.fp8_dot_general_chained(x, w, DENSE, fp8jax.init_dot_meta(RW), RW,
                                   weight_shardings=(home, gathered))
  with pytest.raises(ValueError, match="cast their weights themselves"):
    flinen.cast_weights({"params": {}}, RW)
  assert RW.rowwise and not TW.rowwise and ROWWISE.rowwise


def test_fused_cast_transpose_falls_back_to_xla_casts(key, monkeypatch, caplog):
  """fused_cast_transpose with a row-wise recipe: XLA casts, said once; same values."""
  monkeypatch.setattr(fdot, "_LOGGED", set())
  x, w = jax.random.normal(key, (32, 64)), jax.random.normal(key, (64, 48))
  fused = RW.replace(fused_cast_transpose=True)
  with caplog.at_level("INFO", logger="fp8jax"):
    y = fp8jax.fp8_dot_general(x, w, DENSE, fp8jax.init_dot_meta(fused), fused)
  assert any("XLA casts instead: row-wise scaling" in r.getMessage() for r in caplog.records)
  np.testing.assert_array_equal(y, fp8jax.fp8_dot_general(x, w, DENSE,
                                                          fp8jax.init_dot_meta(RW), RW))


# ---------------------------------------------------------------------- Flax APIs, convert

class _Mlp(nn.Module):
  recipe: fp8jax.Recipe | None = None

  @nn.compact
  def __call__(self, x):
    kw = {} if self.recipe is None else {
        "dot_general_cls": functools.partial(flinen.Fp8DotGeneral, recipe=self.recipe)}
    h = nn.gelu(nn.Dense(64, **kw)(x))
    return nn.Dense(32, **kw)(h)


def _linen_grads(model, variables, x, g):
  y, vjp = jax.vjp(lambda v: model.apply(v, x), variables)
  return y, vjp(g)[0]


def test_linen_and_convert_take_it(key):
  """Fp8DotGeneral(recipe=row-wise): close to float64, FP8 state updated through
  apply_fp8_updates; convert(model, recipe) is the hand-wired model bit for bit."""
  k1, k2, k3 = jax.random.split(key, 3)
  x, g = jax.random.normal(k1, (4, 16, 32)), jax.random.normal(k2, (4, 16, 32))
  wired = _Mlp(RW)
  variables = wired.init(k3, x)
  y, grads = jax.jit(functools.partial(_linen_grads, wired))(variables, x, g)
  with jax.enable_x64():
    p64 = jax.tree.map(lambda a: jnp.asarray(np.asarray(a, np.float64)), variables["params"])
    y64, vjp = jax.vjp(lambda p: _Mlp().apply({"params": p}, jnp.asarray(np.asarray(x,
                                                                                   np.float64))),
                       p64)
    ref_grads = vjp(jnp.asarray(np.asarray(g, np.float64)))[0]
  assert rel_err(y, np.asarray(y64)) < 0.08
  for a, r in zip(jax.tree.leaves(grads["params"]), jax.tree.leaves(ref_grads)):
    assert rel_err(a, np.asarray(r)) < 0.15
  new = fp8jax.apply_fp8_updates(variables, grads)
  hist = new[fp8jax.FP8_COLLECTION]["Dense_1"]["Fp8DotGeneral_0"]["output_grad"].amax_history
  assert float(hist[0]) == pytest.approx(float(jnp.max(jnp.abs(g))), rel=1e-6)
  converted, report = fp8jax.convert(_Mlp(), RW, x)
  assert report["Dense_0"].format == "E4M3/E5M2 row-wise"
  y_c, grads_c = jax.jit(functools.partial(_linen_grads, converted))(variables, x, g)
  np.testing.assert_array_equal(y_c, y)
  for a, b in zip(jax.tree.leaves(grads_c), jax.tree.leaves(grads)):
    np.testing.assert_array_equal(a, b)


def test_nnx_linear_and_convert_take_it(key):
  """fnnx.Linear(recipe=row-wise) close to float64 with its Fp8State written back;
  convert(model, recipe) gives the same layer."""
  k1, k2 = jax.random.split(key)
  x, g = jax.random.normal(k1, (4, 16, 32)), jax.random.normal(k2, (4, 16, 48))
  lin = fnnx.Linear(32, 48, recipe=RW, rngs=nnx.Rngs(0))
  w, b = (np.asarray(a, np.float64) for a in (lin.kernel[...], lin.bias[...]))

  @nnx.jit
  def step(model, x):
    loss, grads = nnx.value_and_grad(lambda m: jnp.sum(m(x) * g),
                                     argnums=nnx.DiffState(0, fnnx.PARAM_AND_FP8))(model)
    return model(x), fnnx.apply_fp8_updates(model, grads)

  y, grads = step(lin, x)
  x64 = np.asarray(x, np.float64)
  assert rel_err(y, x64 @ w + b) < 0.08
  assert rel_err(grads["kernel"][...],
                 np.einsum("btk,btn->kn", x64, np.asarray(g, np.float64))) < 0.15
  m = lin.fp8_meta.get_value()
  assert float(m.input.amax_history[0]) == pytest.approx(float(jnp.max(jnp.abs(x))), rel=1e-6)
  plain = _NnxWrap(nnx.Linear(32, 48, rngs=nnx.Rngs(0)))
  converted, report = fp8jax.convert(plain, RW)
  assert isinstance(converted.fc, fnnx.Linear) and converted.fc.recipe == RW
  assert report["fc"].format == "E4M3/E5M2 row-wise"
  np.testing.assert_array_equal(nnx.jit(lambda m, x: m.fc(x))(converted, x),
                                nnx.jit(lambda m, x: m(x))(fnnx.Linear(32, 48, recipe=RW,
                                                                       rngs=nnx.Rngs(0)), x))


class _NnxWrap(nnx.Module):
  def __init__(self, fc):
    self.fc = fc


def test_inside_shard_map_each_device_scales_its_own_rows(key):
  """Tokens split over a "data" axis inside shard_map (amax_axes=("data",)): y and dx equal
  the unsplit GEMM's bit for bit (their rows are scaled alike), dw (x and g per column over
  each device's tokens, partial sums added) stays FP8-close to float64, and the recorded FP8
  state is the unsplit one's (tensor amaxes agreed by pmax)."""
  n = len(jax.devices())
  k1, k2, k3 = jax.random.split(key, 3)
  x, w = jax.random.normal(k1, (16 * n, 64)), jax.random.normal(k2, (64, 32)) * 0.1
  g = jax.random.normal(k3, (16 * n, 32))
  meta = fp8jax.init_dot_meta(RW)
  mesh = jax.make_mesh((n,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  P = jax.sharding.PartitionSpec
  x, g = (jax.device_put(a, jax.sharding.NamedSharding(mesh, P("data"))) for a in (x, g))

  def grads(x, w, g, meta, axes=()):
    f = lambda x, w, m: fp8jax.fp8_dot_general(x, w, DENSE, m, RW, amax_axes=axes)
    y, vjp = jax.vjp(f, x, w, meta)
    return (y, *vjp(g))

  split = jax.jit(jax.shard_map(functools.partial(grads, axes=("data",)), mesh=mesh,
                                in_specs=(P("data"), P(), P("data"), P()),
                                out_specs=(P("data"), P("data"), P(), P())))
  y, dx, dw, new = split(x, w, g, meta)
  y1, dx1, dw1, new1 = jax.jit(grads)(x, w, g, meta)
  np.testing.assert_array_equal(y, y1)
  np.testing.assert_array_equal(dx, dx1)
  assert rel_err(dw, _f64(x, w, DENSE, g)[2]) < 0.1
  for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new1)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_remat_saves_the_named_casts_and_gives_the_same_gradients(key):
  """Under jax.checkpoint with the save policies the weight's forward cast and the
  activation's per-column cast are the saved residuals (FP8 bits and scale vectors); the
  gradients equal the un-rematerialized ones."""
  k1, k2 = jax.random.split(key)
  x, w = jax.random.normal(k1, (32, 64)), jax.random.normal(k2, (64, 48))
  f = lambda x, w, m: jnp.sum(jnp.tanh(fp8jax.fp8_dot_general(x, w, DENSE, m, RW)))
  meta = fp8jax.init_dot_meta(RW)
  plain = jax.jit(jax.grad(f, argnums=(0, 1, 2)))(x, w, meta)
  policy = jax.checkpoint_policies.save_only_these_names(fdot.INPUT_CAST_NAME,
                                                         fdot.WEIGHT_CAST_NAME)
  remat = jax.jit(jax.grad(jax.checkpoint(f, policy=policy), argnums=(0, 1, 2)))(x, w, meta)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(f, policy=policy), x, w, meta)
  named = sorted(re.findall(r"^(\S+) named '(\w+)'", out.getvalue(), re.M))
  assert named == sorted([("u8[32,64]", fdot.INPUT_CAST_NAME), ("f32[64]", fdot.INPUT_CAST_NAME),
                          ("u8[64,48]", fdot.WEIGHT_CAST_NAME),
                          ("f32[48]", fdot.WEIGHT_CAST_NAME)]), out.getvalue()
