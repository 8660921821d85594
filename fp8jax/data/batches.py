"""Deterministic, resumable batches int32[B, T+1] (inputs + targets) of a token stream.

The stream is cut into W = (N - 1) // T windows of T + 1 tokens at stride T (a window's last
token is the next window's first input). Each epoch visits all W windows once, in a permutation
drawn from (seed, epoch), starting at a random offset in [0, (N - 1) - W * T] so that epochs see
different cuts; validation iterators (``shuffle=False``) go in order from offset 0. A batch
takes the next B windows of this endless sequence (crossing into the next epoch when needed), so
the whole position is one integer: ``state()`` / ``restore()`` give bit-identical later batches,
whatever the token source (bytes, a token file, a tokenizer's cache).
"""
from __future__ import annotations

import numpy as np

from fp8jax.data._checks import check_positive

_STATE_KEYS = ("position", "seed", "batch_size", "seq_len", "num_tokens", "shuffle")


class BatchIterator:
  """Endless, resumable batches int32[B, T+1] of a token stream (see the module docstring).

  ``next()`` returns rows ``tokens[s : s + T + 1]``: inputs ``[:, :-1]``, targets ``[:, 1:]``.
  """

  def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int = 0,
               shuffle: bool = True, name: str = "tokens"):
    check_positive("batch_size", batch_size)
    check_positive("seq_len", seq_len)
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
