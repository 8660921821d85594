"""Test setup: 8 CPU devices (sharding tests), fresh random seeds reported on failure.

Tiers: ``unit/`` (one component against a reference), ``integration/`` (the train step and
the Trainer, on 8 simulated CPU devices), ``distributed/`` (several local processes under
``jax.distributed`` on 127.0.0.1, with their worker scripts), ``gpu/`` (sm_89+ only). The
helpers here (``ft_util``, ``hetero_model``) are importable from every tier."""
import os

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def key(request):
  """A fresh PRNG key per test; its seed is printed so a failure can be replayed
  (FP8JAX_TEST_SEED=<seed> pins it)."""
  seed = int(os.environ.get("FP8JAX_TEST_SEED", np.random.SeedSequence().entropy % (1 << 31)))
  print(f"{request.node.name}: seed {seed}")
  return jax.random.key(seed)


def rel_err(a, ref) -> float:
  """||a - ref|| / ||ref|| in float64; NaN never passes a `<` bound."""
  a = np.asarray(np.asarray(a, np.float32), np.float64)
  ref = np.asarray(np.asarray(ref, np.float32) if np.asarray(ref).dtype != np.float64 else ref,
                   np.float64)
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def primitive_eqns(jaxpr, primitive: str):
  """Every equation of `primitive` in `jaxpr` and its sub-jaxprs (scan, remat, custom_vjp
  bodies), in program order."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == primitive:
      yield eqn
    for p in eqn.params.values():
      for sub in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          yield from primitive_eqns(inner, primitive)
