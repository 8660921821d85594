"""Trains many small configs in one process, one step each, as ``fp8jax train`` would: for
the layout property tests (tests/integration/test_layouts.py).

Usage: layouts_worker.py RUN_DIR < combos.jsonl. Each input line is ``{"id": ..., "set":
[override, ...]}`` (``--set`` overrides of the smallest model's config, :data:`BASE`). For each
line the worker prints ``LAYOUT-START <id>``, then one ``LAYOUT <json>`` line:
``{"id", "status", "message", "loss"}`` with status "trained" (one step and the evaluation
ran; loss: the step's loss), "refused" (the CLI would exit 2: ``message`` is its one line),
"failed" (exit 1) or "bug" (the CLI would show a traceback: ``message`` is the error). The
device count is the process's (``JAX_NUM_CPU_DEVICES``). A process that dies (a signal) or
hangs leaves a START line without its result.
"""
import contextlib
import io
import json
import math
import os
import sys

import yaml

from fp8jax import cli
from fp8jax.config import load_config
from fp8jax.train.loop import Trainer

# The smallest model the layouts need: 4 layers (up to 4 pipeline stages), 4 heads and an MLP
# of 64 (tensor size up to 4), 16 tokens; one step, one evaluation batch.
BASE = {
    "model": {"vocab_size": 256, "d_model": 32, "n_layers": 4, "n_heads": 4, "d_ff": 64,
              "max_seq_len": 16},
    "data": {"seq_len": 16, "max_bytes": 100000},
    "train": {"steps": 1, "warmup_steps": 0, "eval_every": 0, "eval_batches": 1,
              "log_every": 1, "fp8_health_every": 0},
}


def run_one(base_path: str, run_dir: str, overrides) -> dict:
  """One config built from `overrides` and trained for one step; the outcome as a dict."""
  try:
    config = load_config(base_path, [*overrides, f"runtime.run_dir={run_dir}"])
    with contextlib.redirect_stdout(io.StringIO()):
      final = Trainer(config, progress=False, overwrite=True).run()
  except Exception as e:  # noqa: BLE001 - classified as the CLI does
    code = cli.error_exit_code(e)
    status = {2: "refused", 1: "failed"}.get(code, "bug")
    message = cli.error_line(e) if code is not None else f"{type(e).__name__}: {e}"
    return {"status": status, "message": message, "loss": None}
  loss = float(final["loss"])
  return {"status": "trained" if math.isfinite(loss) else "bug",
          "message": "" if math.isfinite(loss) else f"loss {loss}", "loss": loss}


def main():
  run_dir = sys.argv[1]
  os.makedirs(run_dir, exist_ok=True)
  base_path = os.path.join(run_dir, "base.yaml")
  with open(base_path, "w") as f:
    yaml.safe_dump(BASE, f)
  for line in sys.stdin:
    if not line.strip():
      continue
    combo = json.loads(line)
    print(f"LAYOUT-START {combo['id']}", flush=True)
    result = run_one(base_path, os.path.join(run_dir, "run"), combo["set"])
    print("LAYOUT " + json.dumps({"id": combo["id"], **result}), flush=True)


if __name__ == "__main__":
  main()
