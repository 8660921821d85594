"""Test setup: 8 CPU devices (sharding tests), fresh random seeds reported on failure.

Tiers: ``unit/`` (one component against a reference), ``integration/`` (the train step and
the Trainer, on 8 simulated CPU devices), ``distributed/`` (several local processes under
``jax.distributed`` on 127.0.0.1, with their worker scripts), ``gpu/`` (sm_89+ only). The
helpers here (``ft_util``, ``hetero_model``, ``numerics``) are importable from every tier."""
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

jax.config.update("jax_num_cpu_devices", 8)

# On CPU-only machines (CI), XLA's backend (LLVM) optimizes at level 0: the tests compile
# hundreds of small programs and run each for a few steps, so LLVM's optimizations cost more
# time than they save (the whole suite: 31.8 -> 25.3 min on 2 cores). Set before the first
# backend starts and inherited by subprocesses (ft_util.env drops it for CLI and
# distributed children); a level the user chose in XLA_FLAGS is kept. Tests marked
# `default_codegen` (bit-identity of two differently structured programs, e.g. with and
# without remat, which holds with XLA's default code generation, not at level 0) and
# execution-heavy notebooks run in a child process with XLA's default flags.
_FAST_CODEGEN_FLAG = "--xla_backend_optimization_level=0"
# Set when this file added the flag, so pytest-xdist's workers (which inherit the session's
# environment) tell it from a level the user chose.
_FAST_CODEGEN_ENV = "FP8JAX_TEST_FAST_CODEGEN"
_FLAG_INHERITED = os.environ.get(_FAST_CODEGEN_ENV) == "1"
FAST_CODEGEN = _FLAG_INHERITED or (
    shutil.which("nvidia-smi") is None
    and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", "")
    and not os.environ.get("FP8JAX_TEST_DEFAULT_CODEGEN"))
if FAST_CODEGEN and not _FLAG_INHERITED:
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_CODEGEN_FLAG).strip()
  os.environ[_FAST_CODEGEN_ENV] = "1"


def default_codegen_env() -> dict:
  """``os.environ`` for a child process that compiles with XLA's default code generation."""
  env = dict(os.environ, FP8JAX_TEST_DEFAULT_CODEGEN="1")
  env.pop(_FAST_CODEGEN_ENV, None)
  if not FAST_CODEGEN:  # the flags are the user's (or a GPU machine's): left as they are
    return env
  flags = env.get("XLA_FLAGS", "").replace(_FAST_CODEGEN_FLAG, "").strip()
  if flags:
    env["XLA_FLAGS"] = flags
  else:
    env.pop("XLA_FLAGS", None)
  return env


# `xla_cpu_scheduler` tests compare compiled CPU memory with fp8jax's memory model, whose
# numbers were fitted with XLA's concurrency-optimized CPU scheduler; `import fp8jax` turns
# that scheduler off (fp8jax.xla_env: a collective-order deadlock), so they run in a child
# pytest with it on.
_CPU_SCHEDULER_ON = "--xla_cpu_enable_concurrency_optimized_scheduler=true"
_CHILD_ENV = "FP8JAX_TEST_CHILD"


def cpu_scheduler_env() -> dict:
  """``os.environ`` for a child process that compiles with XLA's concurrency-optimized CPU
  scheduler (the rest of the session's flags kept)."""
  return dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " "
                                     + _CPU_SCHEDULER_ON).strip(), **{_CHILD_ENV: "1"})


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  """Runs a `default_codegen` test in a child pytest with XLA's default flags, and an
  `xla_cpu_scheduler` test in one with XLA's CPU scheduler on (see above)."""
  if FAST_CODEGEN and pyfuncitem.get_closest_marker("default_codegen"):
    env, what = default_codegen_env(), "XLA's default code generation"
  elif (pyfuncitem.get_closest_marker("xla_cpu_scheduler") and not os.environ.get(_CHILD_ENV)
        and shutil.which("nvidia-smi") is None):
    env, what = cpu_scheduler_env(), "XLA's concurrency-optimized CPU scheduler"
  else:
    return None
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                      pyfuncitem.nodeid], cwd=str(pyfuncitem.config.rootpath),
                     env=env, capture_output=True, text=True, timeout=900)
  print(r.stdout[-3000:])
  if r.returncode != 0:
    pytest.fail(f"{pyfuncitem.nodeid} failed in a child process with {what}:"
                f"\n{r.stdout[-8000:]}\n{r.stderr[-2000:]}", pytrace=False)
  return True


# One compilation cache for the session, shared with pytest-xdist's workers (`-n 2`: they
# inherit this process's environment) and the subprocesses tests start (workers under
# jax.distributed, the CLI): tests build many programs whose HLO is identical (the same
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


def assert_same_quantized_math(values, ref_values, fp8_state=(), ref_fp8_state=()):
  """Two runs of the same FP8 math: every array of `values` equals `ref_values`' up to a rare
  flipped FP8 rounding (XLA and a kernel may contract f32 arithmetic differently: under 2% of
  elements differ, each within 10% or 2% of the largest), and the FP8 scales and amaxes
  agree to 1%."""
  for u, v in zip(jax.tree.leaves(values), jax.tree.leaves(ref_values), strict=True):
    u, v = np.asarray(u, np.float32), np.asarray(v, np.float32)
    assert np.mean(u != v) < 2e-2
    np.testing.assert_allclose(u, v, rtol=0.1, atol=0.02 * float(np.max(np.abs(v))))
  for u, v in zip(jax.tree.leaves(fp8_state), jax.tree.leaves(ref_fp8_state), strict=True):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-2)


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
