"""Hugging Face LLaMA checkpoints <-> Llama params: the tree is init_model's, import -> export
-> import is bit-exact (one file and shards with an index), float16/bfloat16 exports cast as
asked, unsupported configs and tensors are refused by name."""
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open

from fp8jax.interop import hf
from fp8jax.models.llama import Llama3RopeScaling, LlamaConfig, init_model

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "llama_gqa")


def _fixture_tensors() -> dict:
  return {n: np.array(a) for n, a in hf.read_tensors(FIXTURE).items()}


def _file_dtypes(path: str) -> dict:
  """name -> dtype string of every tensor in the safetensors files of `path`."""
  out = {}
  for f in os.listdir(path):
    if f.endswith(".safetensors"):
      with safe_open(os.path.join(path, f), framework="np") as st:
        out.update({n: str(st.get_slice(n).get_dtype()) for n in st.keys()})
  return out


def _same_bits(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def _flat(params) -> dict:
  return {jax.tree_util.keystr(p): np.asarray(a)
          for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}


def test_fixture_loads_into_init_models_tree():
  cfg, params = hf.load_pretrained(FIXTURE, dtype="float32", remat=True)
  assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff) == \
      (512, 64, 2, 4, 2, 176)
  assert cfg.norm_eps == 1e-5 and cfg.max_seq_len == 256 and cfg.remat and not cfg.tie_embeddings
  want = jax.eval_shape(lambda: init_model(cfg, None, jax.random.key(0), 1, 8))["params"]
  assert jax.tree.structure(params) == jax.tree.structure(want)
  for got, w in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
    assert got.shape == w.shape and got.dtype == w.dtype == np.float32
  # the fused kernels hold the checkpoint's rows: query head 3 is kv group 1's second head
  t = _fixture_tensors()
  q = t["model.layers.1.self_attn.q_proj.weight"].reshape(4, 16, 64)
  np.testing.assert_array_equal(params["layers"]["attn"]["qkv"]["kernel"][1, :, 1, 1], q[3].T)
  v = t["model.layers.0.self_attn.v_proj.weight"].reshape(2, 16, 64)
  np.testing.assert_array_equal(params["layers"]["attn"]["qkv"]["kernel"][0, :, 0, 3], v[0].T)


@pytest.mark.parametrize("max_shard_bytes", [hf.DEFAULT_MAX_SHARD_BYTES, 100_000])
def test_import_export_import_is_bit_exact(tmp_path, max_shard_bytes):
  cfg, params = hf.load_pretrained(FIXTURE)
  written = hf.save_pretrained(tmp_path, cfg, params, max_shard_bytes=max_shard_bytes)
  files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
  if max_shard_bytes == 100_000:  # 634 kB of tensors: shards of <= 100 kB (or one tensor)
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(tmp_path / hf.INDEX_FILE) as f:
      index = json.load(f)
    tensors = _fixture_tensors()
    assert sorted(index["weight_map"]) == sorted(tensors)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in tensors.values())
    for fname in files:
      sizes = [tensors[n].nbytes for n, f in index["weight_map"].items() if f == fname]
      assert sum(sizes) <= max_shard_bytes or len(sizes) == 1, (fname, sizes)
  else:
    assert files == [hf.WEIGHTS_FILE] and not os.path.exists(tmp_path / hf.INDEX_FILE)
  assert str(tmp_path / hf.CONFIG_FILE) in written
  _same_bits(_fixture_tensors(), {n: np.array(a) for n, a in hf.read_tensors(tmp_path).items()})
  cfg2, params2 = hf.load_pretrained(tmp_path)
  assert cfg2 == cfg
  _same_bits(_flat(params), _flat(params2))
  with safe_open(os.path.join(tmp_path, files[0]), framework="np") as st:
    assert st.metadata() == {"format": "pt"}  # transformers refuses files without it


@pytest.mark.parametrize("dtype, tag", [("float16", "F16"), ("bfloat16", "BF16")])
def test_half_precision_export_casts(tmp_path, dtype, tag):
  cfg, params = hf.load_pretrained(FIXTURE)
  hf.save_pretrained(tmp_path, cfg, params, dtype=dtype, max_shard_bytes=200_000,
                     extra_config={"bos_token_id": 1, "hidden_size": 7})
  assert set(_file_dtypes(tmp_path).values()) == {tag}
  with open(tmp_path / hf.CONFIG_FILE) as f:
    config = json.load(f)
  assert config["torch_dtype"] == dtype and config["bos_token_id"] == 1
  assert config["hidden_size"] == 64  # fp8jax's keys win over extra_config
  np_dtype = np.float16 if dtype == "float16" else ml_dtypes.bfloat16
  original = _fixture_tensors()
  for name, a in hf.read_tensors(tmp_path).items():
    assert a.dtype == np_dtype
    want = original[name].astype(np_dtype)  # round to nearest even
    assert a.tobytes() == want.tobytes(), name
    assert 0 < np.abs(want.astype(np.float32) - original[name]).max()  # it did round
  # read back into f32 params: exactly the rounded values; into bf16 params as asked
  _, p32 = hf.load_pretrained(tmp_path)
  _, ref = hf.load_pretrained(FIXTURE)
  for a, b in zip(jax.tree.leaves(p32), jax.tree.leaves(ref)):
    assert a.dtype == np.float32
    np.testing.assert_array_equal(a, b.astype(np_dtype).astype(np.float32))
  _, pbf = hf.load_pretrained(tmp_path, param_dtype="bfloat16")
  assert {a.dtype for a in jax.tree.leaves(pbf)} == {np.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("n_kv, tied", [(1, True), (2, False), (8, False)])
def test_random_gqa_params_round_trip(key, n_kv, tied):
  """Fresh random params of GQA / MQA / MHA configs (tied or not, with LLaMA-3 scaling)
  -> Hugging Face tensors -> params, bit for bit; the tensors have Hugging Face's shapes."""
  cfg = LlamaConfig(vocab_size=40, d_model=32, n_layers=3, n_heads=8, n_kv_heads=n_kv, d_ff=24,
                    tie_embeddings=tied, rope_scaling=Llama3RopeScaling(4.0, 1.0, 4.0, 64))
  shapes = jax.eval_shape(lambda: init_model(cfg, None, jax.random.key(0), 1, 4))["params"]
  rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
  params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
  tensors = hf.params_to_hf(params, cfg)
  assert tensors["model.layers.2.self_attn.k_proj.weight"].shape == (n_kv * 4, 32)
  assert tensors["model.layers.0.self_attn.o_proj.weight"].shape == (32, 32)
  assert ("lm_head.weight" in tensors) != tied
  assert all(a.flags.c_contiguous for a in tensors.values())
  _same_bits(_flat(params), _flat(hf.params_from_hf(tensors, cfg)))
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg


def test_tied_lm_head_and_rotary_buffers_are_ignored():
  t = _fixture_tensors()
  hf_cfg = {**json.load(open(os.path.join(FIXTURE, hf.CONFIG_FILE))), "tie_word_embeddings": True}
  cfg = hf.config_from_hf(hf_cfg)
  t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)
  params = hf.params_from_hf(t, cfg)  # lm_head.weight present but unused when tied
  assert "head" not in params


def _hf_config(**changes) -> dict:
  with open(os.path.join(FIXTURE, hf.CONFIG_FILE)) as f:
    return {**json.load(f), **changes}


@pytest.mark.parametrize("changes, match", [
    ({"architectures": ["MistralForCausalLM"]},
     r"architectures=\['MistralForCausalLM'\] is not supported; fp8jax reads"),
    ({"model_type": "gemma"}, r"model_type='gemma' is not supported"),
    ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported; use 'silu'"),
    ({"attention_bias": True}, r"attention_bias=True is not supported; use False"),
    ({"mlp_bias": True}, r"mlp_bias=True is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
     r"rope_scaling type 'linear' is not supported; use 'llama3'"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"type 'dynamic' is not supported"),
    ({"head_dim": 32}, r"head_dim=32 is not supported with hidden_size=64"),
    ({"num_key_value_heads": 3}, r"n_kv_heads=3 does not divide n_heads=4"),
    ({"attention_dropout": 0.1}, r"attention_dropout=0.1 is not supported"),
])
def test_unsupported_configs_are_refused(changes, match):
  with pytest.raises(ValueError, match=match):
    hf.config_from_hf(_hf_config(**changes))


def test_config_keys():
  hf_cfg = _hf_config(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 128})
  cfg = hf.config_from_hf(hf_cfg, max_seq_len=64, dtype="float32")
  assert cfg.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 128) and cfg.max_seq_len == 64
  assert hf.config_from_hf(_hf_config(rope_scaling={"rope_type": "default"})).rope_scaling is None
  with pytest.raises(ValueError, match=r"\['d_model'\] are set by the checkpoint"):
    hf.config_from_hf(hf_cfg, d_model=128)
  no_width = _hf_config()
  del no_width["hidden_size"]
  with pytest.raises(ValueError, match=r"config.json lacks \['hidden_size'\]"):
    hf.config_from_hf(no_width)
  with pytest.raises(ValueError, match=r"has no config.json"):
    hf.load_config(os.path.dirname(FIXTURE))


def test_bad_tensors_are_refused():
  cfg = hf.load_config(FIXTURE)
  t = _fixture_tensors()
  with pytest.raises(ValueError, match=r"missing \['model.layers.1.mlp.up_proj.weight'\], "
                     r"unexpected \[\]"):
    hf.params_from_hf({n: a for n, a in t.items() if "1.mlp.up" not in n}, cfg)
  with pytest.raises(ValueError, match=r"unexpected \['model.layers.2.mlp.up_proj.weight'\]"):
    hf.params_from_hf({**t, "model.layers.2.mlp.up_proj.weight": t["lm_head.weight"]}, cfg)
  with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight has shape "
                     r"\[64, 64\]; the config needs \[32, 64\]"):
    hf.params_from_hf({**t, "model.layers.0.self_attn.k_proj.weight": np.ones((64, 64))}, cfg)
  with pytest.raises(ValueError, match=r"model.norm.weight has dtype int32; use a float dtype"):
    hf.params_from_hf({**t, "model.norm.weight": np.ones(64, np.int32)}, cfg)


def test_bad_exports_are_refused(tmp_path):
  cfg, params = hf.load_pretrained(FIXTURE)
  with pytest.raises(ValueError, match=r"export dtype='int8' is not allowed; use one of"):
    hf.save_pretrained(tmp_path, cfg, params, dtype="int8")
  with pytest.raises(ValueError, match=r"max_shard_bytes=0 is not allowed"):
    hf.save_pretrained(tmp_path, cfg, params, max_shard_bytes=0)
  with pytest.raises(ValueError, match=r"params do not match the config's Llama tree at "
                     r"\[\"\['layers'\]\['attn'\]\['qkv'\]\['kernel'\]\"\]"):
    hf.params_to_hf(params, cfg.replace(n_kv_heads=1))
  hf.save_pretrained(tmp_path, cfg, params, max_shard_bytes=100_000)
  with pytest.raises(ValueError, match=r"already holds weights \[.*model.safetensors.index.json"):
    hf.save_pretrained(tmp_path, cfg, params)
  (tmp_path / "tokenizer.json").write_text("{}")
  hf.save_pretrained(tmp_path, cfg, params, overwrite=True)  # stale shards and index go
  assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors", "tokenizer.json"]
  os.remove(tmp_path / hf.WEIGHTS_FILE)
  with pytest.raises(ValueError, match=r"holds neither model.safetensors nor"):
    hf.load_pretrained(tmp_path)
