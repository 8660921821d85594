"""FP8 state under data parallelism on 8 CPU devices: every device computes the same scale."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fp8jax
from fp8jax.linen import FP8_COLLECTION, Fp8DotGeneral

DN = (((1,), (0,)), ((), ()))


def _mesh():
  assert jax.device_count() == 8
  return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))


def _batch(key):
  # Rows scaled so each device's shard has a different amax.
  return jax.random.normal(key, (64, 32)) * jnp.repeat(jnp.arange(1.0, 9.0), 8)[:, None]


def test_jit_with_sharded_inputs_gives_identical_state_on_every_device(key):
  mesh = _mesh()
  x = _batch(key)
  layer = nn.Dense(16, dot_general_cls=functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe()))
  variables = layer.init(jax.random.key(0), x)
  grad = jax.jit(jax.grad(lambda v, x: jnp.sum(layer.apply(v, x) ** 2)))
  reference = grad(variables, x)[FP8_COLLECTION]
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    sharded = grad(variables, xs)[FP8_COLLECTION]
  for ref, got in zip(jax.tree.leaves(reference), jax.tree.leaves(sharded)):
    shards = [np.asarray(s.data) for s in got.addressable_shards]
    assert len(shards) == 8 or got.sharding.is_fully_replicated
    for s in shards:
      np.testing.assert_array_equal(s, np.asarray(ref))
  hist = sharded["Fp8DotGeneral_0"]["input"].amax_history
  assert float(hist[0]) == float(jnp.max(jnp.abs(x)))


def _per_device_meta(mesh, x, w, amax_axes):
  def local(x, w):
    new = jax.grad(lambda m: jnp.sum(
        fp8jax.fp8_dot_general(x, w, DN, m, amax_axes=amax_axes) ** 2))(fp8jax.init_dot_meta())
    return jax.tree.map(lambda a: a[None], new)
  return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(x, w)


def test_shard_map_amax_axes_agree_state_across_devices(key):
  mesh = _mesh()
  k1, k2 = jax.random.split(key)
  x = jax.device_put(_batch(k1), NamedSharding(mesh, P("data")))
  w = jax.device_put(jax.random.normal(k2, (32, 16)), NamedSharding(mesh, P()))
  agreed = _per_device_meta(mesh, x, w, ("data",))
  for leaf in jax.tree.leaves(agreed):
    rows = np.asarray(leaf)
    assert (rows == rows[0]).all()
  assert float(np.asarray(agreed.input.amax_history)[0, 0]) == float(jnp.max(jnp.abs(x)))
  # Without the pmax each device would choose its own scale: refused with the fix in the error.
  with pytest.raises(ValueError, match=r"vary over mesh axes \['data'\].*amax_axes=\('data',\)"):
    _per_device_meta(mesh, x, w, ())
