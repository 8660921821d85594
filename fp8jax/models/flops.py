"""GEMM FLOPs of any JAX function, counted from its jaxpr: the FLOPs per token of a model
that does not state its own (a user's builder), for MFU.

Every ``dot_general`` counts 2 x (batch dims) x M x N x K; sub-jaxprs (``jit``, ``remat``,
``custom_jvp``/``custom_vjp`` calls, ``cond`` branches: the largest) are entered, a ``scan``
body counts `length` times. Elementwise work, softmax and norms are not counted (as in the
usual 6 N per token estimate). A ``while`` loop's trip count is unknown: its body counts once
and :func:`gemm_flops` says so through `uncounted_loops`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax


class GemmFlops(NamedTuple):
  """flops: GEMM FLOPs of one call; uncounted_loops: while loops counted once."""
  flops: float
  uncounted_loops: int


def _dot_flops(eqn) -> float:
  lhs, rhs = (v.aval.shape for v in eqn.invars[:2])
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  contract = math.prod(lhs[d] for d in lc)
  batch = math.prod(lhs[d] for d in lb)
  lhs_free = math.prod(n for d, n in enumerate(lhs) if d not in lc and d not in lb)
  rhs_free = math.prod(n for d, n in enumerate(rhs) if d not in rc and d not in rb)
  return 2.0 * batch * lhs_free * rhs_free * contract


def _subjaxprs(eqn):
  """The jaxprs inside `eqn`'s parameters (closed or open)."""
  for value in eqn.params.values():
    for sub in value if isinstance(value, (tuple, list)) else (value,):
      sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
      if hasattr(sub, "eqns"):
        yield sub


def _count(jaxpr) -> tuple[float, int]:
  flops, loops = 0.0, 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name == "dot_general":
      flops += _dot_flops(eqn)
      continue
    subs = [_count(j) for j in _subjaxprs(eqn)]
    if not subs:
      continue
    if name == "cond":  # one branch runs: the largest
      flops += max(f for f, _ in subs)
      loops += max(n for _, n in subs)
      continue
    if name == "custom_vjp_call" or name.startswith("custom_vjp"):  # fwd rule and bwd: fun
      subs = subs[:1]
    times = eqn.params.get("length", 1) if name == "scan" else 1
    loops += int(name == "while") + sum(n for _, n in subs)
    flops += times * sum(f for f, _ in subs)
  return flops, loops


def gemm_flops(fn: Callable, *args: Any, **kwargs: Any) -> GemmFlops:
  """GEMM FLOPs of one call ``fn(*args, **kwargs)`` (traced abstractly: args may be
  ``jax.ShapeDtypeStruct``s; nothing runs)."""
  closed = jax.make_jaxpr(fn)(*args, **kwargs)
  flops, loops = _count(closed.jaxpr)
  return GemmFlops(flops, loops)


def training_flops_per_token(apply_fn: Callable, variables, batch_size: int,
                             seq_len: int) -> float:
  """Training FLOPs per token of ``apply_fn(variables, tokens int32[B, T])``: 3 x the
  forward's GEMM FLOPs (forward, then input and weight gradients) / (B T)."""
  tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jax.numpy.int32)
  forward = gemm_flops(apply_fn, variables, tokens).flops
  return 3.0 * forward / (batch_size * seq_len)
