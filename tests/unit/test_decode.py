"""KV-cache decoding (fp8jax.models.decode) and FP8 calibration without gradients
(fp8jax.linen.init_fp8_state / calibrate_fp8) on the tiny LLaMA fixture and a small GPT:
cached greedy decoding equals step-by-step recomputation of the full model's logits, sampling
is reproducible and stays in the top k, calibrated amaxes are the operands' own, and
evaluation of the fixture matches its transformers reference logits."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import Recipe
from fp8jax.interop import hf
from fp8jax.linen import FP8_COLLECTION, calibrate_fp8, init_fp8_state
from fp8jax.models import decode
from fp8jax.models.gpt import GPT, ModelConfig, init_model
from fp8jax.models.llama import Llama
from fp8jax.scaling import Fp8Meta
from fp8jax.train import inference

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "llama_gqa")


@pytest.fixture(scope="module")
def fixture():
  """(config f32, params, reference input_ids int32[2, 40], reference logits f32[2, 40, V])."""
  cfg, params = hf.load_pretrained(FIXTURE, dtype="float32")
  ref = np.load(os.path.join(FIXTURE, "reference.npz"))
  return cfg, jax.device_put(params), ref["input_ids"], ref["logits"]


def _full_logits(model, variables, prompt, tokens):
  """Logits the full model gives before each new token: row i after prompt + tokens[:, :i]."""
  seq = jnp.concatenate([prompt, tokens], axis=1)
  logits = jax.jit(model.apply)(variables, seq[:, :-1])
  return np.asarray(logits[:, prompt.shape[1] - 1:])


def _check_greedy(model, variables, prompt, n, atol):
  tokens, logits = decode.generate(model, variables, prompt, max_new_tokens=n)
  again, _ = decode.generate(model, variables, prompt, max_new_tokens=n)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(again))  # deterministic
  full = _full_logits(model, variables, prompt, tokens)
  np.testing.assert_allclose(np.asarray(logits), full, rtol=0, atol=atol)
  np.testing.assert_array_equal(np.asarray(tokens), full.argmax(-1))  # greedy = recomputed
  return tokens, logits


def test_llama_fixture_greedy_decoding_matches_full_recomputation(fixture, key):
  """GQA LLaMA, f32 at O0 (to ~1e-5 of the full model) and bf16 with calibrated FP8 GEMMs
  (the same quantized math: the same scales, each norm inside its GEMMs' cast)."""
  cfg, params, ids, _ = fixture
  prompt = jax.random.randint(key, (2, 9), 0, cfg.vocab_size)
  _check_greedy(Llama(cfg, None), {"params": params}, prompt, 12, atol=1e-4)
  cfg16 = cfg.replace(dtype="bfloat16")
  model = Llama(cfg16, Recipe())
  variables = calibrate_fp8(
      model, {"params": params, FP8_COLLECTION: init_fp8_state(model, ids)}, [ids])
  _, logits = _check_greedy(model, variables, prompt, 12, atol=2e-2)
  assert np.isfinite(np.asarray(logits)).all()


def test_gpt_greedy_decoding_matches_full_recomputation(key):
  """GPT family (MHA, GELU inside fc_out's FP8 cast, RMSNorm inside the casts), bf16 at O1
  (the O0 path is the LLaMA test's)."""
  cfg = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=128,
                    max_seq_len=32)
  prompt = jax.random.randint(key, (2, 5), 0, 256)
  variables = init_model(cfg, Recipe(), jax.random.fold_in(key, 1), 2, 8)
  variables = calibrate_fp8(GPT(cfg, Recipe()), variables, [prompt])
  _check_greedy(GPT(cfg, Recipe()), variables, prompt, 10, atol=2e-2)


def test_sampling_is_reproducible_and_stays_in_the_top_k(fixture, key):
  cfg, params, _, _ = fixture
  model, variables = Llama(cfg, None), {"params": params}
  prompt = jax.random.randint(key, (3, 4), 0, cfg.vocab_size)
  draw = lambda k: decode.generate(model, variables, prompt, max_new_tokens=8,  # noqa: E731
                                   temperature=1.5, top_k=5, key=k)
  tokens, logits = draw(jax.random.fold_in(key, 7))
  again, _ = draw(jax.random.fold_in(key, 7))
  other, _ = draw(jax.random.fold_in(key, 8))
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(again))
  assert not np.array_equal(np.asarray(tokens), np.asarray(other))
  top5 = np.argsort(np.asarray(logits), axis=-1)[..., -5:]
  assert (top5 == np.asarray(tokens)[..., None]).any(-1).all()
  greedy = np.asarray(decode.generate(model, variables, prompt, max_new_tokens=8)[0])
  assert not np.array_equal(np.asarray(tokens), greedy)  # temperature 1.5 does sample


def test_calibration_records_the_operands_amaxes_without_a_backward_pass(fixture):
  """init_fp8_state: never-observed state only (no parameter); calibrate_fp8: each GEMM's
  kernel amax is its weight's max |w| (bf16 as the GEMM reads it), layer 0's qkv input amax
  is max |RMSNorm(embedding)| computed here in float64, every batch is one history entry, and
  the output-gradient states stay unobserved: no backward pass ran."""
  cfg, params, ids, _ = fixture
  model = Llama(cfg.replace(dtype="bfloat16", fp8_head=True), Recipe())
  fp8 = init_fp8_state(model, jax.ShapeDtypeStruct(ids.shape, jnp.int32))
  metas = jax.tree.leaves(fp8, is_leaf=lambda x: isinstance(x, Fp8Meta))
  assert metas and all(isinstance(m, Fp8Meta) for m in metas)
  assert all(np.all(np.asarray(m.scale) == 1) and not np.asarray(m.amax_history).any()
             for m in metas)
  halves = [ids[:, :20], ids[:, 20:]]
  out = calibrate_fp8(model, {"params": params, FP8_COLLECTION: fp8}, halves)
  assert out["params"] is params
  state = out[FP8_COLLECTION]
  head = state["head"]["Fp8DotGeneral_0"]
  w = np.asarray(jnp.asarray(params["head"]["kernel"], jnp.bfloat16), np.float32)
  np.testing.assert_array_equal(np.asarray(head["kernel"].amax_history)[:2], [np.abs(w).max()] * 2)
  np.testing.assert_allclose(float(head["kernel"].scale), np.abs(w).max() / 448, rtol=1e-6)
  qkv = state["layers"]["attn"]["qkv"]["Fp8DotGeneral_0"]
  emb = np.asarray(params["embed"]["embedding"], np.float64)
  gain = np.asarray(params["layers"]["norm_attn"]["scale"][0], np.float64)
  for i, half in enumerate(halves[::-1]):  # newest first
    x = emb[np.asarray(half)]
    normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.norm_eps) * gain
    np.testing.assert_allclose(float(qkv["input"].amax_history[0, i]), np.abs(normed).max(),
                               rtol=1e-2)  # bf16 embedding lookup, bf16-rounded amax
  for m in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Fp8Meta)):
    assert np.count_nonzero(np.asarray(m.amax_history)[..., 2:]) == 0
  grads = [d["output_grad"] for d in jax.tree.leaves(
      state, is_leaf=lambda x: isinstance(x, dict) and "output_grad" in x)]
  assert grads and not any(np.asarray(g.amax_history).any() for g in grads)


def test_evaluate_the_fixture_against_its_reference_logits(fixture):
  """Loss of the imported checkpoint on the reference ids equals the cross entropy of
  transformers' logits (float64 here) at O0 in f32; at O1, calibrated on forward passes, it
  stays within FP8's error of it."""
  cfg, params, ids, ref_logits = fixture
  logp = ref_logits.astype(np.float64) - np.log(
      np.exp(ref_logits.astype(np.float64)).sum(-1, keepdims=True))
  ref = -np.mean(np.take_along_axis(logp[:, :-1], ids[:, 1:, None], -1))
  got = inference.evaluate(Llama(cfg, None), {"params": params}, [ids])
  assert got.tokens == ids[:, 1:].size and got.bits_per_byte is None
  assert abs(got.loss - ref) < 1e-5 and abs(got.perplexity - np.exp(ref)) < 1e-4 * np.exp(ref)
  loaded = inference.load(f"hf:{FIXTURE}")
  assert loaded.run_level == "O0" and loaded.fp8 is None and loaded.model_config.dtype == \
      "bfloat16"
  model, variables, note = loaded.at_level("O1", [ids[:, :-1]])
  assert note == "FP8 scales calibrated on 1 forward pass"
  fp8 = inference.evaluate(model, variables, [ids], byte_level=True)
  assert abs(fp8.loss - ref) < 0.02 * ref and fp8.bits_per_byte == fp8.loss / np.log(2)


def test_decode_errors(fixture):
  cfg, params, _, _ = fixture
  model, variables = Llama(cfg, None), {"params": params}
  prompt = np.zeros((1, 250), np.int32)
  for kwargs, match in (
      (dict(max_new_tokens=7), r"the prompt's 250 tokens \+ max_new_tokens=7 exceed the "
                               r"model's max_seq_len=256; use at most 6 new tokens"),
      (dict(max_new_tokens=0), r"max_new_tokens=0 is not allowed; use an integer >= 1"),
      (dict(max_new_tokens=2, top_k=600), r"top_k=600 is larger than the vocabulary"),
      (dict(max_new_tokens=2, temperature=-1.0), r"temperature=-1.0 is not allowed")):
    with pytest.raises(ValueError, match=match):
      decode.generate(model, variables, prompt, **kwargs)
  with pytest.raises(ValueError, match=r"the prompt must be token ids int\[batch, length >= 1\]"):
    decode.generate(model, variables, np.zeros((3,), np.int32), max_new_tokens=1)
