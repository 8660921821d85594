"""Text sources: file patterns -> sorted files -> documents (bytes), at most `max_bytes` of them.

A pattern is a file, a directory (every file below it) or a glob; each pattern's files are
sorted by path and duplicates dropped. Two corpora are built in (:data:`BUILTIN_SOURCES`), real
text on every machine:
  - ``"stdlib"`` (the default): the running Python's standard library source, the ``*.py``
    files under ``sysconfig.get_paths()["stdlib"]`` (site-/dist-packages excluded) sorted by
    relative path (about 30 MB; it differs between Python versions);
  - ``"site-packages"``: the ``*.py`` files of the installed packages, under every folder of
    :func:`site_packages_roots` (sorted), each folder's files sorted by relative path; its
    size depends on what is installed.
Byte-level tokens are the documents' bytes joined by :data:`DOC_SEPARATOR`.
"""
from __future__ import annotations

import glob
import os
import site
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


def _python_entries(root: Path, excluded: frozenset) -> list[tuple[str, tuple[int, int]]]:
  """(path relative to `root` in posix form, (device, inode) of the file) of the ``*.py``
  files below `root` (folders named in `excluded` skipped, symlinked folders not followed,
  unreadable folders skipped), sorted by relative path. One directory read per folder and no
  stat per plain file."""
  found, device = [], os.stat(root).st_dev
  stack = [("", os.fspath(root))]
  while stack:
    rel, folder = stack.pop()
    try:
      entries = os.scandir(folder)
    except OSError:
      continue
    with entries:
      for e in entries:
        if e.is_dir(follow_symlinks=False):
          if e.name not in excluded:
            stack.append((f"{rel}{e.name}/", e.path))
        elif e.name.endswith(".py") and e.is_file():
          if e.is_symlink():  # the file it names
            st = os.stat(e.path)
            found.append((rel + e.name, (st.st_dev, st.st_ino)))
          else:
            found.append((rel + e.name, (device, e.inode())))
  found.sort(key=lambda f: f[0])
  return found


def _python_files(root: Path, excluded: frozenset) -> list[Path]:
  """The ``*.py`` files below `root` (see :func:`_python_entries`), sorted by path relative
  to `root`."""
  return [root / rel for rel, _ in _python_entries(root, excluded)]


def stdlib_files() -> list[Path]:
  """The standard library's ``*.py`` files (no site-/dist-packages), sorted by relative path."""
  root = Path(sysconfig.get_paths()["stdlib"])
  files = _python_files(root, _EXCLUDED_DIRS)
  if not files:
    raise FileNotFoundError(f"no files matched '*.py' under {str(root)!r}")
  return files


def site_packages_roots() -> list[Path]:
  """The folders installed packages live in: ``site.getsitepackages()`` and sysconfig's
  ``purelib`` / ``platlib`` that exist, each once (by resolved path), sorted by path."""
  paths = sysconfig.get_paths()
  found = list(getattr(site, "getsitepackages", list)()) + [paths["purelib"], paths["platlib"]]
  roots = {}
  for path in found:
    if os.path.isdir(path):
      roots.setdefault(Path(path).resolve(), Path(path))
  return sorted(roots.values(), key=lambda p: p.as_posix())


def site_packages_files() -> list[Path]:
  """The installed packages' ``*.py`` files: for each folder of :func:`site_packages_roots`
  in order, its files sorted by relative path (``__pycache__`` skipped; a file reachable from
  two folders is listed once)."""
  roots = site_packages_roots()
  files, seen = [], set()
  for root in roots:
    for rel, identity in _python_entries(root, frozenset({"__pycache__"})):
      if identity not in seen:
        seen.add(identity)
        files.append(root / rel)
  if not files:
    shown = [str(r) for r in roots]
    raise FileNotFoundError(f"no files matched '*.py' under the site-packages folders {shown}")
  return files


# The built-in corpora by name (data.source), each a function returning its files in order.
BUILTIN_SOURCES = {"stdlib": stdlib_files, "site-packages": site_packages_files}


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


def builtin_source(source) -> str | None:
  """The name of the built-in corpus `source` names (None is "stdlib"), or None when `source`
  is file patterns."""
  if source is None:
    return "stdlib"
  return source if isinstance(source, str) and source in BUILTIN_SOURCES else None


def source_files(source) -> list[Path]:
  """The text files of `source`: None or a name of :data:`BUILTIN_SOURCES` -> that corpus's
  files, else :func:`resolve_files`."""
  name = builtin_source(source)
  return BUILTIN_SOURCES[name]() if name is not None else resolve_files(source)


def read_sizes(files: Sequence[Path], max_bytes: int | None = DEFAULT_MAX_BYTES
               ) -> list[tuple[Path, int]]:
  """(path, bytes read) of each document :func:`iter_documents` yields (files past the cap
  are left out; the last one may be cut)."""
  check_positive("max_bytes", max_bytes, allow_none=True)
  out, left = [], max_bytes
  for path in files:
    if left is not None and left <= 0:
      break
    size = os.path.getsize(path)
    out.append((path, size if left is None else min(size, left)))
    left = None if left is None else left - out[-1][1]
  return out


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
