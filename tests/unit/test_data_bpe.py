"""fp8jax.data.train_tokenizer: a byte-level BPE tokenizer trained on a slice of the stdlib
corpus encodes unseen text losslessly, shorter than bytes, and separates documents by EOS."""
import pytest
import tokenizers

from fp8jax import data


def test_train_tokenizer_on_a_corpus_slice(tmp_path):
  out = tmp_path / "sub" / "tokenizer.json"
  tok = data.train_tokenizer(None, 600, out, max_bytes=300_000)
  assert out.is_file() and data.tokenizer_vocab_size(tokenizers.Tokenizer.from_file(str(out))) == 600
  assert tok.get_vocab_size() == 600 and tok.token_to_id(data.EOS_TOKEN) == 0
  assert data.document_separator(tok, out) == data.Separator(data.EOS_TOKEN, 0, "after")
  # Unseen text (past the training slice, with non-ASCII) round-trips exactly, in fewer tokens.
  files = data.stdlib_files()
  unseen = b"".join(f.read_bytes() for f in files[-40:])[:50_000].decode("utf-8", "replace")
  unseen += "\n# caf\u00e9 \u2014 \u00fc\u00f1\u00ee\u00e7\u00f8d\u00e9 \U0001f600\n"
  ids = tok.encode(unseen, add_special_tokens=False).ids
  assert tok.decode(ids) == unseen
  assert len(ids) < 0.5 * len(unseen.encode())  # merges learned: < 2 bytes per token
  assert 0 not in ids  # EOS is never produced by text


def test_train_tokenizer_on_files_is_deterministic_and_capped(tmp_path):
  src = tmp_path / "src"
  src.mkdir()
  for i, f in enumerate(data.stdlib_files()[300:320]):
    (src / f"{i:02d}.py").write_bytes(f.read_bytes())
  a = data.train_tokenizer(str(src), 400, tmp_path / "a.json", max_bytes=100_000)
  b = data.train_tokenizer([src], 400, tmp_path / "b.json", max_bytes=100_000)
  assert (tmp_path / "a.json").read_text() == (tmp_path / "b.json").read_text()
  tiny = data.train_tokenizer(src, 400, tmp_path / "tiny.json", max_bytes=64, min_frequency=1)
  assert tiny.get_vocab_size() < 400  # 64 bytes hold too few pairs for 143 merges
  assert a.get_vocab() == b.get_vocab()


@pytest.mark.parametrize("kwargs,match", [
    (dict(vocab_size=256), r"vocab_size=256 is not allowed; use an integer >= 257"),
    (dict(vocab_size=4096.0), r"vocab_size=4096.0 is not allowed"),
    (dict(vocab_size=300, max_bytes=0), r"max_bytes=0 is not allowed; use an integer >= 1 or None"),
    (dict(vocab_size=300, min_frequency=0), r"min_frequency=0 is not allowed"),
])
def test_train_tokenizer_errors(tmp_path, kwargs, match):
  with pytest.raises(ValueError, match=match):
    data.train_tokenizer(None, out_path=tmp_path / "t.json", **kwargs)
  with pytest.raises(FileNotFoundError, match=r"no files matched '.*nothing'"):
    data.train_tokenizer(str(tmp_path / "nothing"), 300, tmp_path / "t.json")
  assert not (tmp_path / "t.json").exists()
