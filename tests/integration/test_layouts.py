"""Random parallel layouts, trained for real: each trains one step or is refused with one line
(the CLI's exit 2), never a signal death or a hang, and the outcome is the one the layout
rules predict (``fp8jax.parallel.layout_rules``, checked here in this process from the
config alone).

Layouts are random combinations of batch size, microbatches, pipeline stages and schedule,
ZeRO stage, tensor and fsdp sizes, level and gradient communication of the smallest model
(tests/integration/layouts_worker.py), on 8 CPU devices and, in the slow sweep, on a random
smaller device count. Every layout of a test runs in one worker process (startup once). The
seed is printed; FP8JAX_TEST_SEED=<seed> replays a run, and a failure names the layout's
``--set`` flags. FP8JAX_LAYOUT_SWEEP=<n> sets how many trained layouts per device count the
slow sweep runs (default 4)."""
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

from fp8jax.config import load_config
from fp8jax.train import build

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import layouts_worker  # noqa: E402

LAYOUT_TIMEOUT_S = 240  # one layout; a collective deadlock aborts after XLA's 40 s rendezvous
# The two layouts of the report that had a traceback (O0) and a deadlock (O1, O2): a
# microbatch of 2 sequences over 4 data ranks in a pipeline; 6 sequences over 8 ZeRO-3 ranks.
MEASURED = [
    ["parallel.pipeline_parallel_size=2", "train.microbatches=4", "train.batch_size=8",
     "train.opt_level=O1"],
    ["parallel.zero_stage=3", "train.batch_size=6", "train.microbatches=1"],
]
# A layout a sweep found hanging in its evaluation (XLA's rendezvous abort): balanced
# microbatches of 2 sequences over 4 data ranks, FP8, in a pipeline. It trains.
FOUND = [
    ["parallel.pipeline_parallel_size=2", "parallel.zero_stage=1", "parallel.grad_comm=fp8",
     "train.opt_level=O3", "train.microbatches=3", "train.batch_size=6",
     "parallel.pipeline_schedule=1f1b", "parallel.device_map={cpu: 1.0}"],
]


def _seed() -> int:
  seed = int(os.environ.get("FP8JAX_TEST_SEED", np.random.SeedSequence().entropy % (1 << 31)))
  print(f"layouts: seed {seed} (FP8JAX_TEST_SEED={seed} replays it)")
  return seed


def random_layout(rng) -> list[str]:
  """--set overrides of one random layout of the worker's model: mesh sizes, batch,
  microbatches, ZeRO stage, level, gradient communication; sometimes a batch ramp (the one
  step runs one microbatch), balanced per-group counts (``parallel.device_map``) or the FP8
  calibration pass and cast-health probe (programs of their own through the layout)."""
  pipe = int(rng.choice([1, 1, 2, 4]))
  microbatches = int(rng.choice([1, 2, 3, 4, 8]))
  batch = microbatches * int(rng.choice([1, 2, 3, 4, 6, 8])) + int(rng.random() < 0.1)
  out = [f"parallel.pipeline_parallel_size={pipe}",
         f"parallel.tensor_parallel_size={rng.choice([1, 1, 2, 4])}",
         f"parallel.fsdp_size={rng.choice([1, 1, 2])}",
         f"parallel.zero_stage={rng.integers(4)}",
         f"parallel.grad_comm={rng.choice(['auto', 'native', 'fp8'])}",
         f"train.opt_level={rng.choice(['O0', 'O1', 'O2', 'O3'])}",
         f"train.microbatches={microbatches}", f"train.batch_size={batch}"]
  if pipe > 1:
    out.append(f"parallel.pipeline_schedule={rng.choice(['gpipe', '1f1b'])}")
  if rng.random() < 0.2 and batch % microbatches == 0:
    seq = layouts_worker.BASE["data"]["seq_len"]
    out.append(f"train.batch_ramp={{start_tokens: {batch // microbatches * seq}, "
               f"end_tokens: {batch * seq}, ramp_steps: 1}}")
  if rng.random() < 0.15:
    out.append("parallel.device_map={cpu: 1.0}")
  if rng.random() < 0.25:  # the calibration pass before the step, the health probe after it
    out += ["fp8.calibrate=always", "train.fp8_health_every=1"]
  return out


def predicted(base_path: str, overrides, devices: int) -> str:
  """"trained" or "refused": what the config and the layout rules say for `devices`."""
  try:
    config = load_config(base_path, overrides)
    config.check_layout(build.run_device_count(config, devices))
  except ValueError:
    return "refused"
  return "trained"


def pick(rng, base_path: str, devices: int, trained: int, refused: int) -> list[dict]:
  """`trained` random layouts the rules accept on `devices` devices and `refused` they
  refuse, shuffled."""
  want = {"trained": trained, "refused": refused}
  out = []
  while any(want.values()):
    overrides = random_layout(rng)
    outcome = predicted(base_path, overrides, devices)
    if want[outcome]:
      want[outcome] -= 1
      out.append({"set": overrides, "predicted": outcome})
  rng.shuffle(out)
  return out


def run_worker(layouts: list[dict], devices: int, run_dir: str) -> list[tuple[dict, dict]]:
  """Runs `layouts` in one worker process on `devices` CPU devices; [(layout, result)].
  Fails the test, naming the layout, when the worker dies or a layout runs past
  LAYOUT_TIMEOUT_S."""
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu",
             JAX_NUM_CPU_DEVICES=str(devices))
  proc = subprocess.Popen([sys.executable, os.path.join(HERE, "layouts_worker.py"), run_dir],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env)
  stderr: list[str] = []
  threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
  lines: list[str] = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
  reader.start()
  proc.stdin.write("".join(json.dumps({"id": i, "set": layout["set"]}) + "\n"
                           for i, layout in enumerate(layouts)))
  proc.stdin.close()
  started, start_time = None, time.monotonic()
  while reader.is_alive():
    reader.join(1.0)
    starts = [int(line.split()[1]) for line in lines if line.startswith("LAYOUT-START ")]
    if starts and starts[-1] != started:
      started, start_time = starts[-1], time.monotonic()
    if time.monotonic() - start_time > LAYOUT_TIMEOUT_S:
      proc.kill()
      proc.wait()
      pytest.fail(f"layout {_flags(layouts[started or 0])} ran past {LAYOUT_TIMEOUT_S} s "
                  f"({devices} devices)", pytrace=False)
  code = proc.wait()
  results = {r["id"]: r for r in (json.loads(line[len("LAYOUT "):]) for line in lines
                                  if line.startswith("LAYOUT "))}
  if code != 0 or len(results) != len(layouts):
    dead = next(i for i in range(len(layouts)) if i not in results)
    text = "".join(stderr)
    fatal = [line for line in text.splitlines() if re.match(r"F\d{4} ", line)][:2]
    pytest.fail(f"the worker died (exit {code}) on layout {_flags(layouts[dead])} "
                f"({devices} devices):\n" + "\n".join(fatal) + f"\n...\n{text[-1000:]}",
                pytrace=False)
  return [(layout, results[i]) for i, layout in enumerate(layouts)]


def _flags(layout: dict) -> str:
  return " ".join(f"--set {item}" for item in layout["set"])


def check_outcomes(pairs, devices: int) -> None:
  """Every layout trained (finite loss) or was refused in one line, as predicted."""
  for layout, result in pairs:
    where = f"{_flags(layout)} ({devices} devices)"
    assert result["status"] in ("trained", "refused"), f"{where}: {result}"
    assert result["status"] == layout["predicted"], f"{where}: {result}"
    if result["status"] == "refused":
      assert result["message"].startswith("fp8jax: error: ") and "\n" not in result["message"]
    else:
      assert np.isfinite(result["loss"]), f"{where}: {result}"
  print({s: sum(r["status"] == s for _, r in pairs) for s in ("trained", "refused")})


@pytest.fixture
def base_path(tmp_path):
  path = tmp_path / "base.yaml"
  path.write_text(yaml.safe_dump(layouts_worker.BASE))
  return str(path)


def test_layouts_train_or_refuse(base_path, tmp_path):
  """8 devices: the two measured layouts (refused in one line), the found one (trains), one
  random layout the rules accept (trains one step) and five they refuse."""
  rng = np.random.default_rng(_seed())
  layouts = [{"set": s, "predicted": predicted(base_path, s, 8)} for s in MEASURED + FOUND]
  assert [x["predicted"] for x in layouts] == ["refused", "refused", "trained"]
  layouts += pick(rng, base_path, 8, trained=1, refused=5)
  check_outcomes(run_worker(layouts, 8, str(tmp_path / "runs")), 8)


@pytest.mark.slow
def test_layouts_sweep(base_path, tmp_path):
  """FP8JAX_LAYOUT_SWEEP (default 4) random accepted layouts and as many refused ones on 8
  devices, then half as many on a random count of 2, 4 or 6 devices: each trains one step or
  is refused in one line, as the rules predict."""
  rng = np.random.default_rng(_seed())
  n = int(os.environ.get("FP8JAX_LAYOUT_SWEEP", "4"))
  for devices, count in ((8, n), (int(rng.choice([2, 4, 6])), max(1, n // 2))):
    layouts = pick(rng, base_path, devices, trained=count, refused=count)
    check_outcomes(run_worker(layouts, devices, str(tmp_path / f"runs{devices}")), devices)
