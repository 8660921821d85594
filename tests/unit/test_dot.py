import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
import fp8jax.dot as fdot
from conftest import primitive_eqns, rel_err

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)

# (lhs shape, rhs shape, dimension_numbers): nn.Dense, nn.DenseGeneral (2 contracting axes,
# batch dims), a contraction over the lhs's first axis, and an einsum-like layout.
CASES = [
    ((4, 16, 64), (64, 48), (((2,), (0,)), ((), ()))),
    ((8, 4, 32), (4, 32, 40), (((1, 2), (0, 1)), ((), ()))),
    ((6, 32, 64), (6, 64, 48), (((2,), (1,)), ((0,), (0,)))),
    ((64, 32), (64, 48), (((0,), (0,)), ((), ()))),
    ((3, 16, 5, 32), (5, 32, 3, 24), (((3,), (1,)), ((0, 2), (2, 0)))),
]


def _f64_reference(lhs, rhs, dn, g):
  """Output and gradients in float64 (numpy einsum via dot_general semantics)."""
  with jax.enable_x64():
    l64, r64, g64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (lhs, rhs, g))
    f = lambda l, r: jax.lax.dot_general(l, r, dn, precision="highest")
    y, vjp = jax.vjp(f, l64, r64)
    return tuple(np.asarray(a) for a in (y, *vjp(g64)))


@pytest.mark.parametrize("lhs_shape,rhs_shape,dn", CASES)
def test_forward_and_gradients_vs_float64(key, lhs_shape, rhs_shape, dn):
  k1, k2, k3 = jax.random.split(key, 3)
  lhs = jax.random.normal(k1, lhs_shape)
  rhs = jax.random.normal(k2, rhs_shape) * 0.1
  out_shape = jax.eval_shape(lambda: jax.lax.dot_general(lhs, rhs, dn)).shape
  g = jax.random.normal(k3, out_shape)
  refs = _f64_reference(lhs, rhs, dn, g)
  meta = fp8jax.init_dot_meta()

  def run(l, r):
    y, vjp = jax.vjp(lambda l, r: fp8jax.fp8_dot_general(l, r, dn, meta), l, r)
    return (y, *vjp(g))

  def run_bf16(l, r):
    f = lambda l, r: jax.lax.dot_general(l.astype(jnp.bfloat16), r.astype(jnp.bfloat16), dn,
                                         preferred_element_type=jnp.float32)
    y, vjp = jax.vjp(f, l, r)
    return (y, *vjp(g.astype(jnp.float32)))

  fp8_outs, bf16_outs = jax.jit(run)(lhs, rhs), jax.jit(run_bf16)(lhs, rhs)
  for name, o, b, ref, bound in zip(("out", "dlhs", "drhs"), fp8_outs, bf16_outs, refs,
                                    (0.08, 0.15, 0.15)):
    assert o.shape == ref.shape
    e, e_bf16 = rel_err(o, ref), rel_err(b, ref)
    assert e < bound, (name, e)
    assert e > 3 * e_bf16, (name, e, e_bf16)  # FP8 actually happened


def test_gradient_of_meta_is_the_updated_meta(key):
  k1, k2, k3 = jax.random.split(key, 3)
  x, w = jax.random.normal(k1, (32, 64)) * 3, jax.random.normal(k2, (64, 16))
  g = jax.random.normal(k3, (32, 16)) * 1e-3
  dn = (((1,), (0,)), ((), ()))
  meta = fp8jax.init_dot_meta(fp8jax.Recipe(amax_history_len=4))
  _, vjp = jax.vjp(lambda m: fp8jax.fp8_dot_general(x, w, dn, m), meta)
  (new,) = vjp(g)
  for role, t, fmax in (("input", x, 448.0), ("kernel", w, 448.0), ("output_grad", g, 57344.0)):
    m = getattr(new, role)
    amax = float(jnp.max(jnp.abs(t)))
    assert float(m.amax_history[0]) == pytest.approx(amax, rel=1e-6)
    assert not np.asarray(m.amax_history[1:]).any()
    assert float(m.scale) == pytest.approx(amax / fmax, rel=1e-6)


def test_chained_calls_combine_state_by_max_not_sum(key):
  k1, k2, k3 = jax.random.split(key, 3)
  w = jax.random.normal(k1, (64, 32))
  x1, x2 = jax.random.normal(k2, (16, 64)), jax.random.normal(k3, (16, 64)) * 1000
  dn = (((1,), (0,)), ((), ()))

  def loss(meta):
    y1, m = fp8jax.fp8_dot_general_chained(x1, w, dn, meta)
    y2, _ = fp8jax.fp8_dot_general_chained(x2, w, dn, m)
    return jnp.sum(y1) + jnp.sum(y2 * 1e-3)

  new = jax.jit(jax.grad(loss))(fp8jax.init_dot_meta())
  assert float(new.input.amax_history[0]) == float(jnp.max(jnp.abs(x2)))
  assert not np.asarray(new.input.amax_history[1:]).any()  # one push, not two
  assert float(new.kernel.amax_history[0]) == float(jnp.max(jnp.abs(w)))  # not 2x


def test_a_single_calls_backward_combines_nothing(key):
  """A single call's meta passthrough feeds nothing: its cotangent is a symbolic zero, so the
  backward gives the updated state without combining it by max with zeros (one max over an
  amax history per FP8 role), and the state is the same as with the combine."""
  k1, k2 = jax.random.split(key)
  w, x = jax.random.normal(k1, (64, 32)), jax.random.normal(k2, (16, 64))
  dn = (((1,), (0,)), ((), ()))
  meta = fp8jax.init_dot_meta()

  def single(meta):
    return jnp.sum(fp8jax.fp8_dot_general_chained(x, w, dn, meta)[0])

  def passed_on(meta):  # the passthrough feeds the loss (with weight 0): a real cotangent
    y, m = fp8jax.fp8_dot_general_chained(x, w, dn, meta)
    return jnp.sum(y) + 0.0 * sum(jnp.sum(a) for a in jax.tree.leaves(m))

  def history_maxes(loss):
    jaxpr = jax.make_jaxpr(jax.grad(loss))(meta).jaxpr
    return sum(e.outvars[0].aval.shape == (16,) for e in primitive_eqns(jaxpr, "max"))

  assert history_maxes(single) == 0
  assert history_maxes(passed_on) == 3
  for a, b in zip(jax.tree.leaves(jax.grad(single)(meta)),
                  jax.tree.leaves(jax.grad(passed_on)(meta))):
    np.testing.assert_array_equal(a, b)
  assert float(jax.grad(single)(meta).input.amax_history[0]) == float(jnp.max(jnp.abs(x)))


def _dot_eqns(jaxpr):
  """Every dot_general equation in `jaxpr` and its sub-jaxprs, in program order."""
  return primitive_eqns(jaxpr, "dot_general")


def _dot_operand_dtypes(jaxpr):
  """(lhs dtype, rhs dtype) of every dot_general in `jaxpr`."""
  return [tuple(np.dtype(v.aval.dtype) for v in eqn.invars) for eqn in _dot_eqns(jaxpr)]


def _dot_precisions(jaxpr):
  """The precision (first operand's) of every dot_general in `jaxpr`, as text."""
  return [str(p[0] if isinstance(p, tuple) else p)
          for p in (eqn.params["precision"] for eqn in _dot_eqns(jaxpr))]


def test_native_program_feeds_fp8_directly_and_never_e5m2_x_e5m2(key, monkeypatch):
  monkeypatch.setattr(fdot, "native_fp8_reason", lambda: None)
  x, w = jax.random.normal(key, (32, 64)), jax.random.normal(key, (64, 48))
  dn = (((1,), (0,)), ((), ()))
  f = lambda x, w, m: jnp.sum(fp8jax.fp8_dot_general(x, w, dn, m) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1, 2)))(x, w, fp8jax.init_dot_meta()).jaxpr
  dtypes = _dot_operand_dtypes(jaxpr)
  assert sorted(map(str, dtypes)) == sorted(map(str, [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]))
  assert (E5M2, E5M2) not in dtypes


@pytest.mark.parametrize("fast_bwd", [False, True, "dgrad"])
def test_forward_fast_backward_exact_accumulation_unless_asked(key, monkeypatch, fast_bwd):
  """Forward GEMM: fast accumulation; input gradient (output [32, 64]) fast with True or
  "dgrad"; weight gradient (output [64, 48]) fast only with True."""
  monkeypatch.setattr(fdot, "native_fp8_reason", lambda: None)
  x, w = jax.random.normal(key, (32, 64)), jax.random.normal(key, (64, 48))
  dn = (((1,), (0,)), ((), ()))
  recipe = fp8jax.Recipe(bwd_fast_accumulation=fast_bwd)
  f = lambda x, w, m: jnp.sum(fp8jax.fp8_dot_general(x, w, dn, m, recipe) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, w, fp8jax.init_dot_meta(recipe)).jaxpr
  eqns = list(_dot_eqns(jaxpr))
  by_shape = {tuple(e.outvars[0].aval.shape): p for e, p in zip(eqns, _dot_precisions(jaxpr))}
  assert len(eqns) == 3 and sorted(by_shape) == [(32, 48), (32, 64), (64, 48)], by_shape
  want = {(32, 48): "DEFAULT", (32, 64): "DEFAULT" if fast_bwd else "HIGHEST",
          (64, 48): "DEFAULT" if fast_bwd is True else "HIGHEST"}
  assert all(want[s] in p for s, p in by_shape.items()), by_shape


def test_emulation_is_logged_once_with_its_reason(key, monkeypatch, caplog):
  monkeypatch.setattr(fdot, "_LOGGED", set())
  monkeypatch.setattr(fdot, "native_fp8_reason", lambda: None)
  x, w = jax.random.normal(key, (10, 64)), jax.random.normal(key, (64, 48))  # M=10: no FP8 GEMM
  dn = (((1,), (0,)), ((), ()))
  with caplog.at_level(logging.WARNING, logger="fp8jax"):
    for _ in range(3):
      fp8jax.fp8_dot_general(x, w, dn, fp8jax.init_dot_meta())
  msgs = [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]
  assert len(msgs) == 1 and "M=10" in msgs[0]


def test_a_plan_reason_is_left_to_the_plan_a_shape_reason_is_logged(key, monkeypatch, caplog):
  """With a capability plan installed (the Trainer prints it), its emulation reason is not
  logged again by every GEMM; a reason of the GEMM's own shape still is."""
  from fp8jax import hardware
  monkeypatch.setattr(fdot, "_LOGGED", set())
  report = hardware.local_report()
  dn = (((1,), (0,)), ((), ()))
  kx, kw = jax.random.split(key)
  w = jax.random.normal(kw, (64, 48))

  def logged(plan, m):
    caplog.clear()
    hardware.install_plan(plan)
    with caplog.at_level(logging.WARNING, logger="fp8jax"):
      fp8jax.fp8_dot_general(jax.random.normal(kx, (m, 64)), w, dn, fp8jax.init_dot_meta())
    return [r.getMessage() for r in caplog.records if "emulated" in r.getMessage()]

  try:
    emulating = hardware.CapabilityPlan((report,), (False,), ("no FP8 here",), "per_kind")
    assert logged(emulating, 16) == []
    native = hardware.CapabilityPlan((report,), (True,), (None,), "per_kind")
    msgs = logged(native, 10)  # M=10: cuBLASLt takes no FP8 GEMM of this shape
    assert len(msgs) == 1 and "M=10" in msgs[0]
    msgs = logged(None, 16)  # no plan: the GEMM says why this process emulates
    assert len(msgs) == 1 and "no FP8 GEMMs" in msgs[0]
  finally:
    hardware.install_plan(None)


def test_cpu_is_reported_as_not_native():
  assert "no FP8 GEMMs" in fp8jax.native_fp8_reason()


@pytest.mark.default_codegen
def test_remat_and_jit_give_the_same_gradients(key):
  k1, k2 = jax.random.split(key)
  x, w = jax.random.normal(k1, (32, 64)), jax.random.normal(k2, (64, 48))
  dn = (((1,), (0,)), ((), ()))
  f = lambda x, w, m: jnp.sum(jnp.tanh(fp8jax.fp8_dot_general(x, w, dn, m)))
  meta = fp8jax.init_dot_meta()
  plain = jax.grad(f, argnums=(0, 1, 2))(x, w, meta)
  remat = jax.jit(jax.grad(jax.checkpoint(f), argnums=(0, 1, 2)))(x, w, meta)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(remat)):
    np.testing.assert_allclose(a, b, rtol=1e-6)


def test_bad_inputs_get_clear_errors(key):
  x = jax.random.normal(key, (8, 16))
  dn = (((1,), (0,)), ((), ()))
  with pytest.raises(TypeError, match="Fp8DotMeta.*init_dot_meta"):
    fp8jax.fp8_dot_general(x, x.T, dn, {"scale": 1.0})
  with pytest.raises(TypeError, match="lhs must be a float array"):
    fp8jax.fp8_dot_general(jnp.ones((8, 16), jnp.int32), x.T, dn, fp8jax.init_dot_meta())
  with pytest.raises(TypeError, match="fp8jax.Recipe"):
    fp8jax.fp8_dot_general(x, x.T, dn, fp8jax.init_dot_meta(), recipe="O1")
