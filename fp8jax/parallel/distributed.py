"""Multi-process start-up: ``initialize()`` wraps ``jax.distributed.initialize``.

Where the process group comes from, first match wins:

1. explicit arguments (coordinator "host:port", number of processes, this process's id);
2. the environment ``fp8jax launch`` sets: FP8JAX_COORDINATOR (host:port),
   FP8JAX_NUM_PROCESSES, FP8JAX_PROCESS_ID;
3. a cluster environment (one of :data:`CLUSTER_MARKERS` is set: SLURM, Open MPI, TPU
   pods, ``JAX_COORDINATOR_ADDRESS``): ``jax.distributed``'s own auto-detection;
4. none of these: a single process (nothing is started, jax is not touched).

Call it before anything touches the devices. Timeouts are explicit (seconds). On CPU the
cross-process collectives use gloo.
"""
from __future__ import annotations

import inspect
import logging
import os

import jax

logger = logging.getLogger("fp8jax")

ENV_COORDINATOR = "FP8JAX_COORDINATOR"
ENV_NUM_PROCESSES = "FP8JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FP8JAX_PROCESS_ID"
CLUSTER_MARKERS = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES",
                   "MEGASCALE_COORDINATOR_ADDRESS", "JAX_COORDINATOR_ADDRESS")


def cluster_marker() -> str | None:
  """The first of :data:`CLUSTER_MARKERS` set in the environment, else None."""
  return next((name for name in CLUSTER_MARKERS if os.environ.get(name)), None)


def _int_env(name: str, lo: int) -> int:
  text = os.environ[name]
  try:
    value = int(text)
  except ValueError:
    value = None
  if value is None or value < lo:
    raise ValueError(f"{name}={text!r} is not allowed; use an integer >= {lo}")
  return value


def _check_address(where: str, address) -> str:
  host, sep, port = str(address).rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(f"{where}={address!r} is not allowed; use host:port, e.g. 10.0.0.1:1234")
  return str(address)


def env_process_group() -> tuple[str, int, int] | None:
  """(coordinator, num_processes, process_id) from the FP8JAX_* variables, or None if
  FP8JAX_COORDINATOR is unset; ValueError when they are incomplete or malformed."""
  if not os.environ.get(ENV_COORDINATOR):
    return None
  missing = [n for n in (ENV_NUM_PROCESSES, ENV_PROCESS_ID) if n not in os.environ]
  if missing:
    raise ValueError(f"{ENV_COORDINATOR} is set but {', '.join(missing)} is not; set all of "
                     f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}")
  address = _check_address(ENV_COORDINATOR, os.environ[ENV_COORDINATOR])
  n, pid = _int_env(ENV_NUM_PROCESSES, 1), _int_env(ENV_PROCESS_ID, 0)
  if pid >= n:
    raise ValueError(f"{ENV_PROCESS_ID}={pid} is not allowed with {ENV_NUM_PROCESSES}={n}; "
                     f"use 0..{n - 1}")
  return address, n, pid


def _timeouts(initialization_timeout: int, heartbeat_timeout: int, shutdown_timeout: int):
  """The timeout keywords the installed jax.distributed.initialize accepts."""
  wanted = {"initialization_timeout": initialization_timeout,
            "heartbeat_timeout_seconds": heartbeat_timeout,
            "shutdown_timeout_seconds": shutdown_timeout}
  accepted = inspect.signature(jax.distributed.initialize).parameters
  for name, value in wanted.items():
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"initialize: {name}={value!r} is not allowed; use whole seconds >= 1")
  return {k: v for k, v in wanted.items() if k in accepted}


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, local_device_ids=None,
               initialization_timeout: int = 300, heartbeat_timeout: int = 100,
               shutdown_timeout: int = 300) -> str:
  """Joins (or skips) the multi-process group; returns how: "explicit", "env", "cluster"
  or "single". Calling it again after success returns "initialized" and does nothing.

  Args:
    coordinator_address: "host:port" of process 0's coordinator service.
    num_processes: processes in the run.
    process_id: this process's index, 0..num_processes-1.
    local_device_ids: this process's devices (default: all it sees).
    initialization_timeout: seconds to wait for every process to connect.
    heartbeat_timeout: seconds without a heartbeat before a process counts as dead.
    shutdown_timeout: seconds to wait for every process at shutdown.
  """
  if jax.distributed.is_initialized():
    return "initialized"
  kw = _timeouts(initialization_timeout, heartbeat_timeout, shutdown_timeout)
  if local_device_ids is not None:
    kw["local_device_ids"] = local_device_ids
  if not jax.config.jax_cpu_collectives_implementation:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  explicit = (coordinator_address, num_processes, process_id)
  if any(v is not None for v in explicit):
    if coordinator_address is not None:
      _check_address("coordinator_address", coordinator_address)
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kw)
    how = "explicit"
  elif (group := env_process_group()) is not None:
    jax.distributed.initialize(*group, **kw)
    how = "env"
  elif cluster_marker() is not None:
    jax.distributed.initialize(**kw)  # jax's own cluster detection fills in the rest
    how = "cluster"
  else:
    return "single"
  logger.info("fp8jax.parallel.initialize (%s): process %d of %d", how, jax.process_index(),
              jax.process_count())
  return how
