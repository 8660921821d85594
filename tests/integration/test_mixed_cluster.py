"""A mixed cluster rehearsed on 8 CPU devices (``parallel.device_kinds``): two emulated GPU
kinds get unequal microbatch counts; at O3, ZeRO-3 (layer-major) with FP8 gradient
reduce-scatters the run tracks the uniform run, and a run killed with SIGKILL resumes bit for
bit."""
import os
import random
import signal
import subprocess

import numpy as np
import pytest

import ft_util

import fp8jax
from fp8jax.config import config_from_dict

KINDS = "4xA100+4xH100"
BALANCED = {"zero_stage": 3, "grad_comm": "fp8", "device_kinds": KINDS,
            "device_map": {"A100": 0.5, "H100": 1.0}}
TRAIN = {"opt_level": "O3", "batch_size": 24, "microbatches": 12}  # microbatches of 2


def _config(run_dir, steps: int, parallel: dict, **train):
  return config_from_dict({
      "model": {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64,
                "max_seq_len": 32},
      "data": {"seq_len": 32, "max_bytes": 200_000},
      "train": {"steps": steps, "learning_rate": 3e-3, "warmup_steps": 2, "eval_every": 0,
                "log_every": 1, "fp8_health_every": 0, **TRAIN, **train},
      "parallel": parallel, "runtime": {"run_dir": str(run_dir)}})


def test_device_kinds_are_parsed_and_checked():
  from fp8jax.parallel import device_map
  assert device_map.parse_kinds("2xA100+1xH100") == ["A100", "A100", "H100"]
  assert device_map.parse_kinds(["A100", "H100"]) == ["A100", "H100"]
  for bad in ("2A100", "0xA100", "x", [], [""], 3):
    with pytest.raises(ValueError, match="parallel.device_kinds"):
      device_map.parse_kinds(bad)
  with pytest.raises(ValueError, match="needs parallel.device_map"):
    _config("/tmp/unused", 1, {"device_kinds": KINDS})
  with pytest.raises(ValueError, match="names 3 devices but the run has 8"):
    import jax
    device_map.declared_kinds("3xA100", jax.devices()[:1], jax.devices())


def test_two_emulated_kinds_train_balanced_and_track_the_uniform_run(tmp_path):
  from fp8jax.train.loop import Trainer
  trainers, losses = {}, {}
  # The uniform run: the same 24 sequences a step, as 3 microbatches of 8 (one sequence per
  # device each).
  for name, parallel, train in (("uniform", {"zero_stage": 3}, {"microbatches": 3}),
                                ("balanced", BALANCED, {})):
    trainers[name] = Trainer(_config(tmp_path / name, 50, parallel, **train), progress=False)
    trainers[name].run()
    losses[name] = np.array([r["loss"] for r in fp8jax.train.metrics.read_jsonl(
        str(tmp_path / name / "metrics.jsonl")) if "loss" in r])
  # The A100s (half as fast) get one microbatch each, the H100s two.
  assert trainers["balanced"].balanced_counts(12) == (1, 1, 1, 1, 2, 2, 2, 2)
  assert len(losses["balanced"]) == len(losses["uniform"]) == 50
  assert losses["uniform"][-1] < losses["uniform"][0] - 1.0  # it learns
  gap = np.abs(losses["balanced"] - losses["uniform"]) / losses["uniform"]
  # Same data, same microbatches; FP8 gradient reduce-scatters (E4M3) make the difference.
  print(f"largest relative loss gap over 50 steps: {gap.max():.4f}")
  assert 0 < gap.max() < 0.02, gap


@pytest.mark.slow
def test_balanced_fp8_zero3_run_killed_with_sigkill_resumes_bit_identically(tmp_path):
  cache = tmp_path / "jax_cache"
  env = ft_util.env(cache, JAX_NUM_CPU_DEVICES=8)
  train = {**TRAIN, "steps": 24, "learning_rate": 3e-3}
  configs = {name: ft_util.tiny_config(tmp_path / f"{name}.yaml", tmp_path / name,
                                       train=train, parallel=BALANCED,
                                       model={"n_layers": 2})
             for name in ("ref", "killed")}
  result = ft_util.run(ft_util.train_cmd(configs["ref"]), 400, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "A100: 1, A100: 1, A100: 1, A100: 1, H100: 2" in result.stdout
  run_dir = tmp_path / "killed"
  kill_at = random.Random().randint(4, 20)  # checkpoints every 3 steps
  print(f"SIGKILL once step {kill_at} is logged")
  proc = subprocess.Popen(ft_util.train_cmd(configs["killed"]), env=env, cwd=ft_util.ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    reached = ft_util.wait_for_step(run_dir, kill_at, proc, timeout=300)
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL and reached < 24
  result = ft_util.run(ft_util.train_cmd(configs["killed"]), 400, env=env)
  assert result.returncode == 0, result.stderr[-3000:]
  ref, got = ft_util.losses(tmp_path / "ref"), ft_util.losses(run_dir)
  assert [s for s, _ in ref] == list(range(1, 25)) and got == ref
  ref_leaves = ft_util.saved_state(tmp_path / "ref" / "checkpoints", 24)
  got_leaves = ft_util.saved_state(run_dir / "checkpoints", 24)
  assert len(ref_leaves) == len(got_leaves) > 10
  for a, b in zip(ref_leaves, got_leaves):
    assert a.dtype == b.dtype and np.array_equal(a.reshape(-1).view(np.uint8),
                                                 b.reshape(-1).view(np.uint8))


def test_automatic_comm_scaling_at_zero3_is_refused_with_the_reason():
  with pytest.raises(ValueError, match="grad_comm_scaling='auto' is not supported at ZeRO-3: "
                                       "the per-group loop runs layer-major"):
    _config("/tmp/unused", 1, {**BALANCED, "grad_comm_scaling": "auto"})
  _config("/tmp/unused", 1, {**BALANCED, "zero_stage": 2, "grad_comm_scaling": "auto"})
