"""Reference models written against fp8jax's public API only: the GPT and LLaMA families
(:mod:`fp8jax.models.family` names them for a trainer)."""
from fp8jax.models.family import FAMILIES, Family, family, family_of
from fp8jax.models.gpt import (GPT, ModelConfig, flops_per_token, init_model,
                               matmul_param_count)
from fp8jax.models.llama import LLAMA_RULES, Llama, Llama3RopeScaling, LlamaConfig
from fp8jax.models.stack_parts import StackParts

__all__ = ["FAMILIES", "Family", "GPT", "LLAMA_RULES", "Llama", "Llama3RopeScaling",
           "LlamaConfig", "ModelConfig", "StackParts", "family", "family_of", "flops_per_token",
           "init_model", "matmul_param_count"]
