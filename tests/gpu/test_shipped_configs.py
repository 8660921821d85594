"""Every shipped config end to end on the GPU (sm_89+ only; skipped elsewhere): a few steps at
its shipped level including an evaluation and one checkpoint save (at step 3: a 7B checkpoint
is ~32 GB, and two of them do not fit every disk), then a resume from that checkpoint, each
through ``fp8jax train`` as a user runs it. Each run's peak device memory is printed next to
the memory model's estimate of its largest phase (``fp8jax.train.memory.run_bytes``) as a
Markdown row (``-s`` shows them; RESULTS.md keeps the table). FP8JAX_GPU_CONFIGS=a.yaml,b.yaml
runs a subset."""
import json
import os
import shutil
import subprocess
import sys

import jax
import pytest

import fp8jax
from fp8jax.config import load_config
from fp8jax.train import build, memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(c for c in os.listdir(os.path.join(ROOT, "configs"))
                 if c.endswith(".yaml") and c != "base.yaml")
if os.environ.get("FP8JAX_GPU_CONFIGS"):
  CONFIGS = os.environ["FP8JAX_GPU_CONFIGS"].split(",")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(fp8jax.native_fp8_reason() is not None,
                                 reason="needs GPUs with FP8 GEMMs (sm_89+)")]


def _train(config: str, run_dir, steps: int) -> subprocess.CompletedProcess:
  sets = [f"train.steps={steps}", "train.eval_every=2", "train.eval_batches=2",
          "train.log_every=1", "checkpoint.checkpoint_every_n_steps=3",
          "checkpoint.keep=1", "checkpoint.auto_resume=true", f"runtime.run_dir={run_dir}"]
  cmd = [sys.executable, "-m", "fp8jax.cli", "train", "--config", config, "--no-progress"]
  for s in sets:
    cmd += ["--set", s]
  return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=1800)


def _bytes(folder) -> int:
  return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)


def _records(run_dir) -> list[dict]:
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_config_trains_evaluates_saves_and_resumes(name, tmp_path):
  config = os.path.join("configs", name)
  run_dir = tmp_path / "run"
  try:
    _check_config(name, config, run_dir)
  finally:  # a 7B checkpoint is ~32 GB: never leave one behind for the next config
    shutil.rmtree(run_dir, ignore_errors=True)


def _check_config(name: str, config: str, run_dir) -> None:
  first = _train(config, run_dir, 3)
  assert first.returncode == 0, first.stderr[-3000:]
  records = _records(run_dir)
  assert any("val_loss" in r for r in records), "no evaluation logged"
  assert os.path.isdir(run_dir / "checkpoints" / "3"), os.listdir(run_dir / "checkpoints")
  peak = max(r.get("peak_mem_gib", 0.0) for r in records)
  cfg = build.resolve_auto(load_config(os.path.join(ROOT, config), []))
  estimate = memory.run_bytes(cfg, cfg.model.remat_policy, cfg.model.attention_impl,
                              jax.device_count()) / 2**30
  device = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", float("inf")) / 2**30
  print(f"\n| {name} | {cfg.train.opt_level} | {peak:.1f} | {estimate:.1f} | "
        f"{peak / estimate:.2f} | {device:.0f} |")
  assert peak < device and (peak > 0 or device == float("inf"))  # no peak reading on CPU
  saved, free = _bytes(run_dir / "checkpoints"), shutil.disk_usage(run_dir).free
  if free < 1.2 * saved:  # the resumed run's save exists beside the old one until it completes
    pytest.skip(f"{name}: resuming needs ~{1.2 * saved / 2**30:.0f} GiB of free disk for its "
                f"save, {free / 2**30:.0f} GiB free (the first run passed)")
  resumed = _train(config, run_dir, 4)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step 3" in resumed.stdout, resumed.stdout[-2000:]
  assert [r["step"] for r in _records(run_dir) if "loss" in r][-1] == 4
