"""Text through a Hugging Face tokenizer: encoded once into a cached token file (reused, and
redone when an input changes), uint32 for vocabularies > 65,536, document separators,
vocabulary checks, and exact resume for every kind of source."""
import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
import tokenizers
from tokenizers import models, pre_tokenizers

from fp8jax import data
from fp8jax.data import load_data, tokencache, write_bin

EOS = "<|endoftext|>"


def _seed(key) -> int:
  return int(jax.random.randint(key, (), 0, 1 << 30))


def _word_tokenizer(path, n_words: int, specials=(EOS,)):
  """A WordLevel tokenizer: words "w0".."w{n-1}" are ids 0..n-1, then `specials`, then [UNK]."""
  vocab = {f"w{i}": i for i in range(n_words)}
  for token in (*specials, "[UNK]"):
    vocab[token] = len(vocab)
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.save(str(path))
  return tok


def _rng(key) -> np.random.Generator:
  return np.random.default_rng(_seed(key))


def _word_docs(rng, folder, n_docs, n_words, high):
  """`n_docs` text files of `n_words` random words w0..w{high-1}; returns their word ids."""
  folder.mkdir(exist_ok=True)
  ids = rng.integers(0, high, (n_docs, n_words))
  for i, row in enumerate(ids):
    (folder / f"doc{i:02d}.txt").write_text(" ".join(f"w{j}" for j in row) + "\n")
  return ids


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
  """A small byte-level BPE tokenizer trained on 200 kB of the stdlib corpus."""
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  return data.train_tokenizer(None, 400, path, max_bytes=200_000), path


def test_text_is_tokenized_once_then_read_from_the_cache(bpe, tmp_path, monkeypatch):
  tok, tok_path = bpe
  files = data.stdlib_files()[200:230]
  cache = tmp_path / "cache"
  first = load_data(files, tokenizer=tok_path, cache_dir=cache, vocab_size=400, max_bytes=60_000)
  assert first.cache_path.parent == cache and first.cache_path.suffix == ".bin"
  assert first.tokens.dtype == np.uint16 and first.vocab_size == 400
  # The cache holds each document's own encoding followed by EOS, within max_bytes.
  expected = []
  for text in data.iter_documents(files, 60_000):
    expected += tok.encode(text.decode(), add_special_tokens=False).ids + [tok.token_to_id(EOS)]
  np.testing.assert_array_equal(first.tokens, expected)
  assert json.loads(first.cache_path.with_suffix(".json").read_text())["tokens"] == len(expected)
  stamp = first.cache_path.stat().st_mtime_ns

  def refuse(*args, **kwargs):
    raise AssertionError("tokenized again although the cache is valid")
  monkeypatch.setattr(tokencache, "tokenize_files", refuse)
  again = load_data(files, tokenizer=tok_path, cache_dir=cache, vocab_size=400, max_bytes=60_000)
  assert again.cache_path == first.cache_path and first.cache_path.stat().st_mtime_ns == stamp
  np.testing.assert_array_equal(again.tokens, first.tokens)
  hit = data.cached_tokens(files, tok_path, max_bytes=60_000, cache_dir=cache)
  assert not hit.created and hit.separator == data.Separator(EOS, 0, "after")
  stem = first.cache_path.stem
  assert sorted(p.name for p in cache.iterdir()) == [f"{stem}.bin", f"{stem}.json", f"{stem}.lock"]


def test_changed_inputs_tokenize_again(bpe, tmp_path):
  tok, tok_path = bpe
  src = tmp_path / "src"
  src.mkdir()
  (src / "a.txt").write_text("def f(x):\n  return x + 1\n")
  (src / "b.txt").write_text("class A:\n  pass\n")
  cache = tmp_path / "cache"
  base = data.cached_tokens(data.resolve_files(src), tok_path, max_bytes=None, cache_dir=cache)
  assert base.created
  (src / "b.txt").write_text("class B:\n  pass\n")  # same size, new contents and mtime
  os.utime(src / "b.txt", ns=(0, os.stat(src / "a.txt").st_mtime_ns + 10**9))
  edited = data.cached_tokens(data.resolve_files(src), tok_path, max_bytes=None, cache_dir=cache)
  capped = data.cached_tokens(data.resolve_files(src), tok_path, max_bytes=20, cache_dir=cache)
  other_tok = tmp_path / "other.json"
  _word_tokenizer(other_tok, 10)
  retok = data.cached_tokens(data.resolve_files(src), other_tok, max_bytes=None, cache_dir=cache)
  paths = [c.path for c in (base, edited, capped, retok)]
  assert all(c.created for c in (edited, capped, retok)) and len(set(paths)) == 4
  assert tok.decode(load_data(src, tokenizer=tok_path, cache_dir=cache, vocab_size=400,
                              val_fraction=0).tokens.tolist()).endswith("class B:\n  pass\n")


_ENCODE_WHEN_TOLD = """
import os, sys, time
from fp8jax import data
files, tok, cache, me = sys.argv[1].split(os.pathsep), sys.argv[2], sys.argv[3], sys.argv[4]
open(os.path.join(cache, "ready" + me), "w").close()
while not os.path.exists(os.path.join(cache, "go")):
  time.sleep(0.005)
print(data.cached_tokens(files, tok, max_bytes=None, cache_dir=cache).created)
"""


@pytest.mark.slow
def test_processes_encode_once(bpe, tmp_path):
  """Two processes ask for the same missing cache file at the same moment: one encodes."""
  files = os.pathsep.join(str(f) for f in data.stdlib_files()[100:300])  # ~0.3 s of encoding
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
  procs = [subprocess.Popen([sys.executable, "-c", _ENCODE_WHEN_TOLD, files, str(bpe[1]),
                             str(tmp_path), str(i)], stdout=subprocess.PIPE, text=True, env=env)
           for i in range(2)]
  deadline = time.monotonic() + 120
  while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
    assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
    time.sleep(0.01)
  (tmp_path / "go").touch()
  created = [p.communicate(timeout=120)[0].strip() for p in procs]
  assert sorted(created) == ["False", "True"]


def test_vocabulary_over_65536_is_stored_as_uint32(key, tmp_path):
  rng = _rng(key)
  tok_path = tmp_path / "words.json"
  tok = _word_tokenizer(tok_path, 70_000)
  words = _word_docs(rng, tmp_path / "docs", 6, 500, 70_000)
  assert words.max() > 2**16
  corpus = load_data(tmp_path / "docs", tokenizer=tok_path, cache_dir=tmp_path / "cache",
                     vocab_size=70_002, val_fraction=0.2)
  eos = tok.token_to_id(EOS)
  assert corpus.vocab_size == data.tokenizer_vocab_size(tok) == 70_002
  assert data.bin_layout(corpus.cache_path) == (np.dtype("<u4"), 1024)
  assert corpus.tokens.dtype == np.uint32
  expected = np.concatenate([np.append(row, eos) for row in words])
  np.testing.assert_array_equal(corpus.tokens, expected)
  rows = corpus.batches("train", 4, 64, seed=int(rng.integers(1 << 30))).next()
  starts = [np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(expected, 65) == r,
                                  axis=1)) for r in rows]
  assert all(len(s) == 1 for s in starts)  # each row is a window of the token stream
  with pytest.raises(ValueError, match=r"vocab_size=65536 is too small for tokenizer .*words"
                                       r"\.json'?: it has 70002 token ids; use a model "
                                       r"vocab_size >= 70002"):
    load_data(tmp_path / "docs", tokenizer=tok_path, cache_dir=tmp_path / "cache",
              vocab_size=65_536)


def test_document_separator_choice(tmp_path):
  tok = _word_tokenizer(tmp_path / "t.json", 5, specials=("<s>", "</s>"))
  assert data.document_separator(tok) == data.Separator("</s>", 6, "after")
  bos_only = _word_tokenizer(tmp_path / "b.json", 5, specials=("<|begin_of_text|>",))
  assert data.document_separator(bos_only) == data.Separator("<|begin_of_text|>", 5, "before")
  plain = _word_tokenizer(tmp_path / "p.json", 5, specials=())
  assert data.document_separator(plain) == data.Separator(None, None, None)
  folder = tmp_path / "hf"
  folder.mkdir()
  custom = _word_tokenizer(folder / "tokenizer.json", 5, specials=("<|im_end|>", "</s>"))
  (folder / "tokenizer_config.json").write_text(
      json.dumps({"eos_token": {"content": "<|im_end|>"}, "bos_token": None}))
  assert data.document_separator(custom, folder) == data.Separator("<|im_end|>", 5, "after")


@pytest.mark.parametrize("specials,place", [(("<|begin_of_text|>",), "before"), ((), None)])
def test_bos_before_each_document_or_plain_concatenation(key, tmp_path, specials, place):
  tok = _word_tokenizer(tmp_path / "t.json", 50, specials=specials)
  words = _word_docs(_rng(key), tmp_path / "docs", 3, 7, 50)
  corpus = load_data(tmp_path / "docs", tokenizer=tmp_path / "t.json", vocab_size=None,
                     cache_dir=tmp_path / "cache", val_fraction=0)
  sep = [tok.token_to_id(specials[0])] if place == "before" else []
  np.testing.assert_array_equal(corpus.tokens, np.concatenate([sep + list(r) for r in words]))


def test_progress_bar_only_on_a_terminal():
  assert tokencache._progress(None).disable  # pytest captures stderr: not a terminal
  assert tokencache._progress(False).disable and not tokencache._progress(True).disable


def _sources(rng, tmp_path, bpe):
  """name -> a function loading the TokenData of every kind of source."""
  words = tmp_path / "words.json"
  _word_tokenizer(words, 70_000)
  _word_docs(rng, tmp_path / "docs", 4, 400, 70_000)
  ids = rng.integers(0, 60_000, 3000)
  write_bin(tmp_path / "u16.bin", ids)
  write_bin(tmp_path / "u32.bin", ids + 70_000)
  cache = tmp_path / "cache"
  return {
      "bytes": lambda: load_data(max_bytes=100_000),
      "u16.bin": lambda: load_data(tmp_path / "u16.bin", vocab_size=60_000),
      "u32.bin": lambda: load_data(tmp_path / "u32.bin", vocab_size=130_000),
      "bpe": lambda: load_data(max_bytes=100_000, tokenizer=bpe[1], cache_dir=cache,
                               vocab_size=400),
      "words": lambda: load_data(tmp_path / "docs", tokenizer=words, cache_dir=cache,
                                 vocab_size=70_002),
  }


def test_restore_is_bit_identical_for_every_source(key, tmp_path, bpe):
  rng = _rng(key)
  seed = int(rng.integers(1 << 30))
  for name, load in _sources(rng, tmp_path, bpe).items():
    it = load().batches("train", 3, 32, seed=seed)
    for _ in range(7):
      it.next()
    saved = json.loads(json.dumps(it.state()))
    expected = [it.next() for _ in range(40)]  # crosses an epoch boundary for the small sources
    fresh = load().batches("train", 3, 32, seed=seed)  # loaded again: the cache is reused
    fresh.restore(saved)
    for want in expected:
      np.testing.assert_array_equal(fresh.next(), want, err_msg=name)
    assert fresh.state() == it.state()


def test_errors(bpe, tmp_path):
  tok, tok_path = bpe
  (tmp_path / "a.txt").write_text("x = 1\n")
  with pytest.raises(ValueError, match=r"vocab_size=256 is too small for tokenizer .*: it has "
                                       r"400 token ids; use a model vocab_size >= 400"):
    load_data(tmp_path / "a.txt", tokenizer=tok_path, cache_dir=tmp_path / "c")
  with pytest.raises(FileNotFoundError, match=r"tokenizer '.*nope.json' does not exist"):
    load_data(tmp_path / "a.txt", tokenizer=tmp_path / "nope.json", cache_dir=tmp_path / "c")
  (tmp_path / "bad.json").write_text("{not json")
  with pytest.raises(ValueError, match=r"tokenizer '.*bad.json' is not a Hugging Face "
                                       r"tokenizer.json"):
    load_data(tmp_path / "a.txt", tokenizer=tmp_path / "bad.json", cache_dir=tmp_path / "c")
  write_bin(tmp_path / "t.bin", np.arange(10))
  with pytest.raises(ValueError, match=r"tokenizer='.*' is not allowed with the .bin source"):
    load_data(tmp_path / "t.bin", tokenizer=tok_path)
