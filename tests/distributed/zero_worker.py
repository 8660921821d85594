"""One process of a multi-process ZeRO-3 run (spawned by test_zero.py): joins the group from
the FP8JAX_* variables, trains the tiny decoder, process 0 saves the final parameters.

Usage: python tests/distributed/zero_worker.py SEED OUT.npy (2 CPU devices per process).
"""
import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402

from fp8jax import parallel  # noqa: E402
from fp8jax.train.step import build_step  # noqa: E402


def main(seed: int, out: str) -> None:
  assert parallel.initialize(initialization_timeout=120, heartbeat_timeout=60,
                             shutdown_timeout=60) == "env"
  import test_zero as tz  # the same model, optimizer, batches and steps
  model, tx, init = tz._setup()
  mesh = parallel.make_mesh()
  plan = parallel.plan(init(), mesh, 3, level=tz.LEVEL)
  state = plan.shard_state(init())
  step = build_step(model.apply, tx, plan, tz.MICROBATCHES)
  for batch in tz.batches(seed):
    state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))  # a replicated scalar reads on every process
  params = tz._flat(parallel.to_host(state.model_params()))
  if jax.process_index() == 0:
    np.save(out, params)
  print(f"process {jax.process_index()} of {jax.process_count()}: "
        f"{parallel.describe(mesh)}", flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), sys.argv[2])
