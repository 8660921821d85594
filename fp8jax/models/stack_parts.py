"""A language model cut into embedding, layer stack and head: what pipeline stages (and the
layer-major balanced ZeRO-3 loop) need of a model.

The reference decoders cut themselves (``Decoder.parts()``). A user's linen model (a
``model.builder``) is cut by :class:`StackParts` when it follows this contract:

* methods ``embed(tokens) -> x``, ``blocks(x) -> x`` and ``head(x) -> logits`` with
  ``__call__(tokens) == head(blocks(embed(tokens)))``; x is the residual stream [B, T, D];
* ``blocks`` runs one ``nn.scan`` submodule named ``layers`` (:data:`STACK`) whose ``length``
  is the module field `layer_field` (so every variable under it, the FP8 state too, has a
  leading layer axis [L, ...]);
* the module's ``parts(self)`` returns ``StackParts(self, layer_field)``.

Such a model still trains as a whole everywhere else; ``fp8jax.convert`` keeps the methods
(they run its FP8 GEMMs too).
"""
from __future__ import annotations

import dataclasses
from typing import Mapping

import flax.linen as nn
import jax

STACK = "layers"  # the name of the layer stack's nn.scan submodule
METHODS = ("embed", "blocks", "head")


def split_stack(variables) -> tuple[dict, dict]:
  """(stacked, shared) of a model's variables ``{collection: tree}``: stacked is
  ``{collection: its STACK subtree}`` (leaves [L, ...]), shared every other subtree."""
  stacked = {c: v[STACK] for c, v in variables.items() if isinstance(v, Mapping) and STACK in v}
  shared = {c: {k: x for k, x in v.items() if k != STACK} for c, v in variables.items()}
  return stacked, shared


def merge_stack(stacked, shared) -> dict:
  """The variables (or gradients) of a (stacked, shared) pair: :func:`split_stack`'s
  inverse."""
  return {c: {**v, **({STACK: stacked[c]} if c in stacked else {})} for c, v in shared.items()}


def layer_count(stacked) -> int:
  """L, the leading axis of the stacked variables' leaves."""
  leaves = jax.tree.leaves(stacked)
  if not leaves:
    raise ValueError("the model's layer stack holds no variables")
  return int(leaves[0].shape[0])


def missing_cut(module) -> list[str]:
  """What `module` lacks of the contract above (empty: it can be cut)."""
  if not isinstance(module, nn.Module):
    return [f"a flax.linen Module (got {type(module).__name__})"]
  return [f"method {m}()" for m in (*METHODS, "parts") if not callable(getattr(module, m, None))]


@dataclasses.dataclass(frozen=True)
class StackParts:
  """`module` (following the module docstring's contract) cut into parts applied to explicit
  variables without RNGs (dropout off, as every pipeline applies a model):
  ``logits(shared, layers(stacked, embed(shared, tokens)))`` is ``module.apply(variables,
  tokens)``. ``layers`` takes any L' >= 1 consecutive layers (a pipeline stage's slice).

  Attributes:
    module: the linen module (or its ``fp8jax.convert``-ed copy).
    layer_field: the module field that sets the layer stack's length.
  """

  module: nn.Module
  layer_field: str = "n_layers"

  def __post_init__(self):
    missing = missing_cut(self.module)
    if missing:
      raise ValueError(f"StackParts: {type(self.module).__name__} has no {', '.join(missing)}; "
                       f"see fp8jax.models.stack_parts for the contract")
    value = getattr(self.module, self.layer_field, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"StackParts: {type(self.module).__name__}.{self.layer_field} is "
                       f"{value!r}, not a layer count; name the field that sets the length of "
                       f"its nn.scan {STACK!r} (layer_field=...)")

  @property
  def n_layers(self) -> int:
    """The layers of the stack (the module's `layer_field`)."""
    return getattr(self.module, self.layer_field)

  def split(self, variables) -> tuple[dict, dict]:
    """(stacked, shared) of `variables` (:func:`split_stack`)."""
    return split_stack(variables)

  def merge(self, stacked, shared) -> dict:
    """:meth:`split`'s inverse (:func:`merge_stack`)."""
    return merge_stack(stacked, shared)

  def embed(self, shared, tokens) -> jax.Array:
    """tokens int[B, T] -> x[B, T, D] (the module's ``embed``)."""
    return self.module.apply(shared, tokens, method=METHODS[0])

  def layers(self, stacked, x) -> jax.Array:
    """x through the L' layers of `stacked` (leaves [L', ...]): the module's ``blocks`` with
    its stack L' long."""
    module = self.module.clone(**{self.layer_field: layer_count(stacked)})
    return module.apply({c: {STACK: v} for c, v in stacked.items()}, x, method=METHODS[1])

  def logits(self, shared, x) -> jax.Array:
    """x -> logits (the module's ``head``)."""
    return self.module.apply(shared, x, method=METHODS[2])
