"""One process of a 2-process FP8 calibration pass (spawned by test_calibration_processes.py):
joins the group from the FP8JAX_* variables (1 CPU device per process: data parallel over the
processes), builds the Trainer of the test's config, runs the calibration pass on the first
step's batch, then that step. Each process writes its own copy of the replicated FP8 state
(``addressable_data(0)``: no collective) to OUT_DIR/fp8_<process>.npz: each Fp8Meta's scale
and amax history before the pass (``fresh_*``), after it (``calibrated_*``) and after the
step (``stepped_*``), and the step's loss.

Usage: python tests/distributed/calibration_worker.py OUT_DIR CONFIG OVERRIDE...
"""
import os
import sys

import jax

jax.config.update("jax_num_cpu_devices", 1)
jax.config.update("jax_cpu_collectives_implementation", "gloo")

import numpy as np  # noqa: E402

from fp8jax import parallel  # noqa: E402
from fp8jax.config import load_config  # noqa: E402
from fp8jax.scaling import Fp8Meta  # noqa: E402
from fp8jax.train.calibration import any_unobserved  # noqa: E402
from fp8jax.train.loop import Trainer  # noqa: E402


def local(fp8, name: str) -> dict:
  """This process's copy of the scale and amax history of every Fp8Meta of the replicated FP8
  state `fp8`, as numpy: {"<name>_scale_<i>": ..., "<name>_history_<i>": ...}."""
  metas = jax.tree.leaves(fp8, is_leaf=lambda x: isinstance(x, Fp8Meta))
  out = {}
  for i, m in enumerate(metas):
    out[f"{name}_scale_{i}"] = np.asarray(m.scale.addressable_data(0))
    out[f"{name}_history_{i}"] = np.asarray(m.amax_history.addressable_data(0))
  return out


def main(out_dir: str, config: str, overrides: list) -> None:
  assert parallel.initialize(initialization_timeout=120, heartbeat_timeout=60,
                             shutdown_timeout=60) == "env"
  me = jax.process_index()
  trainer = Trainer(load_config(config, overrides), progress=False)
  assert trainer.calibration.enabled and any_unobserved(trainer.state.fp8)
  k = trainer.config.microbatches_at(0)
  batch = trainer.next_batch(0)
  arrays = local(trainer.state.fp8, "fresh")
  calibrated = trainer.calibrate(trainer.state, batch)
  arrays.update(local(calibrated.fp8, "calibrated"))  # (read before the step: it donates it)
  state, metrics = trainer.step_fn(k)(calibrated, batch)  # (no second pass: passes == 1)
  assert trainer.calibration.passes == 1, trainer.calibration.passes
  assert not any_unobserved(state.fp8)  # every FP8 state observed a tensor in the step
  built = [(m is trainer.calibration.model, n) for m, n in trainer.steps.built()]
  assert built == [(True, k)], built  # the calibrated step alone: the pass gave every scale
  arrays.update(local(state.fp8, "stepped"))
  arrays["loss"] = np.asarray(metrics["loss"].addressable_data(0))
  np.savez(os.path.join(out_dir, f"fp8_{me}.npz"), **arrays)
  print(f"process {me} of {jax.process_count()}: {parallel.describe(trainer.plan.mesh)}",
        flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], sys.argv[3:])
