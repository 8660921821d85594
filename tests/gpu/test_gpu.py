"""GPU facts (sm_89+ only; skipped elsewhere): FP8 GEMMs are selected, native == emulated."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import fp8jax
import fp8jax.dot as fdot
from fp8jax.linen import Fp8DotGeneral

FP8_GEMM = "__cublas$lt$matmul$f8"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(fp8jax.native_fp8_reason() is not None,
                                 reason="needs GPUs with FP8 GEMMs (sm_89+)")]


def _rel(a, ref):
  a = np.asarray(a, np.float32).astype(np.float64)
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def test_dense_forward_backward_compiles_to_three_fp8_gemms():
  layer = nn.Dense(16384, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                   dot_general_cls=functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe()))
  x = jax.random.normal(jax.random.key(0), (8192, 4096), jnp.bfloat16)
  variables = layer.init(jax.random.key(1), x)

  def loss(v, x):
    return jnp.sum(layer.apply(v, x).astype(jnp.float32) ** 2)

  hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(variables, x).compile().as_text()
  assert hlo.count(FP8_GEMM) == 3, hlo[:2000]


def test_native_matches_emulated_and_float64():
  kx, kw, kg = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 3)
  # 8192 tokens: the weight-gradient GEMM contracts over them (accumulation precision).
  x = jax.random.normal(kx, (8192, 2048), jnp.float32).astype(jnp.bfloat16)
  w = (jax.random.normal(kw, (2048, 1536), jnp.float32) / 45).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (8192, 1536), jnp.float32).astype(jnp.bfloat16)
  dn = (((1,), (0,)), ((), ()))
  meta = fp8jax.init_dot_meta()

  def run():
    y, vjp = jax.vjp(lambda x, w: fp8jax.fp8_dot_general(x, w, dn, meta), x, w)
    return (y, *vjp(g))

  native = jax.jit(run)()
  fdot.native_fp8_reason.cache_clear()
  try:
    fdot.native_fp8_reason, saved = (lambda: "forced emulation"), fdot.native_fp8_reason
    emulated = jax.jit(run)()
  finally:
    fdot.native_fp8_reason = saved
  # f32 reference on the GPU at HIGHEST precision (~1e-6, far below FP8's error).
  x32, w32, g32 = (a.astype(jnp.float32) for a in (x, w, g))
  hi = functools.partial(jnp.matmul, precision="highest")
  refs = [np.asarray(r, np.float64) for r in (hi(x32, w32), hi(g32, w32.T), hi(x32.T, g32))]
  for n, e, ref in zip(native, emulated, refs):
    assert _rel(n, np.asarray(e, np.float32)) < 1e-2  # bf16 output rounding only
    assert 5e-3 < _rel(n, ref) < 0.1  # FP8 happened, bounded
    assert _rel(n, ref) < 1.1 * _rel(e, ref)  # no extra error from GEMM accumulation


def _e4m3_steps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """|a - b| in units of the E4M3 spacing at max(|a|, |b|) (2**(e - 3); subnormals 2**-9)."""
  m = np.maximum(np.abs(a), np.abs(b))
  spacing = np.exp2(np.maximum(np.floor(np.log2(np.where(m > 0, m, 1.0))), -6.0) - 3.0)
  return np.abs(a - b) / spacing


def test_fused_gelu_cast_kernel_compiles_and_matches_xla():
  """The Pallas kernel with activation="gelu" through Triton on the device: q_t is q
  transposed; q differs from the XLA reference (which may keep the GELU in f32 where the
  kernel rounds it to bf16, and whose exact tanh differs from the kernel's tanh.approx.f32 in
  the last bits) by at most one E4M3 step and rarely; its error against the exact GELU in
  float64 is no larger than XLA's."""
  from fp8jax.kernels import cast_transpose as ct
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  x = (2 * jax.random.normal(jax.random.key(seed), (4096, 2048))).astype(jnp.bfloat16)
  scale = jnp.float32(0.02)
  q, q_t, amax = ct.cast_transpose_amax(x, scale, jnp.float8_e4m3fn, activation="gelu")
  rq, _, ramax = jax.jit(ct.cast_transpose_reference, static_argnums=(2, 3))(
      x, scale, jnp.float8_e4m3fn, "gelu")
  q32, rq32 = np.asarray(q, np.float32), np.asarray(rq, np.float32)
  np.testing.assert_array_equal(np.asarray(q_t, np.float32), q32.T)
  steps = _e4m3_steps(q32, rq32)
  assert np.max(steps) <= 1.0 and np.mean(steps > 0) < 5e-2, (np.max(steps), np.mean(steps > 0))
  x64 = np.asarray(x, np.float64)
  exact = 0.5 * x64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3))) / 0.02
  exact = np.clip(exact, -448.0, 448.0)
  rel = lambda a: np.linalg.norm(a - exact) / np.linalg.norm(exact)
  assert 5e-3 < rel(q32) <= 1.02 * rel(rq32), (rel(q32), rel(rq32))  # FP8 happened, no worse
  assert float(amax) == pytest.approx(float(ramax), rel=1e-2)


def test_gelu_gradient_cast_kernel_compiles_and_matches_xla():
  """The kernel with activation_input (dy * gelu'(x), approximate tanh) through Triton: q_t is
  q transposed; q is at most one E5M2 step from XLA's exact derivative, rarely, and no less
  accurate against float64."""
  from fp8jax.kernels import cast_transpose as ct
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  k1, k2 = jax.random.split(jax.random.key(seed))
  dy = jax.random.normal(k1, (4096, 2048)).astype(jnp.bfloat16)
  x = (2 * jax.random.normal(k2, (4096, 2048))).astype(jnp.bfloat16)
  scale, e5m2 = jnp.float32(2.0 ** -10), jnp.float8_e5m2
  q, q_t, amax = ct.cast_transpose_amax(dy, scale, e5m2, activation="gelu", activation_input=x)
  rq, _, ramax = jax.jit(ct.cast_transpose_reference, static_argnums=(2, 3))(
      dy, scale, e5m2, "gelu", x)
  q32, rq32 = np.asarray(q, np.float32), np.asarray(rq, np.float32)
  np.testing.assert_array_equal(np.asarray(q_t, np.float32), q32.T)
  m = np.maximum(np.abs(q32), np.abs(rq32))
  steps = np.abs(q32 - rq32) / np.exp2(np.maximum(np.floor(np.log2(np.where(m > 0, m, 1.0))),
                                                  -14.0) - 2.0)
  big = m > 1e-3 * np.max(np.abs(rq32))  # where gelu' nearly vanishes: judged absolutely
  assert np.max(steps[big]) <= 1.0 and np.mean(steps > 0) < 5e-2, (np.max(steps[big]),
                                                                   np.mean(steps > 0))
  assert np.max(np.abs(q32 - rq32)[~big]) <= 1e-3 * np.max(np.abs(rq32))
  x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
  t = np.tanh(np.sqrt(2 / np.pi) * (x64 + 0.044715 * x64**3))
  exact = dy64 * (0.5 * (1 + t) + 0.5 * x64 * (1 - t * t) * np.sqrt(2 / np.pi)
                  * (1 + 3 * 0.044715 * x64**2))
  rel = lambda a: np.linalg.norm(a * float(scale) - exact) / np.linalg.norm(exact)
  assert 3e-2 < rel(q32) <= 1.02 * rel(rq32), (rel(q32), rel(rq32))
  assert float(amax) == pytest.approx(float(ramax), rel=1e-2)


def test_swiglu_cast_kernels_compile_and_match_xla():
  """The gated kernels through Triton (32-bit pair loads, 16-bit pair stores, the transposed
  copy's rows stored at two offsets): forward and backward q within one FP8 step of XLA's
  reference where they differ (a few %: XLA's fusion casts the f32 value without rounding it
  to bf16 first, and the kernel's sigmoid is 1 / (1 + exp(-x))), no less accurate than it
  against float64; q_t == q^T, amax equal to XLA's within 1%."""
  from fp8jax.kernels import cast_transpose as ct
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  k1, k2 = jax.random.split(jax.random.key(seed))
  pairs = (2 * jax.random.normal(k1, (4096, 2 * 1024))).astype(jnp.bfloat16)
  dy = jax.random.normal(k2, (4096, 1024)).astype(jnp.bfloat16)
  ref = jax.jit(ct.cast_transpose_reference, static_argnums=(2, 3))
  for fmt, args, scale in ((jnp.float8_e4m3fn, (pairs,), 2.0 ** -6),
                           (jnp.float8_e5m2, (dy, pairs), 2.0 ** -10)):
    extra = {"activation_input": args[1]} if len(args) > 1 else {}
    q, q_t, amax = ct.cast_transpose_amax(args[0], jnp.float32(scale), fmt,
                                          activation="swiglu", **extra)
    rq, _, ramax = ref(args[0], jnp.float32(scale), fmt, "swiglu", *args[1:])
    q32, rq32 = np.asarray(q, np.float32), np.asarray(rq, np.float32)
    assert q32.shape == rq32.shape == (4096, 1024 * (1 + bool(extra)))
    np.testing.assert_array_equal(np.asarray(q_t, np.float32), q32.T)
    m = np.maximum(np.abs(q32), np.abs(rq32))
    info = jnp.finfo(fmt)  # one step: the spacing of FP8 values at m's binade
    steps = np.abs(q32 - rq32) / np.exp2(np.maximum(np.floor(np.log2(np.where(m > 0, m, 1.0))),
                                                    float(info.minexp)) - float(info.nmant))
    assert np.max(steps) <= 1.0 and np.mean(steps > 0) < 5e-2, (fmt, np.max(steps),
                                                                np.mean(steps > 0))
    assert float(amax) == pytest.approx(float(ramax), rel=1e-2)
    p64 = np.asarray(pairs, np.float64)
    gate, up = p64[:, 0::2], p64[:, 1::2]
    sig = 1 / (1 + np.exp(-gate))
    if extra:
      d = np.asarray(dy, np.float64)
      exact = np.stack([d * up * sig * (1 + gate * (1 - sig)), d * gate * sig], -1)
      exact = exact.reshape(q32.shape)
    else:
      exact = gate * sig * up
    rel = lambda a: np.linalg.norm(a * scale - exact) / np.linalg.norm(exact)  # noqa: E731
    assert 1e-2 < rel(q32) <= 1.02 * rel(rq32), (fmt, rel(q32), rel(rq32))


def test_norm_cast_kernel_compiles_and_matches_xla():
  """The kernel with norm=(rstd, gain) (RMSNorm inside the cast) through Triton: q_t == q^T; q
  within one E4M3 step of XLA's reference where they differ (rarely: XLA may cast the f32 norm
  without rounding it to bf16 first), no less accurate than it against float64; amax equal
  within 1%."""
  from fp8jax.kernels import cast_transpose as ct
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  rows = jnp.exp2(jax.random.uniform(k2, (4096, 1), minval=-4, maxval=4))
  x = (jax.random.normal(k1, (4096, 2048)) * rows).astype(jnp.bfloat16)
  gain = 1 + 0.3 * jax.random.normal(k3, (2048,))
  norm = (ct.rms_norm_rstd(x, 1e-6), gain)
  scale = jnp.float32(2.0 ** -6)
  q, q_t, amax = ct.cast_transpose_amax(x, scale, jnp.float8_e4m3fn, norm=norm)
  rq, _, ramax = jax.jit(ct.cast_transpose_reference, static_argnums=(2,))(
      x, scale, jnp.float8_e4m3fn, norm=norm)
  q32, rq32 = np.asarray(q, np.float32), np.asarray(rq, np.float32)
  np.testing.assert_array_equal(np.asarray(q_t, np.float32), q32.T)
  steps = _e4m3_steps(q32, rq32)
  assert np.max(steps) <= 1.0 and np.mean(steps > 0) < 5e-2, (np.max(steps), np.mean(steps > 0))
  assert float(amax) == pytest.approx(float(ramax), rel=1e-2)
  x64, g64 = np.asarray(x, np.float64), np.asarray(gain, np.float64)
  exact = np.clip(x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + 1e-6) * g64
                  / float(scale), -448.0, 448.0)
  rel = lambda a: np.linalg.norm(a - exact) / np.linalg.norm(exact)  # noqa: E731
  assert 5e-3 < rel(q32) <= 1.02 * rel(rq32), (rel(q32), rel(rq32))


def _gpt_two_ways(cfg, switch: str, off):
  """(FP8 GEMM calls, Triton kernel calls, loss gradients) of the GPT `cfg` on one GPU at O1
  with the fused cast kernel, first as it runs, then with ``fp8jax.models.layers.<switch>``
  replaced by `off` (the path the switch would otherwise skip)."""
  from fp8jax.bench.timing import custom_calls
  from fp8jax.models import layers
  from fp8jax.models.gpt import GPT
  from fp8jax.train import batch_loss
  model = GPT(cfg, fp8jax.opt_level("O1").recipe.replace(fused_cast_transpose=True))
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  tokens = jax.random.randint(jax.random.key(seed), (8, 513), 0, 256)
  variables = model.init(jax.random.key(seed + 1), tokens[:, :-1])

  def compiled():
    grad = jax.jit(jax.grad(lambda v: batch_loss(model.apply, v, tokens)))
    calls = custom_calls(grad.lower(variables).compile().as_text())
    return (calls.get(FP8_GEMM, 0), sum(n for t, n in calls.items() if "triton" in t),
            grad(variables))
  first = compiled()
  on = getattr(layers, switch)
  try:
    setattr(layers, switch, off)
    return first, compiled()
  finally:
    setattr(layers, switch, on)


def _assert_grads_close(grads, ref, tol: float = 5e-2) -> None:
  """Every parameter's gradient within `tol` (relative) of ref's. Two FP8 programs fused
  differently flip FP8 roundings along the whole step: one seed gave an embedding gradient
  2.7% apart; a layout or scaling error moves a gradient by O(1)."""
  for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(grads["params"])[0],
                          jax.tree.leaves(ref["params"]), strict=True):
    err = _rel(a, np.asarray(b, np.float32).astype(np.float64))
    assert err < tol, (jax.tree_util.keystr(path), err)


def test_gpt_with_norm_inside_the_cast_compiles_to_the_same_kernels():
  """GPT (RMSNorm) on one GPU normalizing inside its GEMMs' casts: its gradient compiles to the
  same cuBLASLt FP8 GEMMs and as many cast kernels as with the norms applied first (the norm
  moves into two of them per layer), and the gradients agree with that path's to within
  FP8's run-to-run spread."""
  from fp8jax.models.gpt import ModelConfig
  cfg = ModelConfig(vocab_size=256, d_model=1024, n_layers=2, n_heads=8, d_ff=4096,
                    max_seq_len=512, scan_layers=False, remat=False)
  (gemms, kernels, g_in), (gemms_b, kernels_b, g_before) = _gpt_two_ways(
      cfg, "norm_in_cast", lambda *a, **k: None)
  assert gemms == gemms_b >= 24 and kernels == kernels_b >= 16, (gemms, gemms_b, kernels,
                                                                  kernels_b)
  _assert_grads_close(g_in, g_before)


@pytest.mark.parametrize("mlp", ["gelu", "swiglu"])
def test_gpt_mlp_as_one_op_compiles_to_fp8_gemms_and_cast_kernels(mlp):
  """The GPT's GELU or SwiGLU MLP on one GPU runs as one op (fp8jax.linen.dense_mlp): its
  gradient compiles to the same cuBLASLt FP8 GEMMs (12 for the layer, plus the head's) and the
  same number of fused cast kernels as the two-Dense path (the activation and its derivative
  move into two of them), and the gradients agree with that path's to within FP8's
  run-to-run spread."""
  from fp8jax.models.gpt import ModelConfig
  cfg = ModelConfig(vocab_size=256, d_model=1024, n_layers=1, n_heads=8, d_ff=4096,
                    max_seq_len=512, scan_layers=False, remat=False, mlp=mlp)
  (gemms, kernels, g_op), (gemms_d, kernels_d, g_dense) = _gpt_two_ways(
      cfg, "dense_mlp_reason", lambda *a, **k: "the two-Dense path, for comparison")
  assert gemms == gemms_d >= 12 and kernels == kernels_d >= 8, (gemms, gemms_d, kernels,
                                                                  kernels_d)
  _assert_grads_close(g_op, g_dense)


def test_saved_gemm_outputs_with_cudnn_attention_skip_its_forward():
  """remat_policy="save_gemm_outputs" with cuDNN attention: the compiled step runs the
  attention forward once per layer (not again in the recomputation), and its gradients are as
  accurate as full remat's against the same model in f32.

  Not bit for bit: XLA fuses the two programs differently (where a bf16 intermediate is
  rounded), and FP8 casts turn such last-bit differences into whole-step flips (E5M2: 25%),
  so two FP8 runs differ about as much as each differs from f32 (measured: loss 3.7e-4
  apart, the embedding gradient 12%; on CPUs, where both are bit-identical, the FP8 gradient
  is 12% from f32 and BF16's 0.9%). The f32 model is the yardstick."""
  import re
  from fp8jax.models import GPT, ModelConfig, init_model
  from fp8jax.train import batch_loss
  cfg = ModelConfig(d_model=256, n_layers=2, n_heads=2, d_ff=1024, max_seq_len=256, remat=True,
                    attention_impl="cudnn")
  recipe = fp8jax.O1.recipe
  seed = np.random.randint(1 << 30)
  print("seed", seed)
  variables = init_model(cfg, recipe, jax.random.key(seed), 4, 256)
  batch = jax.random.randint(jax.random.key(seed + 1), (4, 257), 0, 256)
  loss = lambda model: lambda v: batch_loss(model.apply, v, batch)
  ref = jax.jit(jax.grad(loss(GPT(cfg.replace(dtype="float32", remat=False,
                                              attention_impl="xla"), None))))(
      {"params": variables["params"]})["params"]
  ref = np.concatenate([np.ravel(np.asarray(r, np.float64)) for r in jax.tree.leaves(ref)])
  err, fprops = {}, {}
  for policy in ("full", "save_gemm_outputs"):
    model = GPT(cfg.replace(remat_policy=policy), recipe)
    f = jax.jit(jax.value_and_grad(loss(model)))
    hlo = f.lower(variables).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]*fmha[^"]*)"', hlo)
    fprops[policy] = sum("Backward" not in t for t in targets)
    value, grads = f(variables)
    assert np.isfinite(float(value))
    g = np.concatenate([np.ravel(np.asarray(x, np.float64))
                        for x in jax.tree.leaves(grads["params"])])
    err[policy] = np.linalg.norm(g - ref) / np.linalg.norm(ref)
  assert fprops["full"] == 2 * fprops["save_gemm_outputs"] > 0, fprops
  assert 0.03 < err["full"] < 0.3 and 0.03 < err["save_gemm_outputs"] < 0.3, err  # FP8, bounded
  assert 0.75 < err["save_gemm_outputs"] / err["full"] < 1.33, err


def test_fused_update_kernel_reads_bf16_gradients_and_chunks(monkeypatch):
  """On the GPU kernel: BF16 gradients update as the f32 gradients of the same values, and a
  tensor split into several kernel calls (the 32-bit offset limit lowered to 3 blocks here)
  updates bit-identically to one call."""
  from fp8jax.kernels import adam_update as K
  from fp8jax.optim import adamw, init_master
  from fp8jax.optim import fused
  k = jax.random.split(jax.random.key(np.random.randint(1 << 30)), 3)
  params = {"kernel": jax.random.normal(k[0], (16, 4 * K.BLOCK)) * 0.05,
            "embedding": jax.random.normal(k[1], (8, K.BLOCK)) * 0.05}
  g32 = jax.tree.map(lambda p: (jax.random.normal(k[2], p.shape) * 1e-3)
                     .astype(jnp.bfloat16).astype(jnp.float32), params)
  master, state = init_master(params), adamw(1e-3).init(params)
  run = lambda g: jax.device_get(fused.adamw_master_step(g, state, master, learning_rate=1e-3))
  whole = run(g32)
  for a, b in zip(jax.tree.leaves(whole),
                  jax.tree.leaves(run(jax.tree.map(lambda g: g.astype(jnp.bfloat16), g32)))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  monkeypatch.setattr(K, "MAX_CALL_ELEMENTS", 3 * K.BLOCK)
  assert len(fused._chunks(64 * K.BLOCK)) > 1
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(run(g32))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert np.mean(np.asarray(whole[0].params["kernel"].data)
                 != np.asarray(master.params["kernel"].data)) > 0.5
