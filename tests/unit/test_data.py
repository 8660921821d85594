"""fp8jax.data: sources, determinism, exact resume, train/val split, .bin files, errors."""
import json
import re
import sysconfig

import jax
import numpy as np
import pytest

from fp8jax import data
from fp8jax.data import BatchIterator, load_data, write_bin


def _seed(key) -> int:
  return int(jax.random.randint(key, (), 0, 1 << 30))


@pytest.fixture
def numbered(tmp_path):
  """A .bin corpus whose token i is i (ids unique), so a batch row reveals its position."""
  path = tmp_path / "numbered.bin"
  write_bin(path, np.arange(5000))
  return load_data(path, val_fraction=0.2, vocab_size=5000)


def _batches(it, n):
  return [it.next() for _ in range(n)]


def test_stdlib_corpus_is_real_sorted_and_capped():
  files = data.stdlib_files()
  root = sysconfig.get_paths()["stdlib"]
  assert len(files) > 100 and all(str(f).startswith(root) and f.suffix == ".py" for f in files)
  assert not any("site-packages" in f.parts for f in files)
  assert [f.as_posix() for f in files] == sorted(f.as_posix() for f in files)
  corpus = load_data(max_bytes=300_000)
  text = corpus.tokens.tobytes()
  first = files[0].read_bytes()
  assert corpus.tokens.dtype == np.uint8 and text.startswith(first[:300_000])
  n_docs = text.count(bytes([data.DOC_SEPARATOR])) + 1
  assert len(corpus.tokens) == 300_000 + n_docs - 1  # cap counts file bytes only
  assert b"import " in text and np.array_equal(load_data(max_bytes=300_000).tokens, corpus.tokens)


def test_site_packages_listing_skips_links_caches_and_repeats(tmp_path, monkeypatch):
  """Each file once (a file linked from a second folder is listed under the first), sorted
  by relative path per folder; __pycache__, symlinked folders, broken links and non-.py
  files left out."""
  a, b = tmp_path / "a", tmp_path / "b"
  for rel in ("z.py", "m/y.py", "m/n/x.py", "__pycache__/c.py", "m/notes.txt", "A.py"):
    (a / rel).parent.mkdir(parents=True, exist_ok=True)
    (a / rel).write_text(rel)
  b.mkdir()
  (b / "own.py").write_text("own")
  (b / "linked.py").symlink_to(a / "z.py")  # the same file as a/z.py
  (b / "folder").symlink_to(a / "m", target_is_directory=True)  # not followed
  (b / "broken.py").symlink_to(tmp_path / "missing.py")
  monkeypatch.setattr(data.files, "site_packages_roots", lambda: [a, b])
  listed = [f.relative_to(tmp_path).as_posix() for f in data.site_packages_files()]
  assert listed == ["a/A.py", "a/m/n/x.py", "a/m/y.py", "a/z.py", "b/own.py"], listed


def test_site_packages_corpus_is_installed_source_sorted_and_capped():
  roots, files = data.site_packages_roots(), data.site_packages_files()
  assert roots and len(files) > 100 and all(f.suffix == ".py" for f in files)
  assert not any("__pycache__" in f.parts for f in files)
  assert any(f.parts[-2:] == ("numpy", "__init__.py") for f in files)  # installed here
  order = [(i, f.relative_to(r).as_posix()) for f in files
           for i, r in enumerate(roots) if r in f.parents]
  assert len(order) == len(files) and order == sorted(order)  # roots in order, each sorted
  corpus = load_data("site-packages", max_bytes=200_000)
  text = corpus.tokens.tobytes()
  assert corpus.description == "Python site-packages source"
  assert text.startswith(files[0].read_bytes()[:200_000])
  n_docs = text.count(bytes([data.DOC_SEPARATOR])) + 1
  assert len(corpus.tokens) == 200_000 + n_docs - 1  # the cap counts file bytes, as stdlib's
  assert corpus.contents == f"{n_docs:,} files, 200,000 bytes"
  again = load_data("site-packages", max_bytes=200_000)  # listed again: the same order
  assert again.fingerprint == corpus.fingerprint and len(corpus.fingerprint) == 64
  others = {load_data("site-packages", max_bytes=200_001).fingerprint,
            load_data("stdlib", max_bytes=200_000).fingerprint,
            load_data(None, max_bytes=200_000).fingerprint}
  assert len(others) == 2 and corpus.fingerprint not in others  # None is "stdlib"


def test_fingerprint_names_the_data_not_where_it_lies(tmp_path):
  """Copies of the same documents in two folders (and .bin files in two places) share a
  fingerprint; another length of one document, another order or another .bin differs."""
  for folder in ("a", "b"):
    (tmp_path / folder / "sub").mkdir(parents=True)
    (tmp_path / folder / "x.txt").write_bytes(b"first document")
    (tmp_path / folder / "sub" / "y.txt").write_bytes(b"second one")
  a, b = (load_data(str(tmp_path / f / "**" / "*.txt")) for f in ("a", "b"))
  assert a.fingerprint == b.fingerprint and a.contents == "2 files, 24 bytes"
  (tmp_path / "b" / "sub" / "y.txt").write_bytes(b"second one!")
  assert load_data(str(tmp_path / "b" / "**" / "*.txt")).fingerprint != a.fingerprint
  in_order = load_data([tmp_path / "a" / "sub" / "y.txt", tmp_path / "a" / "x.txt"])
  swapped = load_data([tmp_path / "a" / "x.txt", tmp_path / "a" / "sub" / "y.txt"])
  assert in_order.fingerprint == a.fingerprint != swapped.fingerprint
  ids = np.arange(3000) % 256
  write_bin(tmp_path / "one.bin", ids)
  write_bin(tmp_path / "a" / "two.bin", ids)
  one = load_data(tmp_path / "one.bin")
  assert one.fingerprint == load_data(tmp_path / "a" / "two.bin").fingerprint
  write_bin(tmp_path / "a" / "two.bin", np.concatenate([ids[:-1], [7]]))
  assert load_data(tmp_path / "a" / "two.bin").fingerprint != one.fingerprint


def test_same_seed_same_batches_other_seed_differs(key):
  corpus = load_data(max_bytes=200_000)
  seed = _seed(key)
  a = _batches(corpus.batches("train", 4, 32, seed=seed), 5)
  b = _batches(corpus.batches("train", 4, 32, seed=seed), 5)
  c = _batches(corpus.batches("train", 4, 32, seed=seed + 1), 5)
  assert all(x.dtype == np.int32 and x.shape == (4, 33) for x in a)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_epoch_visits_every_window_once(key, numbered):
  seq_len, batch = 16, 5
  it = numbered.batches("train", batch, seq_len, seed=_seed(key))
  n_windows = (numbered.split_at - 1) // seq_len
  assert it.windows_per_epoch == n_windows
  rows = np.concatenate(_batches(it, n_windows // batch))
  np.testing.assert_array_equal(rows, rows[:, :1] + np.arange(seq_len + 1))  # contiguous
  starts = rows[:, 0]
  assert len(set(starts.tolist())) == len(starts) == n_windows - n_windows % batch
  assert len(set((starts % seq_len).tolist())) == 1  # one cut (offset) per epoch
  assert not np.array_equal(starts, np.sort(starts))  # shuffled


@pytest.mark.parametrize("consumed", [3, 62])  # mid-epoch, and just before the epoch ends
def test_restore_gives_bit_identical_batches(key, numbered, consumed):
  it = numbered.batches("train", 4, 16, seed=_seed(key))
  _batches(it, consumed)
  saved = json.loads(json.dumps(it.state()))
  assert all(type(v) is int for v in saved.values())
  expected = _batches(it, 10)  # crosses into the next epoch when consumed=62 (W=249)
  fresh = numbered.batches("train", 4, 16, seed=saved["seed"])
  fresh.restore(saved)
  assert all(np.array_equal(x, y) for x, y in zip(_batches(fresh, 10), expected))
  assert fresh.state() == it.state()


def test_train_and_val_are_disjoint_tail_split(key, numbered):
  assert numbered.split_at == 4000 and len(numbered.val) == 1000
  train = np.concatenate(_batches(numbered.batches("train", 8, 32, seed=_seed(key)), 40))
  val_it = numbered.batches("val", 8, 32)
  val = np.concatenate(_batches(val_it, 3))
  assert train.max() < 4000 <= val.min()
  assert val[0, 0] == 4000 and np.all(np.diff(val[:, 0]) == 32)  # val: in order, no shuffle
  again = numbered.batches("val", 8, 32)
  assert np.array_equal(np.concatenate(_batches(again, 3)), val)


def test_bin_round_trip_matches_text(key, tmp_path):
  text = load_data(max_bytes=100_000, val_fraction=0.1)
  path = tmp_path / "stdlib.bin"
  write_bin(path, text.tokens)
  assert path.stat().st_size == 2 * len(text.tokens)
  binary = load_data(path, val_fraction=0.1)
  assert binary.tokens.dtype == np.uint16 and np.array_equal(binary.tokens, text.tokens)
  seed = _seed(key)
  for split in ("train", "val"):
    a = _batches(text.batches(split, 3, 64, seed=seed), 4)
    b = _batches(binary.batches(split, 3, 64, seed=seed), 4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_text_files_dirs_and_globs(tmp_path):
  (tmp_path / "sub").mkdir()
  for name, body in (("b.txt", b"second doc"), ("a.txt", b"first doc"), ("sub/c.txt", b"third"),
                     ("skip.md", b"not text")):
    (tmp_path / name).write_bytes(body)
  sep = bytes([data.DOC_SEPARATOR])
  assert load_data(str(tmp_path / "*.txt")).tokens.tobytes() == b"first doc" + sep + b"second doc"
  assert load_data(str(tmp_path / "**" / "*.txt")).tokens.tobytes().endswith(sep + b"third")
  assert len(data.resolve_files(tmp_path)) == 4  # a directory: every file below it
  both = load_data([tmp_path / "sub" / "c.txt", str(tmp_path / "a.txt")], max_bytes=7)
  assert both.tokens.tobytes() == b"third" + sep + b"fi"
  assert len(both.train) + len(both.val) == len(both.tokens)


def test_errors(tmp_path, numbered):
  missing = str(tmp_path / "nothing" / "*.txt")
  with pytest.raises(FileNotFoundError, match=re.escape(f"no files matched '{missing}'")):
    load_data(missing)
  (tmp_path / "short.txt").write_bytes(b"tiny text")
  short = load_data(tmp_path / "short.txt", val_fraction=0.0)
  with pytest.raises(ValueError, match="train split of .* has 9 tokens, too few for one "
                                       "sequence: seq_len=16 needs at least 17"):
    short.batches("train", 2, 16)
  with pytest.raises(ValueError, match="val split .* has 0 tokens"):
    short.batches("val", 2, 4)
  for kwargs, match in ((dict(batch_size=0, seq_len=8), "batch_size=0 is not allowed"),
                        (dict(batch_size=2, seq_len=-1), "seq_len=-1 is not allowed"),
                        (dict(batch_size=2, seq_len=8.0), r"seq_len=8.0 is not allowed")):
    with pytest.raises(ValueError, match=match):
      numbered.batches("train", **kwargs)
  with pytest.raises(ValueError, match="split='test' is not allowed"):
    numbered.batches("test", 2, 8)
  with pytest.raises(ValueError, match="seed=-1 is not allowed"):
    BatchIterator(numbered.train, 2, 8, seed=-1)
  with pytest.raises(ValueError, match="vocab_size=100 is too small .* need vocab_size >= 256"):
    load_data(tmp_path / "short.txt", vocab_size=100)
  with pytest.raises(ValueError, match=r"val_fraction=1.0 is not allowed; use a number in \["):
    load_data(tmp_path / "short.txt", val_fraction=1.0)


def test_bin_and_state_errors(tmp_path, numbered):
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"abc")
  with pytest.raises(ValueError, match="has 3 bytes, not a positive multiple of 2"):
    load_data(odd)
  as_bytes = tmp_path / "bytes.bin"  # uint8 text written raw, read as uint16 ids
  as_bytes.write_bytes(b"def main():\n  pass\n\n")
  with pytest.raises(ValueError, match="token id .* >= vocab_size=256: the model cannot embed it"):
    load_data(as_bytes)
  with pytest.raises(ValueError, match=r"token ids must lie in \[0, 65535\] \(uint16\)"):
    write_bin(tmp_path / "big.bin", np.array([1, 70000]), dtype=np.uint16)
  with pytest.raises(ValueError, match="a .bin source must be the only source"):
    load_data([odd, str(tmp_path / "*.txt")])
  it = numbered.batches("train", 4, 16, seed=7)
  with pytest.raises(ValueError, match="data state has seed=8 but this iterator has seed=7"):
    it.restore({**it.state(), "seed": 8})
  with pytest.raises(ValueError, match=r"missing keys \['num_tokens'\]"):
    it.restore({k: v for k, v in it.state().items() if k != "num_tokens"})
  with pytest.raises(ValueError, match="position=-3 is not allowed"):
    it.restore({**it.state(), "position": -3})
