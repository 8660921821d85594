"""Optax transforms with FP8 / FP16 state, FP16 master weights and FP8 gradients (MS-AMP O2).

* :func:`scale_by_adam`, :func:`adam`, :func:`adamw`: optax's signatures plus ``mu_dtype``
  (E4M3) and ``nu_dtype`` (FP16); 3 bytes of state per parameter (docs/optim.md).
* :class:`ScaledArray`: payload + f32 per-tensor scale; :func:`quantize_scaled`,
  :func:`dequantize_scaled`.
* :class:`MasterWeights`: FP16 master weights (:func:`init_master`, :func:`master_params`,
  :func:`apply_master_updates`, stochastic rounding so small updates are not lost).
* FP8 gradients: :func:`quantize_updates`, :func:`dequantize_updates`.
* :func:`skip_not_finite`, :func:`all_finite`: a non-finite step is skipped as a whole.
"""
from fp8jax.optim.scaled import (ScaledArray, dequantize_scaled, is_scaled, payload_max,
                                 quantize_scaled)
from fp8jax.optim.moments import adam_moments
from fp8jax.optim.finite import all_finite, skip_not_finite
from fp8jax.optim.transforms import ScaleByAdamState, adam, adamw, scale_by_adam
from fp8jax.optim.grads import dequantize_tree, dequantize_updates, quantize_updates
from fp8jax.optim.master import (MasterWeights, apply_master_updates, init_master,
                                 master_params)
from fp8jax.optim.rounding import stochastic_round
from fp8jax.optim.memory import num_params, tree_bytes

__all__ = [
    "ScaledArray", "dequantize_scaled", "is_scaled", "payload_max", "quantize_scaled",
    "adam_moments", "all_finite", "skip_not_finite",
    "ScaleByAdamState", "adam", "adamw", "scale_by_adam",
    "dequantize_tree", "dequantize_updates", "quantize_updates",
    "MasterWeights", "apply_master_updates", "init_master", "master_params",
    "stochastic_round", "num_params", "tree_bytes",
]
