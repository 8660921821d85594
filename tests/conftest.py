"""Test setup: 8 CPU devices (sharding tests), fresh random seeds reported on failure.

Tiers: ``unit/`` (one component against a reference), ``integration/`` (the train step and
the Trainer, on 8 simulated CPU devices), ``distributed/`` (several local processes under
``jax.distributed`` on 127.0.0.1, with their worker scripts), ``gpu/`` (sm_89+ only). The
helpers here (``ft_util``, ``hetero_model``) are importable from every tier."""
import os
import shutil
import tempfile

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)

# On CPU-only machines (CI), XLA's backend (LLVM) optimizes at level 0: the tests compile
# hundreds of small programs and run each for a few steps, so LLVM's optimizations cost more
# time than they save (measured: the Trainer bit-identity files 210 -> 154 s). Set before
# the first backend starts; inherited by the subprocesses tests start; a level the user
# chose in XLA_FLAGS is kept.
if shutil.which("nvidia-smi") is None and "xla_backend_optimization_level" not in \
    os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_backend_optimization_level=0").strip()

# One compilation cache for the session, shared with the subprocesses tests start (workers
# under jax.distributed, the CLI): tests build many programs whose HLO is identical (the same
# tiny model's step in several tests and processes), and XLA compiles each once. A cache the
# user set (JAX_COMPILATION_CACHE_DIR) is used as it is; otherwise a fresh folder, deleted
# at the end of the session, so nothing carries over between sessions.
_OWN_CACHE = None
if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
  _OWN_CACHE = tempfile.mkdtemp(prefix="fp8jax-test-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                  int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


def pytest_sessionfinish(session, exitstatus):
  if _OWN_CACHE:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


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
