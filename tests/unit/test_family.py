"""The model-family registry: one interface for gpt and llama (module, init, counts, tensor
rules and checks), looked up by name or by config; wrong names and configs are refused."""
import jax
import pytest

import fp8jax
from fp8jax.models import FAMILIES, GPT, Llama, LlamaConfig, ModelConfig, family, family_of
from fp8jax.models.llama import LLAMA_RULES
from fp8jax.optim import num_params
from fp8jax.parallel.tensor import GPT_RULES

CONFIGS = {"gpt": ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=8),
           "llama": LlamaConfig(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48,
                                max_seq_len=8)}


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_one_interface_for_every_family(name):
  fam, cfg = family(name), CONFIGS[name]
  assert family_of(cfg) is fam and fam.name == name and isinstance(cfg, fam.config_cls)
  model = fam.model(cfg, fp8jax.O1.recipe)
  assert isinstance(model, {"gpt": GPT, "llama": Llama}[name])
  assert fam.tensor_rules == {"gpt": GPT_RULES, "llama": LLAMA_RULES}[name]
  variables = jax.eval_shape(lambda: fam.init_model(cfg, fp8jax.O1.recipe, jax.random.key(0),
                                                    2, 8))
  assert set(variables) == {"params", fp8jax.FP8_COLLECTION}
  abstract = jax.eval_shape(lambda: model.init(jax.random.key(0),
                                               jax.numpy.zeros((2, 8), "int32")))
  assert jax.tree.structure(abstract) == jax.tree.structure(variables)
  n = num_params(variables["params"])
  assert 0 < fam.matmul_param_count(cfg) < n + cfg.d_model * cfg.vocab_size
  assert fam.flops_per_token(cfg, 8) > 6 * fam.matmul_param_count(cfg)
  fam.check_tensor_parallel(cfg, 2)
  with pytest.raises(ValueError, match=r"does not split over parallel.tensor_parallel_size=3"):
    fam.check_tensor_parallel(cfg, 3)


def test_bad_lookups_are_refused():
  assert sorted(FAMILIES) == ["gpt", "llama"]
  with pytest.raises(ValueError, match=r"model family 'mamba' is not known; use one of "
                     r"\['gpt', 'llama'\]"):
    family("mamba")
  with pytest.raises(ValueError, match=r"dict is not the config of a known model family"):
    family_of({"d_model": 32})
  with pytest.raises(ValueError, match=r"model family 'gpt' takes a ModelConfig, got "
                     r"LlamaConfig"):
    family("gpt").model(CONFIGS["llama"])
