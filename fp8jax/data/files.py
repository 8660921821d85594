"""Text sources: file patterns -> sorted files -> documents (bytes), at most `max_bytes` of them.

A pattern is a file, a directory (every file below it) or a glob; each pattern's files are
sorted by path and duplicates dropped. The default corpus is the running Python's standard
library source: the ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (site-/
dist-packages excluded) sorted by relative path, real text on every machine (it differs between
Python versions). Byte-level tokens are the documents' bytes joined by :data:`DOC_SEPARATOR`.
"""
from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from fp8jax.data._checks import check_positive

DOC_SEPARATOR = 0  # byte written between documents (NUL never occurs in text)
DEFAULT_MAX_BYTES = 32 << 20  # 32 MiB: the stdlib corpus loads in about a second
BYTE_VOCAB = 256
_GLOB_CHARS = frozenset("*?[")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_files() -> list[Path]:
  """The standard library's ``*.py`` files (no site-/dist-packages), sorted by relative path."""
  root = Path(sysconfig.get_paths()["stdlib"])
  files = []
  for folder, dirs, names in os.walk(root):
    dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
    files += [Path(folder, n) for n in names if n.endswith(".py")]
  files = sorted((p for p in files if p.is_file()), key=lambda p: p.relative_to(root).as_posix())
  if not files:
    raise FileNotFoundError(f"no files matched '*.py' under {str(root)!r}")
  return files


def _expand(pattern: str | os.PathLike) -> list[Path]:
  """Files named by one pattern: a file, a directory (all files below) or a glob; sorted."""
  text = os.fspath(pattern)
  if _GLOB_CHARS.intersection(text):
    found = [Path(p) for p in glob.glob(text, recursive=True)]
  elif os.path.isdir(text):
    found = list(Path(text).rglob("*"))
  else:
    found = [Path(text)]
  files = sorted((p for p in found if p.is_file()), key=lambda p: p.as_posix())
  if not files:
    raise FileNotFoundError(f"no files matched {text!r} (a file, a directory or a glob "
                            "such as 'data/**/*.txt')")
  return files


def resolve_files(patterns: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
  """Files of all `patterns` in order (each pattern's files sorted), duplicates dropped."""
  if isinstance(patterns, (str, os.PathLike)):
    patterns = [patterns]
  patterns = list(patterns)
  if not patterns:
    raise ValueError("no data source given: pass a file, a directory, a glob or a list of them")
  seen, files = set(), []
  for pattern in patterns:
    for path in _expand(pattern):
      if path.resolve() not in seen:
        seen.add(path.resolve())
        files.append(path)
  return files


def source_files(source) -> list[Path]:
  """The text files of `source`: None -> :func:`stdlib_files`, else :func:`resolve_files`."""
  return stdlib_files() if source is None else resolve_files(source)


def document_sizes(files: Sequence[Path], max_bytes: int | None = DEFAULT_MAX_BYTES) -> list[int]:
  """Bytes :func:`iter_documents` reads from each of `files` (0 for files past the cap)."""
  check_positive("max_bytes", max_bytes, allow_none=True)
  sizes, left = [], max_bytes
  for path in files:
    size = os.path.getsize(path)
    sizes.append(size if left is None else min(size, left))
    left = None if left is None else left - sizes[-1]
  return sizes


def iter_documents(files: Sequence[Path], max_bytes: int | None = DEFAULT_MAX_BYTES
                   ) -> Iterator[bytes]:
  """The bytes of each of `files` in order until `max_bytes` file bytes are read (the last
  document is cut there; files past the cap are not opened)."""
  check_positive("max_bytes", max_bytes, allow_none=True)
  left = max_bytes
  for path in files:
    if left is not None and left <= 0:
      return
    with open(path, "rb") as f:
      data = f.read() if left is None else f.read(left)
    left = None if left is None else left - len(data)
    yield data


def read_documents(files: Sequence[Path], max_bytes: int | None = DEFAULT_MAX_BYTES) -> np.ndarray:
  """uint8[N] byte tokens of `files` joined by DOC_SEPARATOR, at most `max_bytes` file bytes."""
  parts = []
  for data in iter_documents(files, max_bytes):
    parts += [np.frombuffer(data, np.uint8), np.array([DOC_SEPARATOR], np.uint8)]
  return np.concatenate(parts[:-1]) if parts else np.zeros((0,), np.uint8)
