"""The LLaMA family's numerics: the transformers reference logits of the fixture checkpoint
(f32), FP8 forward error at O1/O2 against BF16's, GQA and LLaMA-3 RoPE scaling against an
independent numpy forward in Hugging Face's terms, config validation, counts. Training:
test_llama_training.py."""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import FP8_COLLECTION
from fp8jax.interop import hf
from fp8jax.models import layers
from fp8jax.models.llama import (Llama, Llama3RopeScaling, LlamaConfig,
                                 check_tensor_parallel, flops_per_token, init_model,
                                 matmul_param_count)
from fp8jax.optim import init_master, master_params
from fp8jax.recipe import opt_level
from fp8jax.scaling import Fp8Meta
from fp8jax.train import batch_loss
from conftest import rel_err

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "llama_gqa")
TINY = LlamaConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                   max_seq_len=16)


@functools.lru_cache(maxsize=None)
def _fixture():
  """(config, params, input_ids int32[2, 40], transformers' logits f32[2, 40, 512])."""
  cfg, params = hf.load_pretrained(FIXTURE, dtype="float32")
  ref = np.load(os.path.join(FIXTURE, "reference.npz"))
  return cfg, params, ref["input_ids"], ref["logits"]


@functools.lru_cache(maxsize=None)
def _apply(cfg, recipe):
  return jax.jit(Llama(cfg, recipe).apply)


def _fresh_fp8(cfg, recipe, seq_len):
  """The FP8 collection init_model would give (scale 1, zero history), without compiling."""
  shapes = jax.eval_shape(Llama(cfg, recipe).init, jax.random.key(0),
                          jnp.zeros((1, seq_len), jnp.int32))[FP8_COLLECTION]
  return jax.tree.map(lambda m: Fp8Meta(jnp.ones(m.scale.shape), jnp.zeros(m.amax_history.shape)),
                      shapes, is_leaf=lambda x: isinstance(x, Fp8Meta))


# ----------------------------------------------------------------------------- config

@pytest.mark.parametrize("changes, match", [
    ({"n_kv_heads": 3}, r"LlamaConfig.n_kv_heads=3 does not divide n_heads=4"),
    ({"n_kv_heads": 0}, r"LlamaConfig.n_kv_heads=0 is not allowed; use an integer >= 1"),
    ({"d_model": 36}, r"head dim d_model/n_heads=9 is odd"),
    ({"norm_eps": 0.0}, r"LlamaConfig.norm_eps=0.0 is not allowed"),
    ({"rope_theta": 1.0}, r"LlamaConfig.rope_theta=1.0 is not allowed; use a number > 1"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling type 'yarn' is not supported; use one of \['llama3'\]"),
    ({"rope_scaling": {"factor": 0.5}}, r"rope_scaling.factor=0.5 is not allowed"),
    ({"rope_scaling": {"low_freq_factor": 4.0, "high_freq_factor": 1.0}},
     r"high_freq_factor=1.0 is not allowed; use a number > low_freq_factor=4.0"),
    ({"rope_scaling": {"beta": 1.0}}, r"rope_scaling keys \['beta'\] are not allowed"),
    ({"rope_scaling": 8.0}, r"LlamaConfig.rope_scaling=8.0 is not allowed"),
    ({"tie_embeddings": 1}, r"LlamaConfig.tie_embeddings=1 is not allowed; use True or False"),
    ({"dtype": "float64"}, r"LlamaConfig.dtype='float64' is not allowed"),
])
def test_bad_config_raises(changes, match):
  with pytest.raises(ValueError, match=match):
    TINY.replace(**changes)


def test_rope_scaling_mapping_is_converted_and_hashable():
  cfg = TINY.replace(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64})
  assert cfg.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 64)
  assert hash(cfg) == hash(TINY.replace(rope_scaling=Llama3RopeScaling(8.0, 1.0, 4.0, 64)))
  assert cfg.rope_scaling.to_dict()["rope_type"] == "llama3"


# ----------------------------------------------------------------------------- references

def _llama3_reference(inv_freq, factor, low_freq_factor, high_freq_factor, old_context_len):
  """transformers' ``_compute_llama3_parameters`` (modeling_rope_utils, 4.46) in numpy."""
  low_freq_wavelen = old_context_len / low_freq_factor
  high_freq_wavelen = old_context_len / high_freq_factor
  wavelen = 2 * np.pi / inv_freq
  inv_freq_llama = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth_factor = (old_context_len / wavelen - low_freq_factor) / (
      high_freq_factor - low_freq_factor)
  smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + \
      smooth_factor * inv_freq_llama
  is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
  return np.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


@pytest.mark.parametrize("head_dim, theta, scaling", [
    (128, 500000.0, (8.0, 1.0, 4.0, 8192)),   # LLaMA 3.1
    (64, 500000.0, (32.0, 1.0, 4.0, 8192)),   # LLaMA 3.2
    (16, 10000.0, (4.0, 2.0, 8.0, 256)),
])
def test_llama3_rope_scaling_matches_transformers(head_dim, theta, scaling):
  inv_freq = layers.rope_frequencies(head_dim, theta)
  want = _llama3_reference(inv_freq, *scaling)
  got = Llama3RopeScaling(*scaling)(inv_freq)
  np.testing.assert_allclose(got, want, rtol=1e-12)
  # every band is hit: kept, divided by the factor, and smoothed in between
  kept, divided = got == inv_freq, np.isclose(got, inv_freq / scaling[0], rtol=1e-12)
  assert kept.any() and divided.any() and (~kept & ~divided).any()
  cos, sin = layers.rope_tables(48, head_dim, theta, Llama3RopeScaling(*scaling))
  angles = np.arange(48)[:, None] * want[None, :]
  np.testing.assert_allclose(cos, np.cos(angles), atol=1e-6)
  np.testing.assert_allclose(sin, np.sin(angles), atol=1e-6)


def _numpy_forward(t: dict, cfg: LlamaConfig, ids: np.ndarray) -> np.ndarray:
  """transformers' LlamaForCausalLM forward in float64 numpy, from the Hugging Face tensors:
  rotate-half RoPE, repeat_kv, causal softmax attention, SwiGLU, RMSNorm."""
  t = {k: np.asarray(v, np.float64) for k, v in t.items()}
  b, seq = ids.shape
  h, kv, k = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

  def rms(x, w):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps))

  inv_freq = 1.0 / cfg.rope_theta ** (np.arange(0, k, 2) / k)
  if cfg.rope_scaling is not None:
    s = cfg.rope_scaling
    inv_freq = _llama3_reference(inv_freq, s.factor, s.low_freq_factor, s.high_freq_factor,
                                 s.original_max_position_embeddings)
  emb = np.concatenate([np.arange(seq)[:, None] * inv_freq] * 2, axis=-1)
  cos, sin = np.cos(emb), np.sin(emb)
  rotate_half = lambda x: np.concatenate([-x[..., k // 2:], x[..., :k // 2]], -1)
  mask = np.triu(np.full((seq, seq), -np.inf), 1)
  x = t["model.embed_tokens.weight"][ids]
  for i in range(cfg.n_layers):
    w = lambda n: t[f"model.layers.{i}.{n}.weight"]
    y = rms(x, w("input_layernorm"))
    q = (y @ w("self_attn.q_proj").T).reshape(b, seq, h, k).transpose(0, 2, 1, 3)
    kk = (y @ w("self_attn.k_proj").T).reshape(b, seq, kv, k).transpose(0, 2, 1, 3)
    v = (y @ w("self_attn.v_proj").T).reshape(b, seq, kv, k).transpose(0, 2, 1, 3)
    q, kk = q * cos + rotate_half(q) * sin, kk * cos + rotate_half(kk) * sin
    kk, v = np.repeat(kk, h // kv, axis=1), np.repeat(v, h // kv, axis=1)  # repeat_kv
    scores = q @ kk.transpose(0, 1, 3, 2) / np.sqrt(k) + mask
    p = np.exp(scores - scores.max(-1, keepdims=True))
    o = (p / p.sum(-1, keepdims=True)) @ v
    x = x + o.transpose(0, 2, 1, 3).reshape(b, seq, h * k) @ w("self_attn.o_proj").T
    y = rms(x, w("post_attention_layernorm"))
    gate = y @ w("mlp.gate_proj").T
    x = x + ((gate / (1 + np.exp(-gate))) * (y @ w("mlp.up_proj").T)) @ w("mlp.down_proj").T
  x = rms(x, t["model.norm.weight"])
  head = t["model.embed_tokens.weight"] if cfg.tie_embeddings else t["lm_head.weight"]
  return x @ head.T


def test_fixture_numpy_forward_is_the_reference():
  """The numpy forward used below reproduces transformers' logits of the fixture."""
  cfg, params, ids, ref = _fixture()
  got = _numpy_forward(dict(hf.read_tensors(FIXTURE)), cfg, ids)
  assert np.abs(got - ref).max() < 1e-4


@pytest.mark.parametrize("scan", [True, False])
def test_o0_f32_reproduces_transformers_logits(scan):
  cfg, params, ids, ref = _fixture()
  logits = np.asarray(_apply(cfg.replace(scan_layers=scan), None)({"params": params},
                                                                   jnp.asarray(ids)))
  err = float(np.abs(logits - ref).max())
  print(f"scan={scan}: max abs error {err:.2e} (logits up to {np.abs(ref).max():.2f})")
  assert err <= 1e-4


@pytest.mark.parametrize("n_kv, scaling, tied", [
    (1, None, True), (2, Llama3RopeScaling(8.0, 1.0, 4.0, 64), False), (4, None, False)])
def test_gqa_and_rope_scaling_match_numpy_forward(key, n_kv, scaling, tied):
  """Random Hugging Face tensors of a GQA (n_kv 1: multi-query, 4: multi-head) config,
  imported and run in f32, against the float64 numpy forward; the RoPE head dim 8 puts one
  frequency in each LLaMA-3 band. The same config with another n_kv / no scaling is far off,
  so both matter."""
  cfg = TINY.replace(n_kv_heads=n_kv, rope_scaling=scaling, tie_embeddings=tied,
                     dtype="float32")
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
  tensors = {}
  for name, shape in hf._expected_shapes(cfg).items():
    if len(shape) == 1:  # norm gains
      tensors[name] = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    else:  # [out, in], unit-variance outputs (embeddings: unit entries)
      scale = 1.0 if name.startswith("model.embed") else shape[1] ** -0.5
      tensors[name] = (scale * rng.standard_normal(shape)).astype(np.float32)
  ids = rng.integers(0, cfg.vocab_size, (2, 16))
  ref = _numpy_forward(tensors, cfg, ids)
  got = _apply(cfg, None)({"params": hf.params_from_hf(tensors, cfg)}, jnp.asarray(ids))
  err = rel_err(got, ref)
  print(f"n_kv={n_kv} scaling={scaling is not None}: relative error {err:.2e}")
  assert err < 1e-5
  other = cfg.replace(rope_scaling=None if scaling else Llama3RopeScaling(8.0, 1.0, 4.0, 64))
  assert rel_err(_numpy_forward(tensors, other, ids), ref) > 1e-3
  if n_kv == 2:  # query heads paired with key/value heads h % 2 instead of h // 2: far off
    wrong, perm, d = {**tensors}, [0, 2, 1, 3], cfg.d_model
    for i in range(cfg.n_layers):
      q, o = (f"model.layers.{i}.self_attn.{n}_proj.weight" for n in "qo")
      wrong[q] = tensors[q].reshape(4, -1, d)[perm].reshape(-1, d)
      wrong[o] = tensors[o].reshape(d, 4, -1)[:, perm].reshape(d, -1)
    assert rel_err(_numpy_forward(wrong, cfg, ids), ref) > 1e-3


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp8_logits_within_fp8_error(key, level):
  """The fixture model in BF16 compute with FP8 GEMMs (O1: f32 params; O2: the same forward
  from FP16 master weights) on fresh random tokens, against the f32 model: over 20 seeds
  FP8's relative error was 0.098..0.132 (O1) / 0.099..0.129 (O2), BF16's 0.0087..0.011 (so
  FP8 >= 9.9x BF16), the FP16 master round trip alone 8e-4..1.1e-3."""
  cfg, params, _, _ = _fixture()
  lvl = opt_level(level)
  model_params = (jax.jit(lambda p: master_params(init_master(p, lvl.master_dtype)))(params)
                  if lvl.scaled_master else params)
  tokens = jax.random.randint(key, (2, 40), 0, cfg.vocab_size)
  ref = np.asarray(_apply(cfg.replace(dtype="float32"), None)({"params": params}, tokens),
                   np.float64)
  bf16 = rel_err(_apply(cfg, None)({"params": params}, tokens), ref)
  fp8 = rel_err(_apply(cfg, lvl.recipe)({"params": model_params,
                                         FP8_COLLECTION: _fresh_fp8(cfg, lvl.recipe, 40)},
                                        tokens), ref)
  print(f"{level}: FP8 relative error {fp8:.3f}, BF16 {bf16:.4f}")
  assert 3 * bf16 < fp8 < 0.25, (fp8, bf16)


# ----------------------------------------------------------------------------- counts

@pytest.mark.parametrize("cfg", [TINY, TINY.replace(n_kv_heads=1, tie_embeddings=True)])
def test_params_and_flops(cfg):
  params = jax.eval_shape(lambda: init_model(cfg, None, jax.random.key(0), 2, 8))["params"]
  assert ("head" in params) != cfg.tie_embeddings
  assert params["layers"]["attn"]["qkv"]["kernel"].shape == (
      2, 32, cfg.n_kv_heads, 4 // cfg.n_kv_heads + 2, 8)
  count = lambda tree: sum(int(np.prod(a.shape)) for a in jax.tree.leaves(tree))
  norms = count(params["layers"]["norm_attn"]) * 2 + count(params["norm_final"])
  embed = count(params["embed"])
  tied_head = embed if cfg.tie_embeddings else 0  # the tied head is still a GEMM
  assert matmul_param_count(cfg) == count(params) - embed - norms + tied_head
  assert flops_per_token(cfg, 12) == 6 * matmul_param_count(cfg) + 12 * 2 * 32 * 12


def test_check_tensor_parallel():
  check_tensor_parallel(TINY, 2)
  with pytest.raises(ValueError, match=r"model.n_kv_heads=1 does not split over "
                     r"parallel.tensor_parallel_size=2"):
    check_tensor_parallel(TINY.replace(n_kv_heads=1), 2)
  with pytest.raises(ValueError, match=r"model.d_ff=49 does not split"):
    check_tensor_parallel(TINY.replace(d_ff=49), 2)


def test_unrolled_remat_gradients_are_the_scans(key):
  """In f32 the unrolled layers under remat (save_gemm_outputs) give the scan's loss and
  gradients up to summation order (a wrong layer slice or policy would be O(1) off)."""
  cfg = TINY.replace(dtype="float32")
  k1, k2 = jax.random.split(key)
  rng = np.random.default_rng(np.asarray(jax.random.key_data(k1)))
  shapes = jax.eval_shape(lambda: init_model(cfg, None, jax.random.key(0), 1, 8))["params"]
  params = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32),
                        shapes)
  batch = jax.random.randint(k2, (2, 17), 0, cfg.vocab_size)
  out = []
  for c in (cfg, cfg.replace(scan_layers=False, remat=True, remat_policy="save_gemm_outputs")):
    model = Llama(c)
    out.append(jax.jit(jax.value_and_grad(lambda p: batch_loss(
        model.apply, {"params": p}, batch)))(params))
  assert float(out[1][0]) == pytest.approx(float(out[0][0]), rel=1e-6)
  for a, b in zip(jax.tree.leaves(out[0][1]), jax.tree.leaves(out[1][1]), strict=True):
    assert 0 < np.linalg.norm(a) and rel_err(b, a) < 1e-5, a.shape
