"""The composition table (docs/composition.md): every combination of split {uniform,
balanced} x ZeRO {0, 1, 2, 3} x pipeline stages {1, 2} x grad_comm {native, fp8} x batch ramp
{off, on} x model {gpt, llama, builder} x level O0..O3 is either refused when the config is
read, with one of the reasons the table lists, or trains. Every cell's verdict is checked
(config only, milliseconds each); a random sample of the cells that train runs 2 steps on 8
CPU devices (seed printed; FP8JAX_COMPOSITION_SEED=N reruns it)."""
import itertools
import os
import random
import re

import numpy as np

import fp8jax
from fp8jax.config import config_from_dict

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AXES = {"split": ("uniform", "balanced"), "zero": (0, 1, 2, 3), "pipeline": (1, 2),
        "grad_comm": ("native", "fp8"), "ramp": (False, True),
        "model": ("gpt", "llama", "builder"), "level": ("O0", "O1", "O2", "O3")}
CELLS = [dict(zip(AXES, values)) for values in itertools.product(*AXES.values())]
SAMPLE = 3  # trained cells per run (~15 s each on 2 cores)


def cell_config(cell: dict, run_dir: str = "/tmp/unused", steps: int = 2):
  """The tiny config of one cell (8 devices: microbatches of 8 sequences, 2 per step)."""
  model = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
           "max_seq_len": 16}
  if cell["model"] == "llama":
    model.update(family="llama", n_kv_heads=1)
  elif cell["model"] == "builder":
    model = {"builder": "builder_models:tiny_stack_lm", "builder_args": {"width": 32}}
  train = {"steps": steps, "batch_size": 16, "microbatches": 2, "warmup_steps": 1,
           "eval_every": 0, "eval_batches": 1, "log_every": 1, "fp8_health_every": 0,
           "opt_level": cell["level"]}
  if cell["ramp"]:
    train["batch_ramp"] = {"start_tokens": 8 * 16, "end_tokens": 16 * 16, "ramp_steps": 1}
  parallel = {"zero_stage": cell["zero"], "pipeline_parallel_size": cell["pipeline"],
              "grad_comm": cell["grad_comm"]}
  if cell["split"] == "balanced":
    parallel["device_map"] = {"cpu": 1.0}
  return config_from_dict({"model": model, "data": {"seq_len": 16, "max_bytes": 100_000},
                           "train": train, "parallel": parallel,
                           "runtime": {"run_dir": run_dir}})


def verdict(cell: dict) -> str | None:
  """None (the config is accepted) or the refusal's message."""
  try:
    cell_config(cell)
  except ValueError as e:
    return str(e)
  return None


def documented_refusals() -> list[str]:
  """The refusal patterns of docs/composition.md's table (its `refused` column's code spans:
  each a substring of the message)."""
  text = open(os.path.join(ROOT, "docs", "composition.md")).read()
  rows = [line for line in text.splitlines() if line.startswith("| ") and "`" in line]
  return [m for row in rows for m in re.findall(r"`([^`]+)`", row.split("|")[-2])]


def test_every_cell_is_accepted_or_refused_for_a_documented_reason():
  patterns = documented_refusals()
  assert patterns
  used, accepted = set(), 0
  for cell in CELLS:
    message = verdict(cell)
    if message is None:
      accepted += 1
      continue
    assert "\n" not in message and len(message) < 400, message
    hits = [p for p in patterns if p in message]
    assert hits, (cell, message)
    used.update(hits)
  assert used == set(patterns), set(patterns) - used  # every documented reason happens
  text = open(os.path.join(ROOT, "docs", "composition.md")).read()
  assert f"Of the {len(CELLS)} combinations, {accepted} train." in " ".join(text.split())


def test_a_sample_of_accepted_cells_trains_two_steps(tmp_path, monkeypatch):
  from fp8jax.train.loop import Trainer
  monkeypatch.syspath_prepend(os.path.join(ROOT, "tests", "integration"))
  seed = int(os.environ.get("FP8JAX_COMPOSITION_SEED", random.randrange(2**31)))
  print(f"FP8JAX_COMPOSITION_SEED={seed}")
  accepted = [c for c in CELLS if verdict(c) is None]
  for i, cell in enumerate(random.Random(seed).sample(accepted, SAMPLE)):
    run_dir = str(tmp_path / str(i))
    Trainer(cell_config(cell, run_dir), progress=False).run()
    losses = [r["loss"] for r in fp8jax.train.metrics.read_jsonl(
        os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
    assert len(losses) == 2 and np.all(np.isfinite(losses)), (cell, losses)
