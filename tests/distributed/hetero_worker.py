"""One process of a 2-process heterogeneous-mesh run (spawned by test_hetero.py and
benchmarks/hetero/balance_cpu.py); 1 CPU device per process, joined through the FP8JAX_* variables.

  python tests/distributed/hetero_worker.py OUT_DIR COUNTS REPEATS [TIMING_STEPS]

* capability: process 0 plays an A100 (sm 8.0), process 1 an H100 (sm 9.0); each writes the
  agreed plan to OUT_DIR/plan_<process>.json.
* balanced step: COUNTS (e.g. "1,3") microbatches per process on the FP8 test model, one
  SGD(1) step; process 0 writes the new parameters and FP8 state to OUT_DIR/step.npz.
* timing (TIMING_STEPS > 0): REPEATS (e.g. "2,0") extra forward+backward passes per
  microbatch slow process 0 down (``benchmarks.common.slowdown``); median step seconds for
  several splits of 4 microbatches go to OUT_DIR/timing.json (process 0).
"""
import json
import os
import sys
import time

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402

from fp8jax import hardware, parallel  # noqa: E402
from fp8jax.parallel import capability  # noqa: E402
from fp8jax.parallel import layout  # noqa: E402
from fp8jax.train.step import GroupLoop, make_train_step  # noqa: E402

FAKE = {0: ("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), 1: ("gpu", "NVIDIA H100 80GB HBM3", "9.0")}


def _timed(step, state, batch, counts, steps: int) -> float:
  jax.block_until_ready(step(state, batch, counts))
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    jax.block_until_ready(step(state, batch, counts))
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def main(out_dir: str, counts: str, repeats: str, timing_steps: int = 0) -> None:
  assert parallel.initialize(initialization_timeout=120, heartbeat_timeout=60,
                             shutdown_timeout=60) == "env"
  me = jax.process_index()
  platform, kind, cc = FAKE[me]
  plan = capability.agree("per_kind", hardware.DeviceReport(me, platform, kind, cc, 1))
  with open(os.path.join(out_dir, f"plan_{me}.json"), "w") as f:
    json.dump(plan._asdict(), f)
  hardware.install_plan(None)  # the CPU devices run the emulated path either way

  import hetero_model as th  # the same model, batch and optimizer as the test's reference
  model, tx, state, batch = th.setup()
  mesh = parallel.make_mesh()
  sharding = layout.batch_sharding(mesh)
  put = lambda x: layout.put_global(np.asarray(x), sharding)
  step = jax.jit(make_train_step(model.apply, tx, groups=GroupLoop(mesh)))
  counts = [int(c) for c in counts.split(",")]
  new, metrics = step(state, put(layout.layout_counts(batch, counts, th.MICROBATCH)),
                      put(np.asarray(counts, np.int32)))
  host = parallel.to_host((new.params, new.fp8, metrics["loss"]))
  if me == 0:
    np.savez(os.path.join(out_dir, "step.npz"),
             *[np.asarray(x) for x in jax.tree.leaves(host)])
  if timing_steps:
    from benchmarks.common.slowdown import slowed_apply
    big_model, big_state, big_batch = th.setup_timing()
    loop = GroupLoop(mesh)
    slow = slowed_apply(big_model.apply, [int(r) for r in repeats.split(",")], loop.axes)
    big = jax.jit(make_train_step(slow, tx, groups=loop))
    results = {}
    for split in ("1,0", "3,0", "0,1", "0,3", "2,2", "1,3"):
      c = [int(x) for x in split.split(",")]
      rows = big_batch[:sum(c) * th.TIMING_MICROBATCH]
      results[split] = _timed(big, big_state,
                              put(layout.layout_counts(rows, c, th.TIMING_MICROBATCH)),
                              put(np.asarray(c, np.int32)), timing_steps)
    if me == 0:
      with open(os.path.join(out_dir, "timing.json"), "w") as f:
        json.dump(results, f)
  print(f"process {me} of {jax.process_count()}: {parallel.describe(mesh)}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else 0)
