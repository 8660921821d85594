"""fp8jax.parallel.initialize: where the process group comes from, and clear errors."""
import pytest

from fp8jax.parallel import distributed

ENV = ("FP8JAX_COORDINATOR", "FP8JAX_NUM_PROCESSES", "FP8JAX_PROCESS_ID")


@pytest.fixture
def clean_env(monkeypatch):
  for name in ENV:
    monkeypatch.delenv(name, raising=False)
  return monkeypatch


def test_env_process_group_is_read(clean_env):
  assert distributed.env_process_group() is None
  clean_env.setenv("FP8JAX_COORDINATOR", "10.0.0.1:1234")
  clean_env.setenv("FP8JAX_NUM_PROCESSES", "4")
  clean_env.setenv("FP8JAX_PROCESS_ID", "3")
  assert distributed.env_process_group() == ("10.0.0.1:1234", 4, 3)


@pytest.mark.parametrize("env, message", [
    ({"FP8JAX_COORDINATOR": "h:1"}, r"FP8JAX_NUM_PROCESSES, FP8JAX_PROCESS_ID is not; set all"),
    ({"FP8JAX_COORDINATOR": "nohost", "FP8JAX_NUM_PROCESSES": "2", "FP8JAX_PROCESS_ID": "0"},
     r"FP8JAX_COORDINATOR='nohost' is not allowed; use host:port"),
    ({"FP8JAX_COORDINATOR": "h:1", "FP8JAX_NUM_PROCESSES": "two", "FP8JAX_PROCESS_ID": "0"},
     r"FP8JAX_NUM_PROCESSES='two' is not allowed; use an integer >= 1"),
    ({"FP8JAX_COORDINATOR": "h:1", "FP8JAX_NUM_PROCESSES": "2", "FP8JAX_PROCESS_ID": "2"},
     r"FP8JAX_PROCESS_ID=2 is not allowed with FP8JAX_NUM_PROCESSES=2; use 0..1"),
])
def test_bad_env_is_refused(clean_env, env, message):
  for k, v in env.items():
    clean_env.setenv(k, v)
  with pytest.raises(ValueError, match=message):
    distributed.env_process_group()


def test_bad_arguments_are_refused(clean_env):
  with pytest.raises(ValueError, match=r"initialization_timeout=0 is not allowed; use whole "):
    distributed.initialize(initialization_timeout=0)
  with pytest.raises(ValueError, match=r"coordinator_address='localhost' is not allowed"):
    distributed.initialize("localhost", 2, 0)


def test_no_group_no_cluster_is_single_process(clean_env):
  for name in distributed.CLUSTER_MARKERS:
    clean_env.delenv(name, raising=False)
  assert distributed.cluster_marker() is None
  assert distributed.initialize() == "single"
  clean_env.setenv("SLURM_JOB_ID", "123")
  assert distributed.cluster_marker() == "SLURM_JOB_ID"
