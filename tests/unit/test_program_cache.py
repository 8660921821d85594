"""fp8jax.train.program_cache: traced programs kept with jax.export, loaded by a later run
instead of tracing again, and never reused for another key, shape or sharding."""
import os

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.train import program_cache
from fp8jax.train.program_cache import ProgramCache


def _fn(traces: list):
  """A jitted (state, x) -> (state, metrics) that counts its traces and donates its state."""

  def step(state, x):
    traces.append(1)
    w = state["w"] - 0.1 * jnp.tanh(x @ state["w"]).T @ x / x.shape[0]
    return {"w": w, "n": state["n"] + 1}, {"loss": jnp.mean((x @ w) ** 2)}
  return jax.jit(step, donate_argnums=0)


def _state(seed: int):
  rng = np.random.default_rng(seed)
  return {"w": jnp.asarray(rng.standard_normal((8, 8)), jnp.float32), "n": jnp.int32(0)}


def _x(seed: int, rows: int = 4):
  return jnp.asarray(np.random.default_rng(seed).standard_normal((rows, 8)), jnp.float32)


def _run(cache: ProgramCache, key: str, traces: list, seed: int, rows: int = 4):
  saved = cache.wrap(_fn(traces), key, donate_argnums=(0,))
  return jax.device_get(saved(_state(seed), _x(seed + 1, rows)))


def test_a_second_cache_loads_the_program_without_tracing(tmp_path):
  plain = jax.device_get(_fn([])(_state(3), _x(4)))
  traces = []
  first = _run(ProgramCache(str(tmp_path), "run"), "step", traces, 3)
  assert len(traces) == 1 and len(os.listdir(tmp_path)) == 2
  again = _run(ProgramCache(str(tmp_path), "run"), "step", traces, 3)
  assert len(traces) == 1  # loaded: the Python function did not run
  for got in (first, again):
    np.testing.assert_array_equal(got[0]["w"], plain[0]["w"])
    assert got[0]["n"] == 1 and got[1]["loss"] == plain[1]["loss"]


def test_another_key_or_shape_is_traced_again(tmp_path):
  traces = []
  _run(ProgramCache(str(tmp_path), "run"), "step", traces, 0)
  _run(ProgramCache(str(tmp_path), "other run"), "step", traces, 0)
  _run(ProgramCache(str(tmp_path), "run"), "another step", traces, 0)
  _run(ProgramCache(str(tmp_path), "run"), "step", traces, 0, rows=6)
  assert len(traces) == 4 and len(os.listdir(tmp_path)) == 8


def test_the_donated_state_is_donated(tmp_path):
  saved = ProgramCache(str(tmp_path), "run").wrap(_fn([]), "step", donate_argnums=(0,))
  state = _state(1)
  saved(state, _x(2))
  assert state["w"].is_deleted()


def test_a_damaged_file_is_traced_and_written_again(tmp_path):
  traces = []
  _run(ProgramCache(str(tmp_path), "run"), "step", traces, 5)
  for name in os.listdir(tmp_path):
    if name.endswith(program_cache.PROGRAM_SUFFIX):
      with open(tmp_path / name, "wb") as f:
        f.write(b"not a program")
  got = _run(ProgramCache(str(tmp_path), "run"), "step", traces, 5)
  assert len(traces) == 2
  np.testing.assert_array_equal(got[0]["w"], jax.device_get(_fn([])(_state(5), _x(6)))[0]["w"])
  _run(ProgramCache(str(tmp_path), "run"), "step", traces, 5)
  assert len(traces) == 2  # the rewritten file loads


def test_a_program_that_cannot_be_exported_runs_as_jit(tmp_path):
  seen = []

  def step(x):
    jax.debug.callback(lambda v: seen.append(float(v)), x.sum())  # host callbacks: no export
    return x * 2

  saved = ProgramCache(str(tmp_path), "run").wrap(jax.jit(step), "step")
  np.testing.assert_array_equal(saved(jnp.arange(3.0)), [0.0, 2.0, 4.0])
  jax.effects_barrier()
  assert seen == [3.0] and not [n for n in os.listdir(tmp_path) if not n.startswith(".")]


def test_the_environment_key_names_sources_versions_and_devices():
  key = program_cache.environment_key()
  assert len(key["source"]) == 64 and key["versions"]["jax"] == jax.__version__
  assert len(key["devices"]) == jax.device_count()
