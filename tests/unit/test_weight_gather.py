"""fp8jax.fsdp and the FP8 GEMM's gathered weight (8 CPU devices): a weight that lives sharded
gives the GEMM of the whole weight (its E4M3 bytes all-gathered, one rounding), its gradient
lands in the shards; other parameters gather in their payload dtype with a straight-through
gradient; bad input is refused."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax
from fp8jax import fsdp
from conftest import rel_err

DN = (((2,), (0,)), ((), ()))  # nn.Dense: x[B, T, K] . w[K, N]


def _mesh():
  return jax.make_mesh((8,), ("z",), axis_types=(jax.sharding.AxisType.Auto,))


def _gathers(hlo: str) -> list[str]:
  """dtype[dims] of every all-gather in compiled HLO text."""
  return re.findall(r"= (\w+\[[\d,]*\])[^ ]* all-gather\(", hlo)


def _f64(lhs, rhs, dn, g):
  with jax.enable_x64():
    f = lambda l, r: jax.lax.dot_general(l, r, dn, precision="highest")
    args = [jnp.asarray(np.asarray(a, np.float64)) for a in (lhs, rhs, g)]
    y, vjp = jax.vjp(f, *args[:2])
    return [np.asarray(a) for a in (y, *vjp(args[2]))]


# (lhs shape, rhs shape, dimension numbers, rhs home spec): the contraction split (nn.Dense's
# usual ZeRO dim), the output split, nn.DenseGeneral over two contracting axes, a batched
# GEMM, and a split the GEMM's [K, N] layout cannot express (a minor dim of a merged group:
# the weight is then gathered as it is, before its cast).
# The gather's wire: E4M3 bits (u8), or the f32 weight's bits (u32) in the last case.
CASES = [
    ((2, 8, 64), (64, 48), DN, P("z", None), "u8"),
    ((2, 8, 64), (64, 48), DN, P(None, "z"), "u8"),
    ((4, 8, 4, 32), (4, 32, 40), (((2, 3), (0, 1)), ((), ())), P(None, None, "z"), "u8"),
    ((8, 16, 32), (8, 32, 24), (((2,), (1,)), ((0,), (0,))), P(None, "z", None), "u8"),
    ((2, 8, 64), (64, 4, 16), DN, P(None, None, "z"), "u32"),
]


@pytest.mark.parametrize("lhs_shape,rhs_shape,dn,spec,wire", CASES)
def test_gathered_weight_gives_the_whole_weights_gemm(key, lhs_shape, rhs_shape, dn, spec,
                                                      wire):
  """Forward and input gradient equal the unsharded FP8 GEMM's (same casts, same products);
  the weight gradient is summed in f32 into the shards (to f32 rounding); FP8 did run (error
  vs float64 far above BF16's) and every gather moves 1-byte payloads."""
  mesh = _mesh()
  home, full = NamedSharding(mesh, spec), NamedSharding(mesh, P())
  k1, k2, k3 = jax.random.split(key, 3)
  lhs = jax.random.normal(k1, lhs_shape)
  rhs = jax.random.normal(k2, rhs_shape) * 0.1
  out_shape = jax.eval_shape(lambda: jax.lax.dot_general(lhs, rhs, dn)).shape
  g = jax.random.normal(k3, out_shape)
  meta = fp8jax.init_dot_meta()

  def run(lhs, rhs, meta, shardings):
    f = lambda l, r, m: fp8jax.fp8_dot_general_chained(l, r, dn, m,
                                                       weight_shardings=shardings)[0]
    y, vjp = jax.vjp(f, lhs, rhs, meta)
    return (y, *vjp(g))

  plain = jax.jit(lambda l, r, m: run(l, r, m, None))(lhs, rhs, meta)
  sharded_rhs = jax.device_put(rhs, home)
  compiled = jax.jit(lambda l, r, m: run(l, r, m, (home, full))).lower(
      lhs, sharded_rhs, meta).compile()
  gathered = compiled(lhs, sharded_rhs, meta)
  assert gathered[2].sharding.is_equivalent_to(home, rhs.ndim)  # the gradient stays home
  for name, a, b, bound in (("out", gathered[0], plain[0], 1e-6),
                            ("dlhs", gathered[1], plain[1], 1e-6),
                            ("drhs", gathered[2], plain[2], 1e-5)):
    assert rel_err(a, b) < bound, (name, rel_err(a, b))
  for a, b in zip(jax.tree.leaves(gathered[3]), jax.tree.leaves(plain[3])):  # FP8 state
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  refs = _f64(lhs, rhs, dn, g)
  bf16 = jax.vjp(lambda l, r: jax.lax.dot_general(
      l.astype(jnp.bfloat16), r.astype(jnp.bfloat16), dn,
      preferred_element_type=jnp.float32), lhs, rhs)
  bf16 = (bf16[0], *bf16[1](g))
  for name, o, b, ref, bound in zip(("out", "dlhs", "drhs"), gathered[:3], bf16, refs,
                                    (0.08, 0.15, 0.15)):
    assert 3 * rel_err(b, ref) < rel_err(o, ref) < bound, (name, rel_err(o, ref))
  gathers = _gathers(compiled.as_text())
  assert gathers and all(x.startswith(f"{wire}[") for x in gathers), gathers


@pytest.mark.parametrize("fp8", [True, False])
def test_kept_gathered_weight_gives_the_same_gemm_with_one_gather_less(key, fp8):
  """keep_gathered (a GEMM under remat): the backward reuses the gathered weight instead of
  gathering its shard again; same values. FP8 GEMMs gather E4M3 bits, BF16 GEMMs
  (``gathered_dot_general``) the BF16 weight's bits, and their results equal
  ``lax.dot_general``'s (the weight gradient to f32 summation order)."""
  mesh = _mesh()
  home, full = NamedSharding(mesh, P("z", None)), NamedSharding(mesh, P())
  k1, k2, k3 = jax.random.split(key, 3)
  lhs = jax.random.normal(k1, (2, 8, 64))
  rhs = jax.random.normal(k2, (64, 48)) * 0.1
  g = jax.random.normal(k3, (2, 8, 48))
  meta = fp8jax.init_dot_meta()

  def gemm(keep):
    if fp8:
      return lambda l, r: fp8jax.fp8_dot_general_chained(
          l, r, DN, meta, weight_shardings=(home, full), keep_gathered_weight=keep)[0]
    return lambda l, r: fsdp.gathered_dot_general(l, r, DN, home, full, keep_gathered=keep)

  def compiled(f):
    run = lambda l, r: (lambda y, vjp: (y, *vjp(g)))(*jax.vjp(f, l, r))
    return jax.jit(run).lower(lhs, jax.device_put(rhs, home)).compile()

  outs, wires = [], []
  for keep in (False, True):
    c = compiled(gemm(keep))
    outs.append(c(lhs, jax.device_put(rhs, home)))
    wires.append(_gathers(c.as_text()))
  for a, b in zip(*outs):  # same values, to summation order
    assert rel_err(a, b) < 1e-6, rel_err(a, b)
  wire = "u8" if fp8 else "u32"
  assert wires == [[f"{wire}[64,48]"] * 2, [f"{wire}[64,48]"]], wires
  if not fp8:
    plain = jax.jit(lambda l, r: (lambda y, vjp: (y, *vjp(g)))(
        *jax.vjp(lambda l, r: jax.lax.dot_general(l, r, DN), l, r)))(lhs, rhs)
    for name, a, b, bound in zip(("out", "dlhs", "drhs"), outs[0], plain, (1e-6, 1e-6, 1e-5)):
      assert rel_err(a, b) <= bound, (name, rel_err(a, b))


@pytest.mark.parametrize("dtype,scaled,wire", [(None, False, "u32"),
                                              (jnp.bfloat16, False, "u16"),
                                              (jnp.float16, True, "u16")])
def test_gather_array_values_and_straight_through_gradient(key, dtype, scaled, wire):
  """Values as they cross (as is; cast to BF16; FP16 + power-of-two scale, lossless for FP16
  values), the gradient straight through, summed into the home layout in f32; the gather
  moves the payload's bits."""
  mesh = _mesh()
  home, full = NamedSharding(mesh, P(None, "z")), NamedSharding(mesh, P())
  k1, k2 = jax.random.split(key)
  x = (jax.random.normal(k1, (16, 64)) * 3).astype(jnp.float16).astype(jnp.float32)
  c = jax.random.normal(k2, (16, 64))
  f = jax.jit(jax.value_and_grad(
      lambda x: jnp.sum(fsdp.gather_array(x, home, full, dtype=dtype, scaled=scaled) * c)))
  xs = jax.device_put(x, home)
  value, grad = f(xs)
  want = x if dtype is None or scaled else x.astype(dtype)
  want_c = c if dtype is None or scaled else c.astype(dtype).astype(jnp.float32)
  assert rel_err(value, jnp.sum(want.astype(jnp.float32) * c)) < 1e-6
  np.testing.assert_array_equal(np.asarray(grad), np.asarray(want_c))
  assert grad.sharding.is_equivalent_to(home, 2)
  gathers = _gathers(f.lower(xs).compile().as_text())
  assert gathers == [f"{wire}[16,64]"], gathers


def test_gather_tree_leaves_fp8_kernels_to_their_gemm(key):
  """FP8 kernels stay sharded (their GEMM gathers them as E4M3), GEMM weights arrive in the
  compute dtype, other leaves as they were (FP16 payload, lossless here); leaves that are not
  split, and everything without a WeightGather, pass unchanged."""
  mesh = _mesh()
  specs = lambda path, shape: ((P("z") if shape[0] % 8 == 0 else P()), P())
  gather = fsdp.WeightGather(mesh, specs, payload_dtype=jnp.float16)
  k1, k2, k3 = jax.random.split(key, 3)
  params = {"dense": {"kernel": jax.random.normal(k1, (64, 32))},
            "embed": {"embedding": jax.random.normal(k2, (64, 32))},
            "norm": {"scale": 1 + 0.25 * jnp.round(4 * jax.random.normal(k3, (64,)))},
            "odd": {"bias": jnp.ones((3,))}}
  placed = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, specs("", x.shape)[0])),
                        params)
  out = fsdp.gather_tree(placed, gather, matrix_dtype=jnp.bfloat16)
  assert out["dense"]["kernel"] is placed["dense"]["kernel"]
  assert out["odd"]["bias"] is placed["odd"]["bias"]
  assert out["embed"]["embedding"].dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out["embed"]["embedding"]),
                                np.asarray(params["embed"]["embedding"].astype(jnp.bfloat16)))
  np.testing.assert_array_equal(np.asarray(out["norm"]["scale"]),
                                np.asarray(params["norm"]["scale"]))
  assert out["norm"]["scale"].sharding.is_fully_replicated
  assert fsdp.gather_tree(placed, None) is placed


def test_gathering_is_scoped():
  mesh = _mesh()
  a = fsdp.WeightGather(mesh, lambda p, s: (P("z"), P()))
  b = fsdp.WeightGather(mesh, lambda p, s: (P(), P()))
  assert fsdp.active() is None
  with fsdp.gathering(a):
    assert fsdp.active() is a
    with fsdp.gathering(b):
      assert fsdp.active() is b
      assert b.shardings("['x']", (8,)) is None  # not split: nothing to gather
    with fsdp.gathering(None):
      assert fsdp.active() is None
    assert fsdp.active() is a
    assert a.shardings("['x']", (8,)) == (NamedSharding(mesh, P("z")), NamedSharding(mesh, P()))
  assert fsdp.active() is None
  assert fsdp.key_path(("layers", "attn", "kernel")) == "['layers']['attn']['kernel']"


def test_bad_input_is_refused(key):
  mesh = _mesh()
  home, full = NamedSharding(mesh, P("z")), NamedSharding(mesh, P())
  x, w = jax.random.normal(key, (2, 8, 64)), jnp.ones((64, 16))
  meta = fp8jax.init_dot_meta()
  with pytest.raises(TypeError, match=r"expected an fp8jax.fsdp.WeightGather or None, got "
                                      r"dict"):
    with fsdp.gathering({}):
      pass
  with pytest.raises(TypeError, match=r"weight_shardings must be a \(home, gathered\) pair of "
                                      r"NamedShardings, got \('a', 'b'\)"):
    fp8jax.fp8_dot_general_chained(x, w, DN, meta, weight_shardings=("a", "b"))
  cast = fp8jax.dot.cast_weight(w, meta.kernel, fp8jax.Recipe())
  with pytest.raises(ValueError, match=r"weight_cast with weight_shardings is not supported"):
    fp8jax.fp8_dot_general_chained(x, w, DN, meta, weight_cast=cast,
                                   weight_shardings=(home, full))

  def inside(x, w):
    return fp8jax.fp8_dot_general_chained(x, w, DN, meta, amax_axes=("z",),
                                          weight_shardings=(home, full))[0]
  with pytest.raises(ValueError, match=r"weight_shardings inside shard_map is not supported"):
    jax.shard_map(inside, mesh=mesh, in_specs=(P("z"), P()), out_specs=P("z"))(
        jnp.ones((8, 8, 64)), w)


@pytest.mark.parametrize("dim", [0, 1])
def test_local_layouts_gather_and_reduce_scatter_inside_shard_map(key, dim):
  """Inside shard_map (the per-group loop at ZeRO-3) a parameter arrives as its shard
  (``fsdp.Local``): gathered it is the whole parameter, bit for bit (its bits all-gathered),
  and its gradient comes out as this device's chunk of the sum over the devices: f32
  ``psum_scatter`` to f32 summation order; with the FP8 reduce (``grad_comm.fp8_sum_into``) one
  E4M3 rounding of each device's part, sent as 1-byte payloads."""
  from fp8jax.parallel.grad_comm import fp8_sum_into
  mesh = _mesh()
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (16, 8, 64))  # the batch split over the 8 devices
  w = jax.random.normal(k2, (64, 48)) * 0.05
  c = jax.random.normal(k3, (16, 8, 48))  # the loss's cotangent
  spec = [None, None]
  spec[dim] = "z"
  loss = lambda x, w, c: jnp.sum(jnp.einsum("btk,kn->btn", x, w) * c)

  def local(x, w, c, reduce):
    home = fsdp.Local(dim, ("z",), reduce=reduce)
    full = fsdp.Local(dim, ("z",), gathered=True, reduce=reduce)
    whole = lambda w: fsdp.gather_array(w, home, full)
    return whole(w), jax.grad(lambda w: loss(x, whole(w), c))(w)

  ref_dw = jax.jit(jax.grad(loss, 1))(x, w, c)
  outs, hlo = {}, {}
  for name, reduce in (("f32", None), ("fp8", fp8_sum_into)):
    fn = jax.jit(jax.shard_map(
        lambda x, w, c: local(x, w, c, reduce), mesh=mesh,
        in_specs=(P("z"), P(*spec), P("z")), out_specs=(P(), P(*spec)), check_vma=False))
    outs[name] = fn(x, w, c)
    hlo[name] = fn.lower(x, w, c).compile().as_text()
  np.testing.assert_array_equal(np.asarray(outs["f32"][0]), np.asarray(w))
  assert rel_err(outs["f32"][1], ref_dw) < 1e-5
  fp8_err = rel_err(outs["fp8"][1], ref_dw)
  print(f"dim {dim}: FP8 reduce-scatter error {fp8_err:.2e}")
  assert 1e-3 < fp8_err < 2.0 ** -4  # one E4M3 rounding per device's part (relative 2**-4)
  assert re.search(r"u8\[[\d,]*\][^ ]* all-to-all\(", hlo["fp8"]), "no 1-byte all-to-all"
  assert "reduce-scatter(" in hlo["f32"] or "all-reduce(" in hlo["f32"]
