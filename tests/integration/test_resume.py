"""`fp8jax train` killed and relaunched (mid batch ramp): auto-resume is bit-identical;
SIGTERM loses no step."""
import os
import random
import signal
import subprocess
import time

import numpy as np
import pytest

import ft_util


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A persistent compilation cache shared by this module's trainer processes."""
  return tmp_path_factory.mktemp("jax_cache")


# A batch ramp from 1 to 4 microbatches over 30 of the 40 steps: a kill lands mid-ramp.
RAMP = {"opt_level": "O2", "microbatches": 4,
        "batch_ramp": {"start_tokens": 32, "end_tokens": 128, "ramp_steps": 30,
                       "lr_follows": "tokens"}}


def _uninterrupted(tmp_path, cache):
  run_dir = tmp_path / "ref"
  cfg = ft_util.tiny_config(tmp_path / "ref.yaml", run_dir, train=RAMP)
  result = ft_util.run(ft_util.train_cmd(cfg), 300, env=ft_util.env(cache))
  assert result.returncode == 0, result.stderr[-3000:]
  return run_dir


@pytest.mark.slow
def test_kill_9_then_auto_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path, cache):
  ref_dir = _uninterrupted(tmp_path, cache)
  run_dir = tmp_path / "killed"
  cfg = ft_util.tiny_config(tmp_path / "killed.yaml", run_dir, train=RAMP)
  kill_at = random.Random().randint(4, 30)  # of 40 steps; checkpoints every 3
  print(f"SIGKILL once step {kill_at} is logged")
  proc = subprocess.Popen(ft_util.train_cmd(cfg), env=ft_util.env(cache), cwd=ft_util.ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    reached = ft_util.wait_for_step(run_dir, kill_at, proc)
    os.kill(proc.pid, signal.SIGKILL)
  finally:
    proc.wait(timeout=60)
  assert proc.returncode == -signal.SIGKILL and reached < 40
  # Saves are asynchronous: the newest one may still be in flight (a *-tmp directory) when
  # the kill lands, and with an early kill none may be finalized yet; then the run restarts.
  ckpts = run_dir / "checkpoints"
  finalized = [int(n) for n in os.listdir(ckpts) if n.isdigit()] if ckpts.exists() else []
  result = ft_util.run(ft_util.train_cmd(cfg), 300, env=ft_util.env(cache))
  assert result.returncode == 0, result.stderr[-3000:]
  if finalized:
    resumed_from = int(result.stdout.split("resumed from step ")[1].split()[0])
    assert resumed_from == max(finalized) and resumed_from <= reached and resumed_from % 3 == 0
  else:
    assert "resumed from step" not in result.stdout
  ref, got = ft_util.losses(ref_dir), ft_util.losses(run_dir)
  assert [s for s, _ in ref] == list(range(1, 41))
  assert got == ref  # every step's loss, bit for bit (JSON floats round-trip exactly)
  ref_leaves = ft_util.saved_state(ref_dir / "checkpoints", 40)
  got_leaves = ft_util.saved_state(run_dir / "checkpoints", 40)
  assert len(ref_leaves) == len(got_leaves) > 10
  for a, b in zip(ref_leaves, got_leaves):
    assert a.dtype == b.dtype and np.array_equal(a.reshape(-1).view(np.uint8),
                                                 b.reshape(-1).view(np.uint8))


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_and_exits_0(tmp_path, cache):
  run_dir = tmp_path / "term"
  cfg = ft_util.tiny_config(tmp_path / "term.yaml", run_dir,
                            train={"opt_level": "O2"},
                            checkpoint={"checkpoint_every_n_steps": 1000})
  proc = subprocess.Popen(ft_util.train_cmd(cfg), env=ft_util.env(cache), cwd=ft_util.ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    ft_util.wait_for_step(run_dir, 5, proc)
    os.kill(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 0, err[-3000:]
  stopped = int(out.split("preempted: stopped after step ")[1].split(",")[0])
  logged = max(s for s, _ in ft_util.losses(run_dir))
  assert 5 <= stopped < 40 and logged == stopped  # 0 steps lost
  assert sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit()) == [stopped]
  t0 = time.monotonic()
  result = ft_util.run(ft_util.train_cmd(cfg), 300, env=ft_util.env(cache))
  assert result.returncode == 0, result.stderr[-3000:]
  assert f"resumed from step {stopped}" in result.stdout
  assert [s for s, _ in ft_util.losses(run_dir)] == list(range(1, 41))
  print(f"relaunch to finish: {time.monotonic() - t0:.1f} s")
