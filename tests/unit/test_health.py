"""The FP8 cast-health probe sees saturation and flushing where they happen."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.models.gpt import GPT, ModelConfig
from fp8jax.scaling import Fp8Meta, cast_health
from fp8jax.train.health import fp8_cast_health

RECIPE = fp8jax.Recipe()


def test_cast_health_counts_saturated_and_flushed(key):
  x = jax.random.normal(key, (4096,))
  amax = float(jnp.max(jnp.abs(x)))
  sat, flushed = cast_health(x, jnp.float32(amax / 448), jnp.float8_e4m3fn)
  assert float(sat) == 0.0 and float(flushed) < 1e-3
  sat, _ = cast_health(x * 100, jnp.float32(amax / 448), jnp.float8_e4m3fn)
  assert 0.9 < float(sat) < 1.0
  _, flushed = cast_health(x * 1e-6, jnp.float32(amax / 448), jnp.float8_e4m3fn)
  assert float(flushed) > 0.99


@pytest.fixture(scope="module")
def model_and_variables():
  cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=32)
  model = GPT(cfg, RECIPE)
  batch = jax.random.randint(jax.random.key(0), (4, 33), 0, 256)
  variables = model.init(jax.random.key(1), batch[:, :-1])
  # One gradient step's worth of FP8 state, so delayed scales are in use.
  grads = jax.grad(lambda v: jnp.mean(model.apply(v, batch[:, :-1])))(variables)
  variables = fp8jax.apply_fp8_updates(variables, grads)
  probe = jax.jit(functools.partial(fp8_cast_health, model, recipe=RECIPE))
  return variables, batch, probe


def _with_role_scale(variables, role, scale):
  def set_scale(m):
    return {**m, role: Fp8Meta(jnp.full_like(m[role].scale, scale), m[role].amax_history)}
  fp8 = jax.tree.map(set_scale, variables[fp8jax.FP8_COLLECTION],
                     is_leaf=lambda x: isinstance(x, dict) and role in x)
  return {**variables, fp8jax.FP8_COLLECTION: fp8}


def test_probe_is_clean_with_warm_scales(model_and_variables):
  variables, batch, probe = model_and_variables
  h = {k: float(v) for k, v in probe(variables, batch).items()}
  assert set(h) == {f"fp8/{r}/{k}" for r in ("input", "kernel", "output_grad")
                    for k in ("saturated", "flushed")}
  assert all(0 <= v <= 1 for v in h.values())
  assert h["fp8/input/saturated"] < 0.01 and h["fp8/kernel/saturated"] < 0.01


@pytest.mark.parametrize("role,scale,kind", [
    ("input", 1e-6, "saturated"), ("output_grad", 1e-20, "saturated"),
    ("output_grad", 1e3, "flushed"), ("kernel", 1e3, "flushed"),
])
def test_probe_sees_bad_scales(model_and_variables, role, scale, kind):
  variables, batch, probe = model_and_variables
  h = probe(_with_role_scale(variables, role, scale), batch)
  assert float(h[f"fp8/{role}/{kind}"]) > 0.5
  assert np.isfinite(float(h[f"fp8/{role}/{kind}"]))


def test_probe_follows_current_scaling_for_output_gradients(model_and_variables):
  # Under current scaling the backward cast ignores the stored scale: a stale one must not
  # be reported as saturating.
  variables, batch, _ = model_and_variables
  cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, d_ff=128, max_seq_len=32)
  current = fp8jax.Recipe(scaling="current")
  probe = jax.jit(functools.partial(fp8_cast_health, GPT(cfg, current), recipe=current))
  h = probe(_with_role_scale(variables, "output_grad", 1e-20), batch)
  assert float(h["fp8/output_grad/saturated"]) < 0.01
