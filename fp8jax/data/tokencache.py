"""Text -> token file, once: documents encoded by a tokenizer into a cached ``.bin``.

The cache file is named by a SHA-256 key of everything its contents depend on: the source files
(resolved paths, sizes and modification times, in order), the tokenizer file's bytes, the
document separator, `max_bytes` and the ``tokenizers`` version. A later load with the same key
memory-maps the file instead of encoding again; changing any of them makes a new file. Files are
written under a temporary name and renamed when complete, so a present file is a whole one;
processes of one host take turns through a lock file (the first encodes, the others reuse).
Each cache file has a JSON note beside it saying what it holds. Token dtype: uint16 for
vocabularies of up to 65,536 ids, else uint32 (see :mod:`fp8jax.data.binfile`).
"""
from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import tokenizers
from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

from fp8jax.data import binfile
from fp8jax.data import tokenizer as tokenizer_lib
from fp8jax.data.files import document_sizes, iter_documents

CACHE_FORMAT = 1  # bump when the cached bytes of the same inputs change
_BATCH_CHARS = 4 << 20  # text encoded per encode_batch call
_BATCH_DOCS = 1024

logger = logging.getLogger("fp8jax")


def default_cache_dir() -> Path:
  """``$XDG_CACHE_HOME/fp8jax/tokens``, or ``~/.cache/fp8jax/tokens`` when it is unset."""
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return Path(root, "fp8jax", "tokens")


@dataclasses.dataclass(frozen=True)
class CachedTokens:
  """A token file made from text by a tokenizer.

  Attributes:
    path: the cache file (a ``.bin`` of :mod:`fp8jax.data.binfile`).
    vocab_size: the tokenizer's number of ids (every id in the file is below it).
    separator: the document separator used (:class:`fp8jax.data.tokenizer.Separator`).
    created: True when this call encoded the text, False when it reused the file.
  """
  path: Path
  vocab_size: int
  separator: tokenizer_lib.Separator
  created: bool


def cache_key(files: Sequence[Path], tokenizer_path: str | os.PathLike, max_bytes: int | None,
              separator: tokenizer_lib.Separator) -> str:
  """Hex SHA-256 of what a cache file's contents depend on (see the module docstring)."""
  stats = []
  for path in files:
    st = os.stat(path)
    stats.append([str(Path(path).resolve()), st.st_size, st.st_mtime_ns])
  tokenizer_bytes = tokenizer_lib.tokenizer_file(tokenizer_path).read_bytes()
  text = json.dumps({"format": CACHE_FORMAT, "files": stats, "max_bytes": max_bytes,
                     "tokenizer": hashlib.sha256(tokenizer_bytes).hexdigest(),
                     "separator": list(separator), "tokenizers": tokenizers.__version__})
  return hashlib.sha256(text.encode()).hexdigest()


def _progress(enabled: bool | None) -> Progress:
  console = Console(stderr=True)
  return Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console,
                  disable=not (console.is_terminal if enabled is None else enabled))


def _batches(files: Sequence[Path], max_bytes: int | None):
  """Lists of (text, bytes read) of consecutive documents, about _BATCH_CHARS at a time."""
  batch, chars = [], 0
  for data in iter_documents(files, max_bytes):
    batch.append((data.decode("utf-8", errors="replace"), len(data)))
    chars += len(data)
    if chars >= _BATCH_CHARS or len(batch) >= _BATCH_DOCS:
      yield batch
      batch, chars = [], 0
  if batch:
    yield batch


def tokenize_files(files: Sequence[Path], tokenizer: tokenizers.Tokenizer,
                   out_path: str | os.PathLike, *, max_bytes: int | None,
                   separator: tokenizer_lib.Separator = tokenizer_lib.NO_SEPARATOR,
                   dtype=binfile.UINT16, progress: bool | None = None) -> int:
  """Encodes the documents of `files` (UTF-8, undecodable bytes replaced; at most `max_bytes`
  file bytes) and writes their ids, with `separator` around each, to the token file
  `out_path`. `progress`: a progress bar on stderr (None: when stderr is a terminal).
  Returns the number of tokens written."""
  encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
  before = np.array([separator.id] if separator.place == "before" else [], np.int64)
  after = np.array([separator.id] if separator.place == "after" else [], np.int64)
  with binfile.BinWriter(out_path, dtype) as writer, _progress(progress) as bar:
    task = bar.add_task("tokenizing", total=sum(document_sizes(files, max_bytes)))
    for batch in _batches(files, max_bytes):
      encodings = encode([text for text, _ in batch], add_special_tokens=False)
      writer.write(np.concatenate([part for e in encodings
                                   for part in (before, np.asarray(e.ids, np.int64), after)]))
      bar.advance(task, sum(n for _, n in batch))
  return writer.count


def cached_tokens(files: Sequence[Path], tokenizer_path: str | os.PathLike, *,
                  max_bytes: int | None, cache_dir: str | os.PathLike | None = None,
                  progress: bool | None = None) -> CachedTokens:
  """The token file of `files` encoded by the tokenizer at `tokenizer_path`: reused from
  `cache_dir` (None: :func:`default_cache_dir`) when its key matches, else encoded there by
  :func:`tokenize_files` first."""
  tokenizer = tokenizer_lib.load_tokenizer(tokenizer_path)
  vocab = tokenizer_lib.tokenizer_vocab_size(tokenizer)
  separator = tokenizer_lib.document_separator(tokenizer, tokenizer_path)
  folder = Path(default_cache_dir() if cache_dir is None else cache_dir)
  key = cache_key(files, tokenizer_path, max_bytes, separator)
  path = folder / f"{key[:32]}.bin"
  if path.is_file():
    return CachedTokens(path, vocab, separator, created=False)
  folder.mkdir(parents=True, exist_ok=True)
  with open(path.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # processes of one host: the first encodes, the rest wait
    if path.is_file():
      return CachedTokens(path, vocab, separator, created=False)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
      count = tokenize_files(files, tokenizer, partial, max_bytes=max_bytes, separator=separator,
                             dtype=binfile.token_dtype(vocab), progress=progress)
      note = {"tokens": count, "vocab_size": vocab, "separator": separator._asdict(),
              "tokenizer": str(Path(tokenizer_path).resolve()), "files": len(files),
              "first_file": str(files[0]) if files else None, "max_bytes": max_bytes, "key": key}
      path.with_suffix(".json").write_text(json.dumps(note, indent=1) + "\n")
      os.replace(partial, path)
    finally:
      if partial.exists():
        partial.unlink()
  logger.info("tokenized %d file(s) into %s tokens: %s", len(files), f"{count:,}", path)
  return CachedTokens(path, vocab, separator, created=True)
