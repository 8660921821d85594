"""The run's model, from the config's model section: a built-in family (``gpt``, ``llama``),
the LLaMA family started from a Hugging Face checkpoint (``init_from: hf:DIR``), or a user's
Flax linen module (``builder: "package.module:function"``, called with ``builder_args``).

A builder returns a linen ``nn.Module`` (written with plain ``nn.Dense`` /
``nn.DenseGeneral`` / ``nn.Einsum``) or an NNX ``nnx.Module`` (``nnx.Linear`` /
``nnx.Einsum``, built with its own ``nnx.Rngs``: its parameters are the run's initial ones),
or a :class:`UserModel` that also gives its FLOPs per token, tensor-parallel rules and
conversion rules; fp8jax converts it at the run's level with :func:`fp8jax.convert` (an NNX
module through :class:`NnxModel`, applied the linen way). The module is applied as ``module.apply(variables, tokens int32[B, T]) -> logits
[B, T, V]``. Without stated FLOPs they are counted from the forward's jaxpr
(``fp8jax.models.flops``). A model without tensor rules still shards with ZeRO 1-3.
"""
from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.linen import FP8_COLLECTION
from fp8jax.nnx import Fp8State

from fp8jax.convert import ConvertReport, ConvertRules, convert
from fp8jax.interop import hf
from fp8jax.models.family import family as model_family
from fp8jax.models.flops import training_flops_per_token
from fp8jax.recipe import Recipe


@dataclasses.dataclass(frozen=True)
class UserModel:
  """What a ``model.builder`` may return instead of a bare module.

  Attributes:
    module: the Flax linen module in high precision (fp8jax converts it per level).
    flops_per_token: training FLOPs per token at the run's sequence length, for MFU (None:
      counted from the forward's jaxpr, 3 x its GEMM FLOPs).
    tensor_rules: tensor-parallel rules, ``(path piece, dimension from the end, rank)`` as in
      ``fp8jax.parallel.tensor`` (empty: parameters replicate over "tensor").
    convert_rules: which GEMMs stay high precision (default ``fp8jax.ConvertRules()``: the LM
      head).
  """

  module: nn.Module | nnx.Module
  flops_per_token: float | None = None
  tensor_rules: tuple = ()
  convert_rules: ConvertRules | None = None


def load_builder(spec: str) -> Callable[..., Any]:
  """The function named by ``"package.module:function"``; ValueError saying what is wrong."""
  module_name, _, name = spec.partition(":")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"model.builder={spec!r}: cannot import {module_name!r} ({e}); put it on "
                     "PYTHONPATH") from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise ValueError(f"model.builder={spec!r}: {module_name} has no function {name!r}")
  return fn


class RunModel:
  """The run's model at any recipe.

  Args:
    config: the run's ``fp8jax.config.Config``.
    batch_size, seq_len: the shape of one microbatch of tokens (for a builder's conversion
      and FLOP count).

  Attributes:
    name: "gpt", "llama" or the builder's spec.
    model_config: the family's config (None for a builder).
    tensor_rules: the tensor-parallel rules.
    flops_per_token: training FLOPs per token at `seq_len`.
    convert_report: what :func:`fp8jax.convert` converted (builders at an FP8 level), else
      None.
  """

  def __init__(self, config, batch_size: int, seq_len: int):
    m = config.model
    self._tokens = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32)
    self._cache: dict = {}
    self.convert_report: ConvertReport | None = None
    self._init_from = m.init_from
    if m.builder is None:
      self.name, self.model_config = m.family, m.model_config()
      fam = model_family(m.family)
      self._family = fam
      self.tensor_rules = tuple(fam.tensor_rules)
      self.flops_per_token = fam.flops_per_token(self.model_config, seq_len)
      return
    self.name, self.model_config, self._family = m.builder, None, None
    built = load_builder(m.builder)(**(m.builder_args or {}))
    user = built if isinstance(built, UserModel) else UserModel(built)
    if not isinstance(user.module, (nn.Module, nnx.Module)):
      raise ValueError(f"model.builder={m.builder!r} returned {type(user.module).__name__}; "
                       "return a flax.linen or flax.nnx Module, or an fp8jax.train.UserModel")
    self._user = user
    self.tensor_rules = tuple(user.tensor_rules)
    self.flops_per_token = user.flops_per_token
    if self.flops_per_token is None:
      plain = self.for_recipe(None)
      variables = jax.eval_shape(lambda: plain.init(jax.random.key(0), self._tokens))
      self.flops_per_token = training_flops_per_token(plain.apply, variables, batch_size,
                                                      seq_len)

  def for_recipe(self, recipe: Recipe | None) -> nn.Module:
    """The model with FP8 GEMMs of `recipe` (None: BF16/high precision); one object per
    recipe."""
    if recipe not in self._cache:
      if self._family is not None:
        self._cache[recipe] = self._family.model(self.model_config, recipe)
      elif isinstance(self._user.module, nnx.Module):
        module = nnx.clone(self._user.module)  # converted in place: one copy per recipe
        if recipe is not None:
          module, report = convert(module, recipe, rules=self._user.convert_rules)
          self.convert_report = self.convert_report or report
        self._cache[recipe] = NnxModel(module)
      elif recipe is None:
        self._cache[recipe] = self._user.module
      else:
        module, report = convert(self._user.module, recipe, self._tokens,
                                 rules=self._user.convert_rules)
        self._cache[recipe] = module
        self.convert_report = self.convert_report or report
    return self._cache[recipe]

  def recipe_of(self, model) -> Recipe | None:
    """The recipe :meth:`for_recipe` built `model` for (KeyError for another object)."""
    for recipe, built in self._cache.items():
      if built is model:
        return recipe
    raise KeyError(f"{type(model).__name__} was not built by this RunModel")

  def pretrained_params(self) -> dict | None:
    """The ``init_from`` checkpoint's params (numpy, the model's params tree) or None."""
    if self._init_from is None:
      return None
    overrides = {k: getattr(self.model_config, k) for k in hf.LOAD_OVERRIDES}
    return hf.load_pretrained(self._init_from[len("hf:"):], **overrides)[1]


class NnxModel:
  """An NNX module applied the linen way, as the train step applies models:
  ``init(key, tokens) -> {"params": ..., FP8_COLLECTION: ...}`` (pure dicts of its
  ``nnx.Param`` and ``fp8jax.nnx.Fp8State`` values: the module's own, the key is not used) and
  ``apply(variables, tokens) -> logits``, a fresh module merged from `variables` per call (the
  FP8 state's gradient is its update, as in ``fp8jax.nnx``). Other variables (RNG streams,
  batch statistics) stay as the module holds them."""

  def __init__(self, module: nnx.Module):
    self.graphdef, self._params, self._fp8, self._rest = nnx.split(
        module, nnx.Param, Fp8State, ...)

  def init(self, rngs, tokens, **kwargs) -> dict:
    out = {"params": nnx.to_pure_dict(self._params)}
    fp8 = nnx.to_pure_dict(self._fp8)
    if jax.tree.leaves(fp8):
      out[FP8_COLLECTION] = fp8
    return out

  def apply(self, variables, tokens, **kwargs):
    if kwargs:
      raise ValueError(f"an NNX model is applied to tokens only, not {sorted(kwargs)}")
    params = nnx.clone(self._params)
    nnx.replace_by_pure_dict(params, variables["params"])
    fp8 = nnx.clone(self._fp8)
    if FP8_COLLECTION in variables:
      nnx.replace_by_pure_dict(fp8, variables[FP8_COLLECTION])
    return nnx.merge(self.graphdef, params, fp8, self._rest)(tokens)


def describe_conversion(report: ConvertReport | None) -> Sequence[str]:
  """Lines for the run's start: how many GEMMs a builder's model runs in FP8 and which it
  keeps (none when nothing was converted)."""
  if report is None:
    return ()
  kept = ", ".join(report.kept) or "none"
  return (f"converted {len(report.converted)} GEMM layers to FP8; kept in high precision: "
          f"{kept}",)


__all__ = ["NnxModel", "RunModel", "UserModel", "load_builder", "describe_conversion"]
