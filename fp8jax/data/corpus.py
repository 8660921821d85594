"""A token source loaded and split: :func:`load_data` -> :class:`TokenData`.

Sources:
  - text files, directories or globs (:mod:`fp8jax.data.files`), or None for the standard
    library source corpus, as
      - byte-level tokens (vocab 256) when no tokenizer is given: documents joined by
        :data:`fp8jax.data.DOC_SEPARATOR`; at most `max_bytes` bytes are read (the last
        document is cut);
      - a tokenizer's ids when `tokenizer` names a ``tokenizer.json``: encoded once into a
        cached token file (:mod:`fp8jax.data.tokencache`) and memory-mapped;
  - one pre-tokenized ``.bin`` token file (:mod:`fp8jax.data.binfile`), memory-mapped.

Built-in text corpora are named: ``"stdlib"`` (also `source` None) and ``"site-packages"``
(:data:`fp8jax.data.files.BUILTIN_SOURCES`).

Fingerprint (:attr:`TokenData.fingerprint`): a SHA-256 of what the token stream is made of,
the same on every machine that has the same data: for text, each document's path relative to
the documents' common folder and the bytes read from it (in order), the tokenizer file's
SHA-256 and the separator; for a ``.bin``, its size, token count, dtype and the SHA-256 of its
first and last MiB. A run stores it with its checkpoints and refuses to resume on other data.

Split: the validation set is the contiguous *tail* of the token stream (the last
`val_fraction` of tokens), the training set is everything before it; they share no token
position (a document may straddle the boundary).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from fp8jax.data import binfile
from fp8jax.data import tokenizer as tokenizer_lib
from fp8jax.data._checks import check_positive
from fp8jax.data.batches import BatchIterator
from fp8jax.data.files import (BYTE_VOCAB, DEFAULT_MAX_BYTES, builtin_source, read_documents,
                               read_sizes, source_files)
from fp8jax.data.tokencache import cached_tokens

_EDGE_BYTES = 1 << 20  # a .bin's fingerprint hashes its first and last MiB
_DESCRIPTIONS = {"stdlib": "Python stdlib source", "site-packages": "Python site-packages source"}


@dataclasses.dataclass(frozen=True, eq=False)
class TokenData:
  """A token stream and its train/validation split (validation = the contiguous tail).

  Attributes:
    tokens: uint8/uint16/uint32[N] token ids (a memmap for token files and tokenizer caches).
    split_at: index of the first validation token (train = tokens[:split_at]).
    vocab_size: number of token ids of the source: 256 for bytes, the tokenizer's for a
      tokenizer, the `vocab_size` the ids were checked against for a ``.bin`` (its largest id +
      1 when unchecked). Every id is below it.
    description: where the tokens came from (for messages and logs).
    cache_path: the tokenizer cache file the tokens are read from (None for other sources).
    fingerprint: hex SHA-256 identifying the data (see the module docstring; "" when made
      by hand).
    contents: the data's size in words, e.g. "7,157 files, 114,093,120 bytes" (for messages).
  """

  tokens: np.ndarray
  split_at: int
  vocab_size: int
  description: str
  cache_path: Path | None = None
  fingerprint: str = ""
  contents: str = ""

  @property
  def train(self) -> np.ndarray:
    """Training tokens[split_at]."""
    return self.tokens[:self.split_at]

  @property
  def val(self) -> np.ndarray:
    """Validation tokens[N - split_at]."""
    return self.tokens[self.split_at:]

  def batches(self, split: str, batch_size: int, seq_len: int, seed: int = 0,
              shuffle: bool | None = None) -> BatchIterator:
    """A :class:`BatchIterator` over `split` ("train" or "val"); `shuffle` defaults to True
    for train, False for val."""
    if split not in ("train", "val"):
      raise ValueError(f"split={split!r} is not allowed; use 'train' or 'val'")
    shuffle = (split == "train") if shuffle is None else shuffle
    return BatchIterator(self.train if split == "train" else self.val, batch_size, seq_len,
                         seed=seed, shuffle=shuffle, name=f"{split} split of {self.description}")


def load_data(source=None, *, val_fraction: float = 0.05, max_bytes: int | None = DEFAULT_MAX_BYTES,
              vocab_size: int | None = BYTE_VOCAB, tokenizer: str | os.PathLike | None = None,
              cache_dir: str | os.PathLike | None = None, progress: bool | None = None
              ) -> TokenData:
  """Loads `source` (None or "stdlib": the stdlib corpus; "site-packages": the installed
  packages' source; text files/dirs/globs; or one ``.bin`` file).

  Args:
    source: see the module docstring.
    val_fraction: share of tokens in the validation tail, in [0, 1).
    max_bytes: cap on bytes read from text sources (None: no cap); ignored for .bin.
    vocab_size: the model's vocabulary (None: no bound): every id must be below it, so it must
      be >= 256 for byte-level text and >= the tokenizer's vocabulary; .bin ids are checked.
    tokenizer: a ``tokenizer.json`` (or a folder holding one) to encode text sources with;
      None: byte-level tokens.
    cache_dir: folder of tokenizer caches (None: ``~/.cache/fp8jax/tokens``, see
      :func:`fp8jax.data.default_cache_dir`).
    progress: progress bar while encoding (None: when stderr is a terminal).

  Raises:
    ValueError: a bad argument, or ids the model cannot embed (naming the value and the bound).
    FileNotFoundError: a source or tokenizer that does not exist.
  """
  if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
      or not 0 <= val_fraction < 1:
    raise ValueError(f"val_fraction={val_fraction!r} is not allowed; use a number in [0, 1)")
  check_positive("vocab_size", vocab_size, allow_none=True)
  check_positive("max_bytes", max_bytes, allow_none=True)
  names = [] if source is None else \
      [source] if isinstance(source, (str, os.PathLike)) else list(source)
  bins = [n for n in names if os.fspath(n).endswith(".bin")]
  cache_path = None
  if bins:
    if len(names) > 1:
      shown = [os.fspath(n) for n in names]
      raise ValueError(f"a .bin source must be the only source, got {shown}")
    if tokenizer is not None:
      raise ValueError(f"tokenizer={os.fspath(tokenizer)!r} is not allowed with the .bin "
                       f"source {os.fspath(bins[0])!r}: a .bin holds token ids already; use "
                       "tokenizer=None")
    tokens = binfile.load_bin(bins[0], vocab_size)
    description = os.fspath(bins[0])
    vocab = vocab_size if vocab_size is not None else int(tokens.max()) + 1
    fingerprint, contents = _bin_fingerprint(bins[0], tokens)
  else:
    files = source_files(source)
    builtin = builtin_source(source)
    description = _DESCRIPTIONS[builtin] if builtin is not None else \
        f"{len(files)} text file(s) from {[os.fspath(n) for n in names]}"
    separator = None
    if tokenizer is None:
      tokens, vocab = read_documents(files, max_bytes), BYTE_VOCAB
      if vocab_size is not None and vocab_size < vocab:
        raise ValueError(f"vocab_size={vocab_size} is too small for {description}: byte-level "
                         f"text tokens need vocab_size >= {BYTE_VOCAB}")
    else:
      cached = cached_tokens(files, tokenizer, max_bytes=max_bytes, cache_dir=cache_dir,
                             progress=progress)
      vocab, cache_path = cached.vocab_size, cached.path
      if vocab_size is not None and vocab_size < vocab:
        raise ValueError(f"vocab_size={vocab_size} is too small for tokenizer "
                         f"{os.fspath(tokenizer)!r}: it has {vocab} token ids; use a model "
                         f"vocab_size >= {vocab}")
      tokens = binfile.load_bin(cache_path, vocab_size=None)
      description += f" tokenized by {os.fspath(tokenizer)}"
      separator = cached.separator
    fingerprint, contents = _text_fingerprint(files, max_bytes, tokenizer, separator)
  split_at = len(tokens) - int(round(len(tokens) * val_fraction))
  return TokenData(tokens, split_at, vocab, description, cache_path, fingerprint, contents)


def _text_fingerprint(files, max_bytes, tokenizer, separator) -> tuple[str, str]:
  """(fingerprint, contents) of text documents (see the module docstring)."""
  sizes = read_sizes(files, max_bytes)
  paths = [os.path.abspath(p) for p, _ in sizes]
  common = os.path.commonpath([os.path.dirname(p) for p in paths]) if paths else ""
  docs = [[Path(os.path.relpath(p, common)).as_posix(), n] for p, (_, n) in zip(paths, sizes)]
  tok = None if tokenizer is None else hashlib.sha256(
      tokenizer_lib.tokenizer_file(tokenizer).read_bytes()).hexdigest()
  text = json.dumps({"kind": "text", "documents": docs, "tokenizer": tok,
                     "separator": None if separator is None else list(separator)})
  total = sum(n for _, n in sizes)
  return hashlib.sha256(text.encode()).hexdigest(), f"{len(docs):,} files, {total:,} bytes"


def _bin_fingerprint(path, tokens: np.ndarray) -> tuple[str, str]:
  """(fingerprint, contents) of a ``.bin`` token file (see the module docstring)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    head = f.read(_EDGE_BYTES)
    f.seek(max(0, size - _EDGE_BYTES))
    tail = f.read()
  text = json.dumps({"kind": "bin", "bytes": size, "tokens": int(len(tokens)),
                     "dtype": np.dtype(tokens.dtype).name,
                     "head": hashlib.sha256(head).hexdigest(),
                     "tail": hashlib.sha256(tail).hexdigest()})
  return hashlib.sha256(text.encode()).hexdigest(), f"{len(tokens):,} tokens, {size:,} bytes"
