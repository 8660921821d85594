"""Config: the data section's tokenizer and cache keys."""
import pytest

from fp8jax.config import load_config


def test_tokenizer_keys_default_to_bytes():
  d = load_config(None).data
  assert (d.tokenizer, d.cache_dir, d.byte_level, d.is_bin) == (None, None, True, False)


def test_tokenizer_lifts_the_byte_vocabulary_bound():
  cfg = load_config(None, ["data.tokenizer=tok/tokenizer.json", "data.cache_dir=/tmp/c",
                           "model.vocab_size=100"])
  assert (cfg.data.tokenizer, cfg.data.cache_dir, cfg.data.byte_level) == \
      ("tok/tokenizer.json", "/tmp/c", False)
  with pytest.raises(ValueError, match=r"model.vocab_size=100 is too small for byte-level text"):
    load_config(None, ["model.vocab_size=100"])


@pytest.mark.parametrize("overrides,match", [
    (["data.source=tokens.bin", "data.tokenizer=t.json"],
     r"data.tokenizer='t.json' is not allowed with data.source='tokens.bin': a .bin holds token "
     r"ids already; use data.tokenizer: null"),
    (["data.tokenizer=' '"], r"data.tokenizer=' ' is not allowed; use a non-empty string"),
    (["data.cache_dir=3"], r"data.cache_dir=3 has type int; expected a string or null"),
])
def test_tokenizer_errors(overrides, match):
  with pytest.raises(ValueError, match=match):
    load_config(None, overrides)
