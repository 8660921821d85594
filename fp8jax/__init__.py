"""fp8jax: FP8 training of large language models with JAX and Flax."""
from fp8jax.recipe import E4M3, E5M2, LEVELS, O0, O1, O2, O3, OptLevel, Recipe, opt_level
from fp8jax.scaling import Fp8Meta, combine_max, dequantize, init_meta, quantize
from fp8jax.dot import (Fp8DotMeta, fp8_dot_general, fp8_dot_general_chained, init_dot_meta,
                        native_fp8_reason)

__version__ = "0.1.0"
__all__ = [
    "E4M3", "E5M2", "LEVELS", "O0", "O1", "O2", "O3", "OptLevel", "Recipe", "opt_level",
    "Fp8Meta", "combine_max", "dequantize", "init_meta", "quantize",
    "Fp8DotMeta", "fp8_dot_general", "fp8_dot_general_chained", "init_dot_meta",
    "native_fp8_reason",
]
