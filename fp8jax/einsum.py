"""Two-operand einsum as an FP8 GEMM: equation -> (sum, dot_general, transpose).

Shared by ``fp8jax.linen.Einsum`` and ``fp8jax.nnx.Einsum``.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

from fp8jax import fsdp
from fp8jax.dot import Fp8DotMeta, fp8_dot_general_chained
from fp8jax.recipe import Recipe


class EinsumDims(NamedTuple):
  """A two-operand einsum as ``sum -> dot_general -> transpose``.

  Attributes:
    lhs_sum, rhs_sum: axes summed out of each operand first (labels in that operand only and
      not in the output, or size-1 axes broadcast against the other operand).
    dimension_numbers: ``lax.dot_general`` dimension numbers of the summed operands.
    out_perm: permutation taking dot_general's (batch, lhs free, rhs free) output to the
      equation's output order.
  """

  lhs_sum: tuple[int, ...]
  rhs_sum: tuple[int, ...]
  dimension_numbers: tuple
  out_perm: tuple[int, ...]


def _check_spec(spec: str, eqn: str) -> None:
  """Raises unless `spec` is letters with at most one '...'."""
  body = spec.replace("...", "", 1)
  if not all(c.isalpha() for c in body):
    raise ValueError(f"einsum equation {eqn!r}: subscripts {spec!r} may hold only letters and "
                     "one '...'")
  if len(set(body)) != len(body):
    raise ValueError(f"einsum equation {eqn!r}: repeated label in {spec!r} (diagonals/traces) "
                     "is not supported")


def _expand(spec: str, ndim: int, ell: str, eqn: str) -> str:
  """`spec` with '...' replaced by the last dims of `ell` (right-aligned broadcasting)."""
  if "..." not in spec:
    if len(spec) != ndim:
      raise ValueError(f"einsum equation {eqn!r}: subscripts {spec!r} name {len(spec)} axes but "
                       f"the operand has {ndim}")
    return spec
  n = ndim - (len(spec) - 3)
  if n < 0:
    raise ValueError(f"einsum equation {eqn!r}: subscripts {spec!r} name more axes than the "
                     f"operand's {ndim}")
  return spec.replace("...", ell[len(ell) - n:])


def parse_einsum(eqn: str, lhs_ndim: int, rhs_ndim: int) -> tuple[str, str, str]:
  """(lhs, rhs, out) labels of a two-operand einsum with '...' expanded to fresh letters.

  An implicit output (no '->') is the ellipsis dims then the labels seen once, sorted, as in
  numpy. Ellipsis dims missing from an explicit output are summed, as in ``jnp.einsum``.
  """
  eqn = eqn.replace(" ", "")
  ins, arrow, out = eqn.partition("->")
  specs = ins.split(",")
  if len(specs) != 2:
    raise ValueError(f"einsum equation {eqn!r} must have exactly two operands, got {len(specs)}")
  for spec in specs + ([out] if arrow else []):
    _check_spec(spec, eqn)
  used = set(eqn)
  fresh = "".join(c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                  if c not in used)
  n_ell = max(ndim - (len(s) - 3) if "..." in s else 0
              for s, ndim in zip(specs, (lhs_ndim, rhs_ndim)))
  if n_ell > len(fresh):
    raise ValueError(f"einsum equation {eqn!r}: too many ellipsis axes ({n_ell})")
  ell = fresh[:n_ell]
  lhs = _expand(specs[0], lhs_ndim, ell, eqn)
  rhs = _expand(specs[1], rhs_ndim, ell, eqn)
  if arrow:
    out = out.replace("...", ell)
  else:
    once = sorted(c for c in set(lhs + rhs) if (lhs + rhs).count(c) == 1 and c not in ell)
    out = ell + "".join(once)
  missing = [c for c in out if c not in lhs + rhs]
  if missing:
    raise ValueError(f"einsum equation {eqn!r}: output labels {missing} are in no operand")
  return lhs, rhs, out


def _broadcast_drops(lhs: str, rhs: str, lhs_shape, rhs_shape, eqn: str):
  """Shared labels where one side has size 1 against n > 1: (lhs drops, rhs drops)."""
  ls, rs = dict(zip(lhs, lhs_shape)), dict(zip(rhs, rhs_shape))
  drop_l, drop_r = set(), set()
  for c in set(lhs) & set(rhs):
    if ls[c] == rs[c]:
      continue
    if ls[c] == 1:
      drop_l.add(c)
    elif rs[c] == 1:
      drop_r.add(c)
    else:
      raise ValueError(f"einsum equation {eqn!r}: label {c!r} has size {ls[c]} in lhs "
                       f"{tuple(lhs_shape)} but {rs[c]} in rhs {tuple(rhs_shape)}")
  return drop_l, drop_r


def einsum_to_dot_general(eqn: str, lhs_shape: Sequence[int],
                          rhs_shape: Sequence[int]) -> EinsumDims:
  """Translates a two-operand einsum into :class:`EinsumDims` (sum, dot_general, transpose).

  Labels in both operands and the output are batch dims, in both but not the output are
  contracted, others are free. Labels in one operand only and not in the output are summed
  first; '...' is supported (right-aligned broadcasting, size-1 axes broadcast).
  """
  lhs, rhs, out = parse_einsum(eqn, len(lhs_shape), len(rhs_shape))
  drop_l, drop_r = _broadcast_drops(lhs, rhs, lhs_shape, rhs_shape, eqn)
  r_eff = set(rhs) - drop_r
  l_eff = set(lhs) - drop_l
  lhs_sum = tuple(i for i, c in enumerate(lhs) if c in drop_l or (c not in r_eff and c not in out))
  rhs_sum = tuple(i for i, c in enumerate(rhs) if c in drop_r or (c not in l_eff and c not in out))
  l2 = [c for i, c in enumerate(lhs) if i not in lhs_sum]
  r2 = [c for i, c in enumerate(rhs) if i not in rhs_sum]
  batch = [c for c in l2 if c in r2 and c in out]
  contract = [c for c in l2 if c in r2 and c not in out]
  dn = ((tuple(l2.index(c) for c in contract), tuple(r2.index(c) for c in contract)),
        (tuple(l2.index(c) for c in batch), tuple(r2.index(c) for c in batch)))
  dot_out = batch + [c for c in l2 if c not in r2] + [c for c in r2 if c not in l2]
  out_perm = tuple(dot_out.index(c) for c in out)
  return EinsumDims(lhs_sum, rhs_sum, dn, out_perm)


def fp8_einsum(eqn: str, lhs: jax.Array, rhs: jax.Array, meta: Fp8DotMeta,
               recipe: Recipe = Recipe(), *, preferred_element_type=None,
               amax_axes: Sequence[str] = (), weight_shardings=None,
               keep_gathered_weight: bool = False):
  """Two-operand einsum whose contraction is an FP8 GEMM; returns ``(out, meta_passthrough)``.

  Same contract as :func:`fp8jax.fp8_dot_general_chained` (`lhs` activations, `rhs` weights;
  `weight_shardings` are `rhs`'s; when the equation sums axes out of `rhs` first, `rhs` is
  gathered whole before the sum).
  """
  d = einsum_to_dot_general(eqn, jnp.shape(lhs), jnp.shape(rhs))
  if d.lhs_sum:
    lhs = jnp.sum(lhs, axis=d.lhs_sum)
  if d.rhs_sum:  # gathered whole first, then summed
    if weight_shardings is not None:
      rhs = fsdp.gather_array(rhs, *weight_shardings)
    rhs = jnp.sum(rhs, axis=d.rhs_sum)
    weight_shardings = None
  y, meta = fp8_dot_general_chained(lhs, rhs, d.dimension_numbers, meta, recipe,
                                    preferred_element_type=preferred_element_type,
                                    amax_axes=amax_axes, weight_shardings=weight_shardings,
                                    keep_gathered_weight=keep_gathered_weight)
  if d.out_perm != tuple(range(y.ndim)):
    y = jnp.transpose(y, d.out_perm)
  return y, meta
