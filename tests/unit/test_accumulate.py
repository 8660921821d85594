"""Microbatch accumulation: gradients equal the full batch's, FP8 state combines by max."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.accumulate import accumulate_gradients, mean_gradients
from fp8jax.linen import FP8_COLLECTION, Fp8DotGeneral


def test_microbatches_sum_params_and_max_fp8_state(key):
  k1, k2 = jax.random.split(key)
  layer = nn.Dense(16, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe()))
  # Four microbatches of very different magnitude.
  xs = jax.random.normal(k1, (4, 8, 32)) * jnp.array([1.0, 30.0, 0.1, 5.0])[:, None, None]
  variables = layer.init(k2, xs[0])
  grad = jax.jit(jax.grad(lambda v, x: jnp.mean(layer.apply(v, x) ** 2)))

  acc = None
  for x in xs:
    acc = accumulate_gradients(acc, grad(variables, x))
  acc = mean_gradients(acc, len(xs))

  # Parameters: the mean of the microbatch gradients (sum, then divide).
  want = jax.tree.map(lambda *g: sum(g) / len(g), *[grad(variables, x)["params"] for x in xs])
  for a, b in zip(jax.tree.leaves(acc["params"]), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  # FP8 state: the update of the largest amax, never a sum or a mean.
  meta = acc[FP8_COLLECTION]["Fp8DotGeneral_0"]
  assert float(meta["input"].amax_history[0]) == float(jnp.max(jnp.abs(xs)))
  assert float(meta["input"].scale) == pytest.approx(float(jnp.max(jnp.abs(xs))) / 448.0, rel=1e-6)
  assert not np.asarray(meta["input"].amax_history[1:]).any()


def test_mean_gradients_rejects_bad_count():
  with pytest.raises(ValueError, match="count=0"):
    mean_gradients({"w": jnp.ones(2)}, 0)
