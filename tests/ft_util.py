"""Helpers of the fault-tolerance tests: a tiny training config and subprocess plumbing."""
import os
import socket
import subprocess
import sys
import time
import warnings

import numpy as np
import orbax.checkpoint as ocp
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny_config(path, run_dir, **sections) -> str:
  """Writes a ~20k-parameter training config (a few seconds of CPU per run) to `path`."""
  cfg = {
      "model": {"vocab_size": 256, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64,
                "max_seq_len": 32},
      "data": {"seq_len": 32, "max_bytes": 200000},
      "train": {"steps": 40, "batch_size": 4, "learning_rate": 1e-3, "warmup_steps": 2,
                "eval_every": 0, "eval_batches": 1, "log_every": 1, "fp8_health_every": 0},
      "checkpoint": {"checkpoint_every_n_steps": 3, "auto_resume": True},
      "runtime": {"run_dir": str(run_dir), "heartbeat_interval": 60.0},
  }
  for section, values in sections.items():
    cfg.setdefault(section, {}).update(values)
  with open(path, "w") as f:
    yaml.safe_dump(cfg, f)
  return str(path)


def env(cache_dir=None, **extra) -> dict:
  """Environment of a child process: this checkout first on the path, CPU only, a shared
  persistent compilation cache (later children skip compiling)."""
  out = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  out.pop("XLA_FLAGS", None)
  if cache_dir is not None:
    out.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  out.update({k: str(v) for k, v in extra.items()})
  return out


def train_cmd(config: str) -> list:
  return [sys.executable, "-m", "fp8jax.cli", "train", "--config", config, "--no-progress"]


def losses(run_dir) -> list:
  """[(step, loss)] of metrics.jsonl, one record per step."""
  import json
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f if line.strip()]
  return [(r["step"], r["loss"]) for r in records if "loss" in r]


def wait_for_step(run_dir, step: int, proc, timeout: float = 120) -> int:
  """Polls metrics.jsonl until it records a step >= `step`; returns the newest step."""
  path = os.path.join(run_dir, "metrics.jsonl")
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    assert proc.poll() is None, f"trainer exited early with {proc.returncode}"
    if os.path.exists(path):
      with open(path) as f:
        steps = [int(line.split('"step": ')[1].split(",")[0]) for line in f
                 if '"loss"' in line and line.endswith("\n")]
      if steps and max(steps) >= step:
        return max(steps)
    time.sleep(0.02)
  raise TimeoutError(f"step {step} not reached in {timeout} s")


def saved_state(ckpt_dir, step: int) -> list:
  """The leaves (numpy, native dtypes) of checkpoint `step`'s state, in tree order."""
  import jax
  with warnings.catch_warnings():  # (read back where it was saved: its own shardings serve)
    warnings.filterwarnings("ignore", "Sharding info not provided when restoring")
    tree = ocp.PyTreeCheckpointer().restore(os.path.join(ckpt_dir, str(step), "state"))
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run_workers(worker: str, args, processes: int, timeout: float = 300) -> list[str]:
  """Runs tests/distributed/<worker> ARGS as `processes` local jax.distributed processes on
  127.0.0.1 (CPU, FP8JAX_* variables; the test helpers and the integration tests' modules on
  the path); returns their logs, asserting every one exited 0."""
  tests = os.path.join(ROOT, "tests")
  path = [ROOT, tests, os.path.join(tests, "integration")]
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(path),
         "JAX_PLATFORMS": "cpu", "FP8JAX_COORDINATOR": f"127.0.0.1:{free_port()}",
         "FP8JAX_NUM_PROCESSES": str(processes)}
  cmd = [sys.executable, os.path.join(tests, "distributed", worker), *map(str, args)]
  procs = [subprocess.Popen(cmd, env={**env, "FP8JAX_PROCESS_ID": str(i)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(processes)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout)[0])
  finally:
    for p in procs:
      p.kill()
  assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
  return logs


def run(cmd, timeout, **kw) -> subprocess.CompletedProcess:
  return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kw)
