"""Tensor parallelism (Megatron-style) as sharding rules over the mesh's "tensor" axis.

A rule names a parameter by a piece of its key path and the dimension (counted from the end,
so a leading scanned-layer axis does not matter) to split over "tensor":

* attention ``qkv`` kernel [.., d, heads, 3, head_dim]: heads (column parallel);
* attention ``out`` kernel [.., heads, head_dim, d]: heads (row parallel);
* MLP ``fc_in`` [.., d, f] / ``fc_gate_in`` [.., d, f, 2]: f (column parallel);
* MLP ``fc_out`` [.., f, d]: f (row parallel).

Under ``jax.jit`` XLA's partitioner then runs each device's heads and MLP slice locally and
all-reduces the row-parallel outputs. The split dimension is the major one of the GEMM's
flattened output (or contraction) dimensions, so no weight is gathered for the GEMM (the
reference model orders its fused qkv and gate/up kernels for this). FP8 state needs nothing special: an amax is a max over
the whole (global) tensor, so every tensor-parallel device computes the same scale. The
same rules shard every array of the train state that mirrors a parameter (gradients, Adam
moments, FP16 master weights), matched by the same path piece. Other models pass their own
rules (path piece, dimension, rank) to :func:`fp8jax.parallel.plan`.
"""
from __future__ import annotations

from typing import Sequence

from jax.sharding import Mesh

from fp8jax.parallel.mesh import TENSOR

# (piece of jax.tree_util.keystr(path), dimension from the end, the kernel's own rank): an
# array of lower rank at a matching path (a per-tensor scale or amax) is not split.
Rule = tuple[str, int, int]

GPT_RULES: tuple[Rule, ...] = (
    ("['attn']['qkv']['kernel']", -3, 4),
    ("['attn']['out']['kernel']", -3, 3),
    ("['mlp']['fc_in']['kernel']", -1, 2),
    ("['mlp']['fc_gate_in']['kernel']", -2, 3),
    ("['mlp']['fc_out']['kernel']", -2, 2),
)


def tensor_size(mesh: Mesh) -> int:
  """Devices along the "tensor" axis (1 when the mesh has none)."""
  return int(mesh.shape.get(TENSOR, 1))


def tensor_dim(path: str, shape: Sequence[int], mesh: Mesh,
               rules: Sequence[Rule] = GPT_RULES) -> int | None:
  """The dimension of the array at `path` (a keystr) split over "tensor", or None (the
  array is replicated over "tensor": no rule matches, or the dimension does not divide)."""
  n = tensor_size(mesh)
  if n == 1:
    return None
  for piece, dim, rank in rules:
    if piece in path and len(shape) >= rank and shape[dim] % n == 0:
      return len(shape) + dim
  return None
