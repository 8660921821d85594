"""fp8jax: FP8 training of large language models with JAX and Flax.

Submodules: ``fp8jax.linen`` (Flax linen layers), ``fp8jax.nnx`` (Flax NNX layers),
``fp8jax.scaling`` (per-tensor scaling), ``fp8jax.dot`` (the FP8 dot_general),
``fp8jax.convert`` (a Flax model's GEMM layers to FP8 in one call; the submodule is
``sys.modules["fp8jax.convert"]``, the name ``fp8jax.convert`` the function),
``fp8jax.optim`` (FP8/FP16-state optax optimizers, FP16 master weights), ``fp8jax.models``
(reference decoder), ``fp8jax.train`` (train step and Trainer).
"""
# Before anything can start an XLA backend: XLA reads XLA_FLAGS once, when it starts.
from fp8jax.xla_env import apply_xla_defaults as _apply_xla_defaults

_apply_xla_defaults()

from fp8jax.recipe import E4M3, E5M2, LEVELS, O0, O1, O2, O3, OptLevel, Recipe, opt_level
from fp8jax.scaling import Fp8Meta, combine_max, dequantize, init_meta, quantize
from fp8jax.dot import (Fp8DotMeta, fp8_dot_general, fp8_dot_general_chained, fp8_mlp_chained,
                        init_dot_meta, native_fp8_reason)
from fp8jax.einsum import einsum_to_dot_general, fp8_einsum
from fp8jax.accumulate import accumulate_gradients, mean_gradients
from fp8jax.linen import FP8_COLLECTION, apply_fp8_updates
from fp8jax.convert import ConvertReport, ConvertRules, convert
from fp8jax import optim

__version__ = "0.1.0"
__all__ = [
    "E4M3", "E5M2", "LEVELS", "O0", "O1", "O2", "O3", "OptLevel", "Recipe", "opt_level",
    "Fp8Meta", "combine_max", "dequantize", "init_meta", "quantize",
    "Fp8DotMeta", "fp8_dot_general", "fp8_dot_general_chained", "fp8_mlp_chained",
    "init_dot_meta",
    "native_fp8_reason", "einsum_to_dot_general", "fp8_einsum",
    "accumulate_gradients", "mean_gradients", "FP8_COLLECTION", "apply_fp8_updates", "optim",
    "convert", "ConvertRules", "ConvertReport",
]
