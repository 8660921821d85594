"""fp8jax.data.binfile: nanoGPT's headerless uint16 and llm.c's uint16/uint32 token files."""
import jax
import numpy as np
import pytest

from fp8jax.data import BinWriter, bin_layout, load_bin, load_data, token_dtype, write_bin

LLAMA3_VOCAB = 128_256


def _rng(key) -> np.random.Generator:
  return np.random.default_rng(int(jax.random.randint(key, (), 0, 1 << 30)))


def _ids(key, n, high):
  return _rng(key).integers(0, high, n)


def test_uint32_round_trip_llama3_vocab(key, tmp_path):
  ids = _ids(key, 3000, LLAMA3_VOCAB)
  assert ids.max() > 2**16  # the draw holds ids uint16 cannot
  path = tmp_path / "llama3.bin"
  write_bin(path, ids)
  assert bin_layout(path) == (np.dtype("<u4"), 1024)
  assert path.stat().st_size == 1024 + 4 * len(ids)
  header = np.fromfile(path, "<i4", count=256)
  assert header[:3].tolist() == [20240801, 7, len(ids)] and not header[3:].any()  # llm.c's
  tokens = load_bin(path, vocab_size=LLAMA3_VOCAB)
  assert tokens.dtype == np.uint32 and np.array_equal(tokens, ids)
  corpus = load_data(path, vocab_size=LLAMA3_VOCAB, val_fraction=0.1)
  assert corpus.vocab_size == LLAMA3_VOCAB
  batch = corpus.batches("val", 2, 100).next()  # ids above 65535 survive into int32 batches
  np.testing.assert_array_equal(batch[0], ids[corpus.split_at:corpus.split_at + 101])


def test_headerless_and_llmc_uint16_read_alike(key, tmp_path):
  ids = _ids(key, 2000, 50_257)
  nanogpt = tmp_path / "nanogpt.bin"
  write_bin(nanogpt, ids)
  assert nanogpt.stat().st_size == 2 * len(ids) and bin_layout(nanogpt) == (np.dtype("<u2"), 0)
  llmc = tmp_path / "llmc.bin"  # llm.c's GPT-2 layout, written as llm.c writes it
  header = np.zeros(256, "<i4")
  header[:3] = 20240520, 1, len(ids)
  llmc.write_bytes(header.tobytes() + ids.astype("<u2").tobytes())
  for path in (nanogpt, llmc):
    tokens = load_bin(path, vocab_size=50_257)
    assert tokens.dtype == np.uint16 and np.array_equal(tokens, ids)


def test_header_needs_matching_count(tmp_path):
  """A headerless file that starts like llm.c's magic, with a count that does not match its
  size, stays headerless uint16."""
  fake = np.zeros(600, "<u2")
  fake[:2] = np.frombuffer(np.array([20240801], "<i4").tobytes(), "<u2")
  fake[2:4] = np.frombuffer(np.array([7], "<i4").tobytes(), "<u2")
  fake[4:6] = np.frombuffer(np.array([5], "<i4").tobytes(), "<u2")
  path = tmp_path / "fake.bin"
  path.write_bytes(fake.tobytes())
  assert bin_layout(path) == (np.dtype("<u2"), 0)


def test_writer_streams_chunks(key, tmp_path):
  rng = _rng(key)
  a, b = rng.integers(0, 70_000, 500), rng.integers(0, 70_000, 700)
  with BinWriter(tmp_path / "w.bin", token_dtype(70_000)) as writer:
    writer.write(a)
    writer.write(b)
  assert writer.count == 1200
  np.testing.assert_array_equal(load_bin(tmp_path / "w.bin", None), np.concatenate([a, b]))


def test_errors(tmp_path):
  assert (token_dtype(65_536), token_dtype(65_537)) == (np.dtype("<u2"), np.dtype("<u4"))
  with pytest.raises(ValueError, match=r"dtype=int32 is not allowed; use uint16 or uint32"):
    BinWriter(tmp_path / "x.bin", np.int32)
  with pytest.raises(ValueError, match=r"token ids must lie in \[0, 4294967295\] \(uint32\), "
                                       r"got \[-1, 3\]"):
    write_bin(tmp_path / "neg.bin", np.array([3, -1]), dtype=np.uint32)
  path = tmp_path / "big.bin"
  write_bin(path, np.array([5, 70_000, 9]))
  with pytest.raises(ValueError, match=r"holds token id 70000 >= vocab_size=65536: the model "
                                       r"cannot embed it; use a model vocab_size >= 70001"):
    load_data(path, vocab_size=65_536)
  with pytest.raises(FileNotFoundError, match="no files matched .*missing.bin"):
    load_bin(tmp_path / "missing.bin")
