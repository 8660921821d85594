"""The model, batches and optimizer shared by test_hetero.py and its 2-process worker."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import fp8jax
from fp8jax.linen import FP8_COLLECTION, Fp8DotGeneral
from fp8jax.train import TrainState

MICROBATCH = 2  # sequences per microbatch in the numerical tests
TIMING_MICROBATCH = 8


class _LM(nn.Module):
  fp8: bool = True
  width: int = 64
  embed: int = 32

  @nn.compact
  def __call__(self, tokens):
    kw = {"dot_general_cls": functools.partial(Fp8DotGeneral, recipe=fp8jax.Recipe())} \
        if self.fp8 else {}
    h = nn.Embed(256, self.embed)(tokens)
    h = nn.gelu(nn.Dense(self.width, **kw)(h))
    h = nn.gelu(nn.Dense(self.width, **kw)(h))
    return nn.Dense(256, **kw)(h)


def _state(model, tx, batch, seed=0):
  v = model.init(jax.random.key(seed), batch[:, :-1])
  return TrainState(jnp.zeros((), jnp.int32), v["params"], v.get(FP8_COLLECTION, {}),
                    tx.init(v["params"]))


def setup(fp8: bool = True, sequences: int = 8, seed: int = 0):
  """Model, SGD(1), state, batch int32[sequences, 17] (deterministic: the 2-process worker
  rebuilds exactly these)."""
  model, tx = _LM(fp8), optax.sgd(1.0)
  batch = np.random.default_rng(seed).integers(0, 256, (sequences, 17), dtype=np.int32)
  return model, tx, _state(model, tx, batch), batch


def setup_timing():
  """A larger model for step timing: microbatches of 8 x 128 tokens."""
  model = _LM(True, width=1024, embed=256)
  batch = np.random.default_rng(1).integers(0, 256, (4 * TIMING_MICROBATCH, 129),
                                            dtype=np.int32)
  return model, _state(model, optax.sgd(1.0), batch), batch
