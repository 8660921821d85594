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

Split: the validation set is the contiguous *tail* of the token stream (the last
`val_fraction` of tokens), the training set is everything before it; they share no token
position (a document may straddle the boundary).
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np

from fp8jax.data import binfile
from fp8jax.data._checks import check_positive
from fp8jax.data.batches import BatchIterator
from fp8jax.data.files import BYTE_VOCAB, DEFAULT_MAX_BYTES, read_documents, source_files
from fp8jax.data.tokencache import cached_tokens


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
  """

  tokens: np.ndarray
  split_at: int
  vocab_size: int
  description: str
  cache_path: Path | None = None

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
  """Loads `source` (None: stdlib corpus; text files/dirs/globs; or one ``.bin`` file).

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
  else:
    files = source_files(source)
    description = "Python stdlib source" if source is None else \
        f"{len(files)} text file(s) from {[os.fspath(n) for n in names]}"
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
  split_at = len(tokens) - int(round(len(tokens) * val_fraction))
  return TokenData(tokens, split_at, vocab, description, cache_path)
