"""Where a dot_general's operands live: its canonical [B, M, K] @ [B, K, N] form, the
shardings of a ZeRO-3 weight in that form, and the manual mesh axes (inside ``shard_map``)
the operands vary over.

:mod:`fp8jax.dot` reads these to bring any ``lax.dot_general`` layout to the one matmul its
custom VJP differentiates; they compute shapes, permutations and shardings, no values.
"""
from __future__ import annotations

import math

import jax
from jax import lax
from jax.sharding import PartitionSpec as P

from fp8jax import fsdp


def vma_of(x) -> frozenset:
  """Manual mesh axes (inside shard_map) that `x` varies over."""
  aval = jax.typeof(x)
  manual = getattr(aval, "manual_axis_type", None)  # jax 0.10+; older releases: aval.vma
  return frozenset(manual.varying if manual is not None else getattr(aval, "vma", None) or ())


def to_vma(x, vma: frozenset):
  """`x` marked as varying over `vma` (a no-op outside shard_map)."""
  missing = tuple(sorted(vma - vma_of(x)))
  return lax.pcast(x, missing, to="varying") if missing else x


def explicit_shardings(x, w):
  """Shardings for the gradients of `x` and `w` when the mesh has Explicit axes (sharding
  in types: a contraction over a sharded axis then needs its output sharding), else Nones."""
  explicit = jax.sharding.AxisType.Explicit
  shardings = [getattr(jax.typeof(a), "sharding", None) for a in (x, w)]
  meshes = [getattr(s, "mesh", None) for s in shardings]
  mesh = next((m for m in meshes if m is not None and explicit in tuple(m.axis_types)), None)
  if mesh is None:
    return None, None
  return tuple(jax.sharding.NamedSharding(mesh, s.spec if m == mesh else P())
               for s, m in zip(shardings, meshes))


def canonical_dims(lhs_shape, rhs_shape, dimension_numbers):
  """Permutations and sizes that turn a dot_general into [B, M, K] @ [B, K, N]."""
  (lc, rc), (lb, rb) = dimension_numbers
  lc, rc, lb, rb = (tuple(int(a) for a in t) for t in (lc, rc, lb, rb))
  lf = tuple(i for i in range(len(lhs_shape)) if i not in lc + lb)
  rf = tuple(i for i in range(len(rhs_shape)) if i not in rc + rb)
  size = lambda shape, axes: math.prod(shape[i] for i in axes)
  b, m, k, n = size(lhs_shape, lb), size(lhs_shape, lf), size(lhs_shape, lc), size(rhs_shape, rf)
  out_shape = tuple(lhs_shape[i] for i in lb + lf) + tuple(rhs_shape[i] for i in rf)
  return lb + lf + lc, rb + rc + rf, (b, m, k, n), bool(lb), out_shape


def agree_on_vma(x, w, amax_axes):
  """Inside shard_map: checks that amaxes are agreed over every axis the operands vary over
  (else devices would pick different scales), and marks both operands varying alike."""
  vma = vma_of(x) | vma_of(w)
  missing = sorted(vma - set(amax_axes))
  if missing:
    raise ValueError(f"fp8_dot_general inside shard_map: the operands vary over mesh axes "
                     f"{missing} but amax_axes={tuple(amax_axes)!r}; pass "
                     f"amax_axes={tuple(sorted(vma | set(amax_axes)))!r} so that every device "
                     "computes the same FP8 scale")
  return to_vma(x, vma), to_vma(w, vma)


def canonical_spec(spec: P, shape, perm, groups) -> P | None:
  """The spec of ``transpose(x, perm)`` reshaped by merging consecutive dims in `groups`
  (their counts), for x of `shape` laid out as `spec`; None when a merged dim's layout is no
  spec (a split dim of a group must be its first dim larger than 1, and the only split one)."""
  entries = tuple(spec) + (None,) * (len(shape) - len(spec))
  dims = [(shape[i], entries[i]) for i in perm]
  out, start = [], 0
  for count in groups:
    group, start = dims[start:start + count], start + count
    split = [j for j, (_, e) in enumerate(group) if e is not None]
    if len(split) > 1 or (split and any(n > 1 for n, _ in group[:split[0]])):
      return None
    out.append(group[split[0]][1] if split else None)
  return P(*out)


def weight_gather(shardings, rhs_shape, dimension_numbers, rperm, vma: frozenset, keep: bool):
  """(home, gathered, keep): shardings of the canonical weight ([B?, K, N]) for `shardings`
  of the rhs, or None when the canonical layout cannot express them."""
  if vma or (isinstance(shardings, (tuple, list))
             and any(isinstance(s, fsdp.Local) for s in shardings)):
    raise ValueError("weight_shardings inside shard_map is not supported; gather the weight "
                     "first there (fp8jax.fsdp.gather_tree)")
  if (not isinstance(shardings, (tuple, list)) or len(shardings) != 2
      or not all(isinstance(s, jax.sharding.NamedSharding) for s in shardings)):
    raise TypeError(f"weight_shardings must be a (home, gathered) pair of NamedShardings, got "
                    f"{shardings!r}")
  (_, rc), (_, rb) = dimension_numbers
  groups = ((len(rb),) if len(rb) else ()) + (len(rc), len(rhs_shape) - len(rc) - len(rb))
  specs = [canonical_spec(s.spec, rhs_shape, rperm, groups) for s in shardings]
  if any(s is None for s in specs):
    return None
  return tuple(jax.sharding.NamedSharding(s.mesh, c) for s, c in zip(shardings, specs)) + (
      bool(keep),)
