"""Counting the bytes a pytree holds (optimizer state, master weights, FP8 gradients)."""
from __future__ import annotations

import jax
import numpy as np


def tree_bytes(tree) -> int:
  """Total bytes of all array leaves of `tree` (payloads, scales and counters alike)."""
  return int(sum(np.dtype(x.dtype).itemsize * int(np.prod(x.shape))
                 for x in jax.tree.leaves(tree) if hasattr(x, "dtype")))


def num_params(params) -> int:
  """Number of elements over all array leaves of `params`."""
  return int(sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params) if hasattr(x, "shape")))
