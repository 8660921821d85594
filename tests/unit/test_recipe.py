import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax import Recipe


def test_defaults_and_format_names():
  r = Recipe(fwd_format="e4m3", bwd_format="e5m2")
  assert np.dtype(r.fwd_format) == np.dtype(jnp.float8_e4m3fn)
  assert np.dtype(r.bwd_format) == np.dtype(jnp.float8_e5m2)
  assert r == Recipe()
  assert hash(r) == hash(Recipe())  # static argument of jit / custom_vjp


@pytest.mark.parametrize("field,value,allowed", [
    ("fwd_format", "e5m2", "float8_e4m3fn"),  # E5M2 forward would make dgrad E5M2 x E5M2
    ("fwd_format", jnp.bfloat16, "float8_e4m3fn"),
    ("bwd_format", "int8", "float8_e5m2"),
    ("amax_history_len", 0, ">= 1"),
    ("amax_history_len", 2.5, ">= 1"),
    ("amax_compute_algo", "mean", "'max', 'most_recent'"),
    ("margin", -1, ">= 0"),
    ("margin", float("nan"), ">= 0"),
    ("scaling", "dynamic", "'delayed', 'current'"),
    ("power_of_two_scales", "yes", "True or False"),
    ("bwd_fast_accumulation", 1, "True, False or \"dgrad\""),
    ("bwd_fast_accumulation", "wgrad", "True, False or \"dgrad\""),
    ("fused_cast_transpose", "true", "True or False"),
])
def test_invalid_values_name_field_and_allowed(field, value, allowed):
  with pytest.raises(ValueError) as e:
    Recipe(**{field: value})
  assert f"Recipe.{field}=" in str(e.value) and allowed in str(e.value)


def test_levels_follow_design_table():
  assert not fp8jax.O0.fp8_gemms and fp8jax.O0.master_dtype == jnp.float32
  assert fp8jax.O1.fp8_gemms and fp8jax.O1.mu_dtype == jnp.float32
  assert fp8jax.O2.master_dtype == jnp.float16 and fp8jax.O2.mu_dtype == jnp.float8_e4m3fn
  assert fp8jax.O2.nu_dtype == jnp.float16
  assert fp8jax.O3.zero_stage >= 1
  assert fp8jax.opt_level("o2") is fp8jax.O2
  with pytest.raises(ValueError, match="O4.*'O0', 'O1', 'O2', 'O3'"):
    fp8jax.opt_level("O4")
