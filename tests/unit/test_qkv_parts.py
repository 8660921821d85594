"""A fused projection returned as its pieces (qkv -> q, k, v): the parts cast kernel (Pallas
interpreter on CPU) against the cast of the joined array, fp8jax.dot.fp8_dot_parts against
the FP8 GEMM followed by jnp.split, and fp8jax.linen.dense_parts as the models' attention runs
it."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from conftest import rel_err
from fp8jax import dot, scaling
from fp8jax.kernels import cast_transpose as ct

FORMATS = [jnp.float8_e4m3fn, jnp.float8_e5m2]


def _pieces(key, m, groups, counts, width, scales=(1.0, 3.0, 0.5)):
  keys = jax.random.split(key, len(counts))
  return tuple((s * jax.random.normal(k, (m, groups * c * width))).astype(jnp.bfloat16)
               for k, c, s in zip(keys, counts, scales))


def _bits(a):
  return np.asarray(a).view(np.uint8)


def test_join_parts_puts_each_piece_in_its_slots(key):
  """Column block (group, part) of the joined array is the piece's (group, index in piece)."""
  q, k, v = _pieces(key, 8, 2, (3, 1, 1), 4)
  joined = np.asarray(ct.join_parts((q, k, v), (3, 1, 1), 4), np.float32).reshape(8, 2, 5, 4)
  np.testing.assert_array_equal(joined[:, 1, 2], np.asarray(q, np.float32).reshape(8, 2, 3, 4)[:, 1, 2])
  np.testing.assert_array_equal(joined[:, 0, 3], np.asarray(k, np.float32)[:, :4])
  np.testing.assert_array_equal(joined[:, 1, 4], np.asarray(v, np.float32)[:, 4:])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("counts,groups", [((3, 1, 1), 2), ((1, 1, 1), 3)])
def test_kernel_matches_the_joined_cast(key, fmt, counts, groups):
  pieces = _pieces(key, 128, groups, counts, 64)
  joined = ct.join_parts(pieces, counts, 64)
  amax = float(jnp.max(jnp.abs(joined.astype(jnp.float32))))
  scale = jnp.float32(amax / scaling.fp8_max(fmt) * 0.5)  # the largest values saturate
  q, qt, a = ct.cast_transpose_amax_of_parts(pieces, scale, fmt, counts=counts, width=64,
                                             interpret=True, block_k=64)
  rq, rqt, ra = ct.cast_transpose_reference(joined, scale, fmt)
  np.testing.assert_array_equal(_bits(q), _bits(rq))
  np.testing.assert_array_equal(_bits(qt), _bits(rqt))
  assert float(a) == float(ra) == amax
  assert (np.abs(np.asarray(q, np.float32)) == scaling.fp8_max(fmt)).any()


def test_kernel_keeps_nan_and_checks_its_input(key):
  q, k, v = _pieces(key, 64, 2, (1, 1, 1), 64)
  k = k.at[3, 70].set(jnp.nan)
  out, _, amax = ct.cast_transpose_amax_of_parts((q, k, v), jnp.float32(0.01),
                                                 jnp.float8_e4m3fn, counts=(1, 1, 1), width=64,
                                                 interpret=True, block_k=64)
  assert np.isnan(float(amax))
  # k's column 70 is group 1, offset 6: joined column (1 * 3 + 1) * 64 + 6
  assert np.argwhere(np.isnan(np.asarray(out, np.float32))).tolist() == [[3, 262]]
  with ct.interpret_anywhere():
    assert ct.parts_reason((q, k, v), (1, 1, 1), 64, jnp.float8_e4m3fn, block_k=64) is None
    assert "part width 64 is not a multiple of the block (128)" in ct.parts_reason(
        (q, k, v), (1, 1, 1), 64, jnp.float8_e4m3fn)
    assert "are not groups x counts" in ct.parts_reason((q, k, v), (2, 1, 1), 64,
                                                        jnp.float8_e4m3fn, block_k=64)
  with pytest.raises(ValueError, match="are not groups x counts"):
    ct.cast_transpose_amax_of_parts((q, k, v), jnp.float32(1), jnp.float8_e4m3fn,
                                    counts=(2, 1, 1), width=64, interpret=True, block_k=64)


# ----------------------------------------------------------------------- the op

def _data(key, b=2, t=64, d=128, kv=2, g=2, width=128):
  kx, kw, *kc = jax.random.split(key, 5)
  x = jax.random.normal(kx, (b, t, d)).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (d, kv, g + 2, width)) / np.sqrt(d)).astype(jnp.bfloat16)
  cts = tuple(jax.random.normal(k, (b, t, kv, c, width)).astype(jnp.bfloat16)
              for k, c in zip(kc, (g, 1, 1)))
  return x, w, cts


def _op(x, w, meta, recipe):
  return dot.fp8_dot_parts(x, w, meta, recipe, counts=(w.shape[-2] - 2, 1, 1))[0]


def _split(x, w, meta, recipe):
  y = dot.fp8_dot_general_chained(x, w, (((2,), (0,)), ((), ())), meta, recipe)[0]
  return tuple(jnp.split(y, (w.shape[-2] - 2, w.shape[-2] - 1), axis=3))


def _grads(fn, x, w, cts, meta, recipe):
  out, vjp = jax.vjp(lambda *a: fn(*a, recipe), x, w, meta)
  return (out, *vjp(cts))


@pytest.mark.parametrize("fused", [False, True])
def test_op_is_the_gemm_and_split(key, fused):
  """Pieces, input and weight gradients bit-identical to the FP8 GEMM followed by jnp.split
  (the same quantized math; the fused kernel casts exactly as XLA does), FP8 updates equal,
  over a never-observed then a delayed-scaling step; the parts kernels run when fused."""
  x, w, cts = _data(key)
  recipe = fp8jax.Recipe(amax_history_len=4, fused_cast_transpose=fused)
  meta = fp8jax.init_dot_meta(recipe)
  with ct.interpret_anywhere(fused):
    run_op, run_split = (jax.jit(lambda *a, f=f: _grads(f, *a, recipe)) for f in (_op, _split))
    for step in range(2):
      a = run_op(x * (step + 1), w, cts, meta)
      b = run_split(x * (step + 1), w, cts, meta)
      for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(u, np.float32), np.asarray(v, np.float32))
      meta = b[-1]
    jaxpr = str(jax.make_jaxpr(lambda *a: _grads(_op, *a, recipe))(x, w, cts, meta))
  assert jaxpr.count("name=fp8_cast_transpose_amax_part\n") + jaxpr.count(
      "name=fp8_cast_transpose_amax_part ") == (3 if fused else 0)
  assert rel_err(a[1], np.asarray(x, np.float32)) > 0  # (not all zeros)


def test_op_error_against_float64_is_fp8s(key):
  x, w, cts = _data(key)
  recipe = fp8jax.Recipe(fused_cast_transpose=True)
  meta = fp8jax.init_dot_meta(recipe)
  with ct.interpret_anywhere():
    pieces, dx, dw = jax.jit(lambda *a: _grads(_op, *a, recipe))(x, w, cts, meta)[:3]
  x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
  g64 = np.concatenate([np.asarray(c, np.float64) for c in cts], axis=3)
  y64 = np.einsum("btd,dkpw->btkpw", x64, w64)
  refs = (y64, np.einsum("btkpw,dkpw->btd", g64, w64), np.einsum("btd,btkpw->dkpw", x64, g64))
  bf = lambda v: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64)  # noqa: E731
  bf16 = (bf(np.einsum("btd,dkpw->btkpw", bf(x64), bf(w64))),
          np.einsum("btkpw,dkpw->btd", bf(g64), bf(w64)),
          np.einsum("btd,btkpw->dkpw", bf(x64), bf(g64)))
  got = (np.concatenate([np.asarray(p, np.float64) for p in pieces], axis=3), dx, dw)
  for name, a, ref, b16 in zip(("y", "dx", "dw"), got, refs, bf16):
    e = rel_err(a, ref)
    assert 3 * rel_err(b16, ref) < e < 0.15, (name, e, rel_err(b16, ref))  # FP8 ran, bounded


def test_op_bad_input():
  x = jnp.ones((4, 16), jnp.bfloat16)
  m = fp8jax.init_dot_meta()
  with pytest.raises(ValueError, match=r"are not x\[..., D\] @ w\[D, ..., 4, W\]"):
    dot.fp8_dot_parts(x, jnp.ones((16, 2, 3, 8), jnp.bfloat16), m, counts=(2, 1, 1))
  with pytest.raises(ValueError, match="must be positive part counts"):
    dot.fp8_dot_parts(x, jnp.ones((16, 2, 3, 8), jnp.bfloat16), m, counts=(2, 0, 1))
  with pytest.raises(TypeError, match="meta must be an Fp8DotMeta"):
    dot.fp8_dot_parts(x, jnp.ones((16, 2, 3, 8), jnp.bfloat16), m.input, counts=(1, 1, 1))


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_models_run_qkv_as_one_op_in_every_layer(key, family, monkeypatch):
  """At an FP8 level the attention's qkv GEMM runs as the parts op in every layer (at O0
  never), with the qkv Dense layer's variables (also cast outside with cast_weights), and
  the loss gradients equal the Dense-and-split path's."""
  from fp8jax import linen as fp8_linen
  from fp8jax.models import layers
  from fp8jax.models.gpt import GPT, ModelConfig
  from fp8jax.models.llama import Llama, LlamaConfig
  from fp8jax.train.step import next_token_loss
  shape = dict(vocab_size=64, d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=32,
               scan_layers=False)
  build, cfg = ((GPT, ModelConfig(**shape)) if family == "gpt"
                else (Llama, LlamaConfig(n_kv_heads=2, **shape)))
  tokens = jax.random.randint(key, (2, 33), 0, 64)
  recipe = fp8jax.opt_level("O1").recipe
  model = build(cfg, recipe)
  variables = model.init(jax.random.key(1), tokens[:, :-1])
  count = lambda m, v: str(jax.make_jaxpr(m.apply)(v, tokens[:, :-1])).count(  # noqa: E731
      "_fp8_parts")
  x, w, _ = _data(key)
  per_op = str(jax.make_jaxpr(functools.partial(_op, recipe=recipe))(
      x, w, fp8jax.init_dot_meta(recipe))).count("_fp8_parts")
  assert per_op > 0 and count(model, variables) == cfg.n_layers * per_op
  plain = build(cfg, None)
  assert count(plain, plain.init(jax.random.key(1), tokens[:, :-1])) == 0

  def grad(v):
    return jax.jit(jax.grad(lambda v: next_token_loss(model.apply, v, tokens)))(v)
  cast = {**variables, **fp8_linen.cast_weights(variables, recipe, jnp.bfloat16)}
  g_op, g_cast = grad(variables), grad(cast)
  monkeypatch.setattr(layers, "dense_parts_reason", lambda *a, **k: "the Dense path")
  assert count(model, variables) == 0
  g_dense = grad(variables)
  for g in (g_op, g_cast):
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(g["params"])[0],
                            jax.tree.leaves(g_dense["params"]), strict=True):
      assert rel_err(a, b) < 2e-2, (jax.tree_util.keystr(path), rel_err(a, b))
