"""The model families by name: one interface a trainer uses without knowing the family.

``FAMILIES["gpt"]`` and ``FAMILIES["llama"]`` are :class:`Family` records; :func:`family` looks
one up by name, :func:`family_of` by a config instance. Both families share the parameter
layout of :mod:`fp8jax.models.layers` (stacked ``layers``, ``embed``, ``head``, ...), are
applied as ``model.apply(variables, tokens int[B, T]) -> logits f32[B, T, V]``, and are
built by ``module(config, recipe)`` (recipe None: BF16 GEMMs).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fp8jax.models import gpt, llama
from fp8jax.parallel.layout_rules import tensor_message
from fp8jax.parallel.tensor import GPT_RULES, Rule


@dataclasses.dataclass(frozen=True)
class Family:
  """One model family.

  Attributes:
    name: the family's name ("gpt", "llama").
    config_cls: its frozen config dataclass (validates on construction).
    module_cls: the Flax module, ``module_cls(config, recipe)``.
    init_model: ``(config, recipe, key, batch_size, seq_len) -> variables`` (jitted).
    flops_per_token: ``(config, seq_len) -> float``: training FLOPs per token, for MFU.
    matmul_param_count: ``config -> int``: weights taking part in a GEMM per token.
    tensor_rules: tensor-parallel rules (``fp8jax.parallel.plan(..., tensor_rules=)``).
    tensor_splits: ``config -> ((config key, size), ...)``: the sizes its tensor rules split
      over "tensor" (each must divide by the tensor size:
      ``fp8jax.parallel.layout_rules``).
  """

  name: str
  config_cls: type
  module_cls: type
  init_model: Callable[..., dict]
  flops_per_token: Callable[[Any, int], float]
  matmul_param_count: Callable[[Any], int]
  tensor_rules: tuple[Rule, ...]
  tensor_splits: Callable[[Any], tuple[tuple[str, int], ...]]

  def check_tensor_parallel(self, config, tensor: int) -> None:
    """ValueError (naming the ``model.*`` key) when `config` does not split `tensor` ways."""
    message = tensor_message(self.tensor_splits(config), tensor)
    if message:
      raise ValueError(message)

  def model(self, config, recipe=None):
    """``module_cls(config, recipe)``, after checking `config` is this family's."""
    if not isinstance(config, self.config_cls):
      raise ValueError(f"model family {self.name!r} takes a {self.config_cls.__name__}, got "
                       f"{type(config).__name__}")
    return self.module_cls(config, recipe)


def _gpt_tensor_splits(config: gpt.ModelConfig) -> tuple[tuple[str, int], ...]:
  """GPT's tensor rules split the attention heads and the MLP width."""
  return (("model.n_heads", config.n_heads), ("model.d_ff", config.d_ff))


FAMILIES: dict[str, Family] = {
    "gpt": Family("gpt", gpt.ModelConfig, gpt.GPT, gpt.init_model, gpt.flops_per_token,
                  gpt.matmul_param_count, GPT_RULES, _gpt_tensor_splits),
    "llama": Family("llama", llama.LlamaConfig, llama.Llama, llama.init_model,
                    llama.flops_per_token, llama.matmul_param_count,
                    llama.LLAMA_RULES, llama.tensor_splits),
}


def family(name: str) -> Family:
  """The family called `name`; ValueError naming the known ones otherwise."""
  if name not in FAMILIES:
    raise ValueError(f"model family {name!r} is not known; use one of {list(FAMILIES)}")
  return FAMILIES[name]


def family_of(config) -> Family:
  """The family whose config class `config` is an instance of."""
  for fam in FAMILIES.values():
    if isinstance(config, fam.config_cls):
      return fam
  raise ValueError(f"{type(config).__name__} is not the config of a known model family; use "
                   f"one of {[f.config_cls.__name__ for f in FAMILIES.values()]}")
