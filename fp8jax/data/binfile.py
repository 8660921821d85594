"""Token files (``.bin``): little-endian token ids, memory-mapped when read.

Two layouts are read, told apart by the first bytes:
  - headerless uint16 ids (nanoGPT's format);
  - llm.c's format: a 1 KiB header of 256 int32 (magic, version, token count, zeros) then the
    ids: magic 20240520 / version 1 for uint16 ids, magic 20240801 / version 7 for uint32 ids.
    A file counts as this layout only when the token count also matches the file size.
:func:`write_bin` (and :class:`BinWriter`) write headerless uint16 when every id fits in 16
bits and llm.c's uint32 layout otherwise, so any vocabulary up to 2**32 ids (LLaMA-3's 128,256)
round-trips and uint16 files stay readable by nanoGPT.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

UINT16 = np.dtype("<u2")
UINT32 = np.dtype("<u4")
BIN_DTYPE = UINT16  # the headerless layout's dtype
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# llm.c's (magic, version) per token dtype.
_LLMC_HEADERS = {UINT16: (20240520, 1), UINT32: (20240801, 7)}


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 when ids 0..vocab_size-1 fit in 16 bits (vocab_size <= 65,536), else uint32."""
  if vocab_size > 2**32:
    raise ValueError(f"vocab_size={vocab_size} is not allowed in a token file; use at most 2**32")
  return UINT16 if vocab_size <= 2**16 else UINT32


def _header(dtype: np.dtype, count: int) -> bytes:
  magic, version = _LLMC_HEADERS[dtype]
  header = np.zeros(HEADER_INTS, "<i4")
  header[:3] = magic, version, count
  return header.tobytes()


class BinWriter:
  """Writes a token file chunk by chunk (a context manager): headerless uint16 for
  ``dtype=uint16``, llm.c's header + uint32 ids for ``dtype=uint32``.

  ``write(ids)`` appends a 1-D integer array; ids outside the dtype's range raise ValueError.
  The header's token count is filled in on a clean exit. ``count`` is the ids written so far.
  """

  def __init__(self, path: str | os.PathLike, dtype=UINT16):
    self.path, self.dtype, self.count = Path(path), np.dtype(dtype).newbyteorder("<"), 0
    if self.dtype not in (UINT16, UINT32):
      raise ValueError(f"dtype={np.dtype(dtype)} is not allowed; use uint16 or uint32")
    self._file = None

  def __enter__(self) -> "BinWriter":
    self._file = open(self.path, "wb")
    if self.dtype == UINT32:
      self._file.write(_header(self.dtype, 0))
    return self

  def write(self, ids) -> None:
    ids = np.asarray(ids)
    if not np.issubdtype(ids.dtype, np.integer) or ids.ndim != 1:
      raise ValueError(f"token ids must be a 1-D integer array, got {ids.dtype}{list(ids.shape)}")
    top = np.iinfo(self.dtype).max
    if ids.size and (ids.min() < 0 or ids.max() > top):
      raise ValueError(f"token ids must lie in [0, {top}] ({self.dtype.name}), got "
                       f"[{ids.min()}, {ids.max()}]")
    self._file.write(ids.astype(self.dtype).tobytes())
    self.count += ids.size

  def __exit__(self, exc_type, *exc) -> None:
    try:
      if exc_type is None and self.dtype == UINT32:
        if self.count >= 2**31:
          raise ValueError(f"{self.count} tokens do not fit llm.c's header (at most 2**31 - 1)")
        self._file.seek(0)
        self._file.write(_header(self.dtype, self.count))
    finally:
      self._file.close()


def write_bin(path: str | os.PathLike, tokens, dtype=None) -> None:
  """Writes token ids (a 1-D integer array) as a token file.

  Args:
    path: file to write (replaced if it exists).
    tokens: ids >= 0.
    dtype: uint16 (headerless, ids <= 65,535) or uint32 (llm.c's header, ids < 2**32); None:
      uint16 when every id fits, else uint32.
  """
  tokens = np.asarray(tokens)
  if dtype is None:
    fits = not tokens.size or not np.issubdtype(tokens.dtype, np.integer) \
        or tokens.max() <= np.iinfo(UINT16).max
    dtype = UINT16 if fits else UINT32
  with BinWriter(path, dtype) as writer:
    writer.write(tokens)


def bin_layout(path: str | os.PathLike) -> tuple[np.dtype, int]:
  """(token dtype, byte offset of the first id) of a token file; ValueError if it is neither
  layout of the module docstring."""
  path = Path(path)
  size = path.stat().st_size
  if size >= HEADER_BYTES:
    with open(path, "rb") as f:
      magic, version, count = np.frombuffer(f.read(12), "<i4")
    for dtype, (want_magic, want_version) in _LLMC_HEADERS.items():
      if (magic, version) == (want_magic, want_version) \
          and HEADER_BYTES + int(count) * dtype.itemsize == size:
        return dtype, HEADER_BYTES
  if size == 0 or size % UINT16.itemsize:
    raise ValueError(f"{str(path)!r} has {size} bytes, not a positive multiple of 2: a .bin must "
                     "hold raw little-endian uint16 token ids or llm.c's header and ids (see "
                     "fp8jax.data.write_bin)")
  return UINT16, 0


def load_bin(path: str | os.PathLike, vocab_size: int | None = 256) -> np.ndarray:
  """Memory-maps a token file as uint16[N] or uint32[N] (its layout says which) and checks
  that every id is < `vocab_size` (None: no check)."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no files matched {str(path)!r} (token .bin file)")
  dtype, offset = bin_layout(path)
  if path.stat().st_size == offset:
    raise ValueError(f"{str(path)!r} holds no tokens")
  tokens = np.memmap(path, dtype=dtype, mode="r", offset=offset)
  if vocab_size is not None:
    check_ids(tokens, vocab_size, repr(str(path)))
  return tokens


def check_ids(tokens: np.ndarray, vocab_size: int, what: str) -> None:
  """Raises ValueError when an id of `tokens` is >= `vocab_size` (the model's vocabulary)."""
  top = int(tokens.max()) if len(tokens) else -1
  if top >= vocab_size:
    raise ValueError(f"{what} holds token id {top} >= vocab_size={vocab_size}: the model cannot "
                     f"embed it; use a model vocab_size >= {top + 1} (or the file is not token "
                     f"ids of this vocabulary: wrong dtype?)")
