"""Token sources -> deterministic, resumable batches of int32[B, T+1] (inputs + targets).

Sources (:func:`load_data`):
  - text files, directories or globs: byte-level tokens (vocab 256), each file a document,
    documents joined by :data:`DOC_SEPARATOR` (the NUL byte) in the sorted order of each
    pattern; at most `max_bytes` bytes are read (the last document is cut);
  - a pre-tokenized ``.bin`` file: raw little-endian uint16 token ids (nanoGPT's format),
    memory-mapped, ids checked against `vocab_size`; write one with :func:`write_bin`;
  - None (default): the running Python's standard library source, the ``*.py`` files under
    ``sysconfig.get_paths()["stdlib"]`` (site-/dist-packages excluded) sorted by relative
    path: real text on every machine (it differs between Python versions).

Split: the validation set is the contiguous *tail* of the token stream (the last
`val_fraction` of tokens), the training set is everything before it; they share no token
position (a document may straddle the boundary).

Batches (:class:`BatchIterator`): the stream is cut into W = (N - 1) // T windows of T + 1
tokens at stride T (a window's last token is the next window's first input). Each epoch
visits all W windows once, in a permutation drawn from (seed, epoch), starting at a random
offset in [0, (N - 1) - W * T] so that epochs see different cuts; validation iterators
(``shuffle=False``) go in order from offset 0. A batch takes the next B windows of this
endless sequence (crossing into the next epoch when needed), so the whole position is one
integer: ``state()`` / ``restore()`` give bit-identical later batches.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import sysconfig
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

DOC_SEPARATOR = 0  # byte written between documents (NUL never occurs in text)
DEFAULT_MAX_BYTES = 32 << 20  # 32 MiB: the stdlib corpus loads in about a second
BYTE_VOCAB = 256
BIN_DTYPE = np.dtype("<u2")
_GLOB_CHARS = frozenset("*?[")
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_STATE_KEYS = ("position", "seed", "batch_size", "seq_len", "num_tokens", "shuffle")


def stdlib_files() -> list[Path]:
  """The standard library's ``*.py`` files (no site-/dist-packages), sorted by relative path."""
  root = Path(sysconfig.get_paths()["stdlib"])
  files = []
  for folder, dirs, names in os.walk(root):
    dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS]
    files += [Path(folder, n) for n in names if n.endswith(".py")]
  return sorted((p for p in files if p.is_file()),
                key=lambda p: p.relative_to(root).as_posix())


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


def read_documents(files: Sequence[Path], max_bytes: int | None = DEFAULT_MAX_BYTES) -> np.ndarray:
  """uint8[N] byte tokens of `files` joined by DOC_SEPARATOR, at most `max_bytes` file bytes."""
  _check_positive("max_bytes", max_bytes, allow_none=True)
  parts, left = [], max_bytes if max_bytes is not None else float("inf")
  for path in files:
    if left <= 0:
      break
    with open(path, "rb") as f:
      data = f.read() if left == float("inf") else f.read(int(left))
    left -= len(data)
    parts += [np.frombuffer(data, np.uint8), np.array([DOC_SEPARATOR], np.uint8)]
  return np.concatenate(parts[:-1]) if parts else np.zeros((0,), np.uint8)


def write_bin(path: str | os.PathLike, tokens) -> None:
  """Writes token ids (any integer array, each in [0, 65535]) as raw little-endian uint16."""
  tokens = np.asarray(tokens)
  if not np.issubdtype(tokens.dtype, np.integer) or tokens.ndim != 1:
    raise ValueError(f"write_bin: tokens must be a 1-D integer array, got {tokens.dtype}"
                     f"{list(tokens.shape)}")
  if tokens.size and (tokens.min() < 0 or tokens.max() > np.iinfo(BIN_DTYPE).max):
    raise ValueError(f"write_bin: token ids must lie in [0, 65535] (uint16), got "
                     f"[{tokens.min()}, {tokens.max()}]")
  tokens.astype(BIN_DTYPE).tofile(path)


def load_bin(path: str | os.PathLike, vocab_size: int = BYTE_VOCAB) -> np.ndarray:
  """Memory-maps a raw uint16 token file as uint16[N]; checks its size and its ids."""
  path = Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"no files matched {str(path)!r} (token .bin file)")
  size = path.stat().st_size
  if size == 0 or size % BIN_DTYPE.itemsize:
    raise ValueError(f"{str(path)!r} has {size} bytes, not a positive multiple of 2: a .bin "
                     "must hold raw little-endian uint16 token ids (see fp8jax.data.write_bin)")
  tokens = np.memmap(path, dtype=BIN_DTYPE, mode="r")
  top = int(tokens.max())
  if top >= vocab_size:
    raise ValueError(f"{str(path)!r} holds token id {top} >= vocab_size={vocab_size}: the file "
                     "is not uint16 ids of this vocabulary (wrong dtype, or pass vocab_size)")
  return tokens


def _check_positive(name: str, value, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    extra = " or None" if allow_none else ""
    raise ValueError(f"{name}={value!r} is not allowed; use an integer >= 1{extra}")


@dataclasses.dataclass(frozen=True, eq=False)
class TokenData:
  """A token stream and its train/validation split (validation = the contiguous tail).

  Attributes:
    tokens: uint8/uint16[N] token ids (a memmap for .bin sources).
    split_at: index of the first validation token (train = tokens[:split_at]).
    vocab_size: number of token ids.
    description: where the tokens came from (for messages and logs).
  """

  tokens: np.ndarray
  split_at: int
  vocab_size: int
  description: str

  @property
  def train(self) -> np.ndarray:
    """Training tokens[split_at]."""
    return self.tokens[:self.split_at]

  @property
  def val(self) -> np.ndarray:
    """Validation tokens[N - split_at]."""
    return self.tokens[self.split_at:]

  def batches(self, split: str, batch_size: int, seq_len: int, seed: int = 0,
              shuffle: bool | None = None) -> "BatchIterator":
    """A :class:`BatchIterator` over `split` ("train" or "val"); `shuffle` defaults to True
    for train, False for val."""
    if split not in ("train", "val"):
      raise ValueError(f"split={split!r} is not allowed; use 'train' or 'val'")
    shuffle = (split == "train") if shuffle is None else shuffle
    return BatchIterator(self.train if split == "train" else self.val, batch_size, seq_len,
                         seed=seed, shuffle=shuffle, name=f"{split} split of {self.description}")


def load_data(source=None, *, val_fraction: float = 0.05, max_bytes: int | None = DEFAULT_MAX_BYTES,
              vocab_size: int = BYTE_VOCAB) -> TokenData:
  """Loads `source` (None: stdlib corpus; text files/dirs/globs; or one ``.bin`` file).

  Args:
    source: see the module docstring.
    val_fraction: share of tokens in the validation tail, in [0, 1).
    max_bytes: cap on bytes read from text sources (None: no cap); ignored for .bin.
    vocab_size: the model's vocabulary: bound of .bin ids; text sources (bytes) need >= 256.
  """
  if isinstance(val_fraction, bool) or not isinstance(val_fraction, (int, float)) \
      or not 0 <= val_fraction < 1:
    raise ValueError(f"val_fraction={val_fraction!r} is not allowed; use a number in [0, 1)")
  _check_positive("vocab_size", vocab_size)
  tokens, description, vocab = _read_source(source, max_bytes, vocab_size)
  if vocab_size < vocab:
    raise ValueError(f"vocab_size={vocab_size} is too small for {description}: byte-level text "
                     f"tokens need vocab_size >= {BYTE_VOCAB}")
  split_at = len(tokens) - int(round(len(tokens) * val_fraction))
  return TokenData(tokens, split_at, vocab, description)


def _read_source(source, max_bytes, vocab_size):
  """(tokens, description, vocab_size) of a source."""
  if source is None:
    files = stdlib_files()
    if not files:
      raise FileNotFoundError(f"no files matched '*.py' under {sysconfig.get_paths()['stdlib']!r}")
    return read_documents(files, max_bytes), "Python stdlib source", BYTE_VOCAB
  names = [source] if isinstance(source, (str, os.PathLike)) else list(source)
  bins = [n for n in names if os.fspath(n).endswith(".bin")]
  if bins and len(names) > 1:
    raise ValueError(f"a .bin source must be the only source, got {[os.fspath(n) for n in names]}")
  if bins:
    return load_bin(bins[0], vocab_size), os.fspath(bins[0]), vocab_size
  files = resolve_files(names)
  shown = [os.fspath(n) for n in names]
  return read_documents(files, max_bytes), f"{len(files)} text file(s) from {shown}", BYTE_VOCAB


class BatchIterator:
  """Endless, resumable batches int32[B, T+1] of a token stream (see the module docstring).

  ``next()`` returns rows ``tokens[s : s + T + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``.
  """

  def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
               shuffle: bool = True, name: str = "tokens"):
    _check_positive("batch_size", batch_size)
    _check_positive("seq_len", seq_len)
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
      raise ValueError(f"seed={seed!r} is not allowed; use an integer >= 0")
    if len(tokens) < seq_len + 1:
      raise ValueError(f"{name} has {len(tokens)} tokens, too few for one sequence: "
                       f"seq_len={seq_len} needs at least {seq_len + 1}; add data, lower "
                       "seq_len or change val_fraction")
    self.tokens, self.batch_size, self.seq_len = tokens, int(batch_size), int(seq_len)
    self.seed, self.shuffle, self.position = int(seed), bool(shuffle), 0
    self.windows_per_epoch = (len(tokens) - 1) // self.seq_len
    self._epochs: dict[int, tuple[int, np.ndarray | None]] = {}

  def __iter__(self) -> "BatchIterator":
    return self

  def __next__(self) -> np.ndarray:
    return self.next()

  @property
  def epoch(self) -> int:
    """Index of the epoch the next window comes from."""
    return self.position // self.windows_per_epoch

  def next(self) -> np.ndarray:
    """The next batch int32[B, T+1]; advances the position by B windows."""
    starts = self._starts(self.position + np.arange(self.batch_size))
    self.position += self.batch_size
    rows = self.tokens[starts[:, None] + np.arange(self.seq_len + 1)]
    return np.asarray(rows, np.int32)

  def _starts(self, ks: np.ndarray) -> np.ndarray:
    """Token offsets of windows number `ks` of the endless sequence."""
    out = np.empty(ks.shape, np.int64)
    epochs, idx = np.divmod(ks, self.windows_per_epoch)
    for e in np.unique(epochs):
      offset, perm = self._epoch(int(e))
      sel = epochs == e
      w = idx[sel] if perm is None else perm[idx[sel]]
      out[sel] = offset + w * self.seq_len
    return out

  def _epoch(self, e: int) -> tuple[int, np.ndarray | None]:
    """(offset, window permutation or None) of epoch `e`, from (seed, e) alone."""
    if e not in self._epochs:
      if not self.shuffle:
        self._epochs[e] = (0, None)
      else:
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, e]))
        slack = len(self.tokens) - 1 - self.windows_per_epoch * self.seq_len
        self._epochs = {k: v for k, v in self._epochs.items() if k >= e - 1}  # keep 2 or so
        self._epochs[e] = (int(rng.integers(0, slack + 1)), rng.permutation(self.windows_per_epoch))
    return self._epochs[e]

  def state(self) -> dict:
    """The position and what it is valid for, as plain ints (JSON-serialisable)."""
    return {"position": self.position, "seed": self.seed, "batch_size": self.batch_size,
            "seq_len": self.seq_len, "num_tokens": int(len(self.tokens)),
            "shuffle": int(self.shuffle)}

  def restore(self, state: dict) -> None:
    """Continues from `state` (from :meth:`state` of an iterator over the same data/settings)."""
    missing = [k for k in _STATE_KEYS if k not in state]
    if missing:
      raise ValueError(f"data state is missing keys {missing}; expected {list(_STATE_KEYS)}")
    mine = self.state()
    for k in _STATE_KEYS[1:]:
      if int(state[k]) != mine[k]:
        raise ValueError(f"data state has {k}={state[k]!r} but this iterator has {k}={mine[k]}; "
                         "restore into an iterator built with the same data and settings")
    position = state["position"]
    if isinstance(position, bool) or not isinstance(position, (int, np.integer)) or position < 0:
      raise ValueError(f"data state position={position!r} is not allowed; use an integer >= 0")
    self.position = int(position)
