"""A jax.distributed job for the launcher tests: N processes all-gather a counter each step;
process 0 keeps the step reached in state.json (the checkpoint); on attempt 0 process 1 kills
itself with SIGKILL at step `kill_at` (-1: never).

Usage: launch_worker.py OUT_DIR STEPS HEARTBEAT_TIMEOUT_S KILL_AT
"""
import json, os, signal, sys, time
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
from fp8jax import parallel
out, steps, hb, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
assert parallel.initialize(heartbeat_timeout=hb, shutdown_timeout=5) == "env"
import numpy as np
from jax.experimental import multihost_utils
pid, attempt = jax.process_index(), int(os.environ["FP8JAX_RESTART"])
state_file = os.path.join(out, "state.json")  # the "checkpoint", written by process 0
start = json.load(open(state_file))["step"] if os.path.exists(state_file) else 0
with open(os.path.join(out, f"proc{pid}.attempt{attempt}"), "w") as f:
  json.dump({"os_pid": os.getpid(), "start": start}, f)
for step in range(start, steps):
  got = multihost_utils.process_allgather(np.int32(step + pid))
  assert got.sum() == 2 * step + 1, got
  if pid == 0:
    with open(state_file + ".tmp", "w") as f:
      json.dump({"step": step + 1}, f)
    os.replace(state_file + ".tmp", state_file)
  if attempt == 0 and pid == 1 and step == kill_at:
    print(f"killing process 1 at step {step}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
  time.sleep(0.05)
print(f"process {pid} finished {steps} steps (started at {start})", flush=True)
