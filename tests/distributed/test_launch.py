"""`fp8jax launch`: environment contract, failure detection, supervised restarts, signals."""
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from fp8jax import launch as launch_lib

import ft_util

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launch_worker.py")


def _launch(args, timeout=180):
  cmd = [sys.executable, "-m", "fp8jax.cli", "launch"] + args
  return ft_util.run(cmd, timeout, env=ft_util.env())


def test_launch_sets_the_distributed_environment(tmp_path):
  script = ("import os, json; json.dump({k: os.environ[k] for k in ('FP8JAX_COORDINATOR', "
            "'FP8JAX_NUM_PROCESSES', 'FP8JAX_PROCESS_ID', 'FP8JAX_RESTART')}, "
            f"open(os.path.join({str(tmp_path)!r}, os.environ['FP8JAX_PROCESS_ID']), 'w'))")
  result = _launch(["-n", "3", "--", sys.executable, "-c", script], 60)
  assert result.returncode == 0, result.stderr
  envs = [json.load(open(tmp_path / str(i))) for i in range(3)]
  assert [e["FP8JAX_PROCESS_ID"] for e in envs] == ["0", "1", "2"]
  assert {e["FP8JAX_NUM_PROCESSES"] for e in envs} == {"3"}
  assert {e["FP8JAX_RESTART"] for e in envs} == {"0"}
  assert len({e["FP8JAX_COORDINATOR"] for e in envs}) == 1
  assert re.fullmatch(r"127\.0\.0\.1:\d+", envs[0]["FP8JAX_COORDINATOR"])


def test_exit_codes_and_restarts_without_jax(tmp_path):
  fail_first = ("import os, sys; sys.exit(3 if os.environ['FP8JAX_RESTART'] == '0' and "
                "os.environ['FP8JAX_PROCESS_ID'] == '1' else 0)")
  result = _launch(["-n", "2", "--grace", "5", "--", sys.executable, "-c", fail_first], 60)
  assert result.returncode == 3 and "process 1 exited with code 3" in result.stderr
  result = _launch(["-n", "2", "--max-restarts", "1", "--", sys.executable, "-c", fail_first], 60)
  assert result.returncode == 0 and "restart 1 of 1" in result.stderr
  always = "import os; os.kill(os.getpid(), 9)"
  result = _launch(["-n", "1", "--max-restarts", "2", "--", sys.executable, "-c", always], 60)
  assert result.returncode == 128 + 9 and result.stderr.count("killed by signal 9") == 3


_TERM_AWARE = textwrap.dedent("""
    import os, signal, sys, time
    out = sys.argv[1]
    def term(*_):
      open(os.path.join(out, "term" + os.environ["FP8JAX_PROCESS_ID"]), "w").close()
      sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    open(os.path.join(out, "ready" + os.environ["FP8JAX_PROCESS_ID"]), "w").close()
    time.sleep(60)
    sys.exit(1)
""")


def test_sigterm_is_forwarded_and_nothing_restarts(tmp_path):
  proc = subprocess.Popen([sys.executable, "-m", "fp8jax.cli", "launch", "-n", "2",
                           "--max-restarts", "3", "--", sys.executable, "-c", _TERM_AWARE,
                           str(tmp_path)], env=ft_util.env(), cwd=ft_util.ROOT,
                          stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
      assert time.monotonic() < deadline and proc.poll() is None
      time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
  finally:
    proc.kill()
  assert proc.returncode == 0, err
  assert all((tmp_path / f"term{i}").exists() for i in range(2))
  assert "restart" not in err


@pytest.mark.slow
def test_one_of_two_processes_killed_the_other_exits_within_its_timeout(tmp_path):
  heartbeat_timeout, grace = 5, 30
  t0 = time.monotonic()
  result = _launch(["-n", "2", "--grace", str(grace), "--", sys.executable, WORKER,
                    str(tmp_path), "40", str(heartbeat_timeout), "10"])
  took = time.monotonic() - t0
  assert result.returncode == 128 + 9, result.stderr[-3000:]
  assert "process 1 was killed by signal 9" in result.stderr
  stopped = float(re.search(r"all processes stopped ([\d.]+) s after", result.stderr)[1])
  # process 0 ended by itself (failed collective, then jax.distributed's heartbeat timeout),
  # not by the launcher's SIGTERM/SIGKILL after the grace period
  assert stopped <= heartbeat_timeout + 5 and "SIGTERM" not in result.stderr
  other = json.load(open(tmp_path / "proc0.attempt0"))["os_pid"]
  with pytest.raises(ProcessLookupError):
    os.kill(other, 0)
  assert took < 120
  print(f"the other process stopped {stopped:.1f} s after the kill")


@pytest.mark.slow
def test_supervised_launch_restarts_from_the_checkpoint_and_finishes(tmp_path):
  result = _launch(["-n", "2", "--max-restarts", "1", "--grace", "30", "--", sys.executable,
                    WORKER, str(tmp_path), "30", "5", "10"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert "restart 1 of 1" in result.stderr
  starts = [json.load(open(tmp_path / f"proc{i}.attempt1"))["start"] for i in range(2)]
  assert starts[0] == starts[1] and 10 <= starts[0] <= 12  # resumed, not from 0
  assert json.load(open(tmp_path / "state.json"))["step"] == 30
  assert result.stdout.count("finished 30 steps") == 2


@pytest.mark.parametrize("kwargs,message", [
    ({"num_processes": 0}, "num_processes=0 is not allowed; use an integer >= 1"),
    ({"max_restarts": -1}, "max_restarts=-1 is not allowed; use an integer >= 0"),
    ({"grace": -1.0}, "grace=-1.0 is not allowed; use a number of seconds >= 0"),
])
def test_launch_refuses_bad_arguments(kwargs, message):
  with pytest.raises(ValueError) as e:
    launch_lib.launch(["true"], **kwargs)
  assert message in str(e.value)


def test_launch_refuses_an_empty_command():
  with pytest.raises(ValueError, match="no command given"):
    launch_lib.launch([], 1)


@pytest.mark.slow
def test_two_process_training_matches_one_process_and_resumes(tmp_path):
  """`fp8jax launch -n 2 -- fp8jax train`: both processes join one jax.distributed group
  (data parallel over 2 devices), process 0 alone writes the logs, the per-step losses match a
  one-process run of the same config, and a relaunch with more steps resumes from the
  2-process checkpoint."""
  one = ft_util.tiny_config(tmp_path / "one.yaml", tmp_path / "one", train={"steps": 6})
  two = ft_util.tiny_config(tmp_path / "two.yaml", tmp_path / "two", train={"steps": 6})
  cache = tmp_path / "cache"
  single = ft_util.run(ft_util.train_cmd(one), 240, env=ft_util.env(cache))
  assert single.returncode == 0, single.stderr[-3000:]
  multi = ft_util.run([sys.executable, "-m", "fp8jax.cli", "launch", "-n", "2", "--"]
                      + ft_util.train_cmd(two), 240, env=ft_util.env(cache))
  assert multi.returncode == 0, multi.stderr[-3000:]
  assert multi.stdout.count("process 0 of 2") == 1 and multi.stdout.count("process 1 of 2") == 1
  ref, got = ft_util.losses(tmp_path / "one"), ft_util.losses(tmp_path / "two")
  assert [s for s, _ in got] == [s for s, _ in ref] == list(range(1, 7))  # written once
  # Same batches; only the reduction order differs. It shows in the first steps at f32's
  # level; then E4M3 rounding flips compound (the 6th step's loss drifted 1.6e-3 relative).
  for step, ((_, a), (_, b)) in enumerate(zip(got, ref)):
    assert abs(a - b) <= (1e-5 if step < 3 else 1e-2) * abs(b), (step, a, b)
  more = ft_util.tiny_config(tmp_path / "two.yaml", tmp_path / "two", train={"steps": 9})
  resumed = ft_util.run([sys.executable, "-m", "fp8jax.cli", "launch", "-n", "2", "--"]
                        + ft_util.train_cmd(more), 240, env=ft_util.env(cache))
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step 6" in resumed.stdout + resumed.stderr
  assert [s for s, _ in ft_util.losses(tmp_path / "two")] == list(range(1, 10))
