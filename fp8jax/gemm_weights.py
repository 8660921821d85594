"""Which parameters are GEMM weights, by Flax's names: what weight decay and low-precision
decoding apply to, whatever the rank (layers stacked under ``nn.scan`` add an axis, so a
stacked norm gain is rank 2 and a rank test would take it for a matrix)."""
from __future__ import annotations

from typing import Any, Sequence

import jax

GEMM_WEIGHT_NAMES = ("kernel", "embedding")  # nn.Dense / DenseGeneral / Conv, nn.Embed


def leaf_name(path: Sequence[Any]) -> str:
  """The last key of a ``jax.tree_util`` key path as a string ("" for the root)."""
  if not path:
    return ""
  key = path[-1]
  for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def is_gemm_weight(path: Sequence[Any]) -> bool:
  """True when a leaf's key path ends in a GEMM weight's name."""
  return leaf_name(path) in GEMM_WEIGHT_NAMES


def gemm_weight_mask(params):
  """A tree of bools like `params`: True at GEMM weights (kernels, embeddings), False at
  norm gains, biases and anything else."""
  return jax.tree_util.tree_map_with_path(lambda p, _: is_gemm_weight(p), params)
