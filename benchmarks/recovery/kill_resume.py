"""Recovery time: kill -9 a training run, relaunch it with auto-resume, time the way back.

  python benchmarks/recovery/kill_resume.py [--config configs/gpt_1_3b.yaml] [--kill-at 12]
      [--every 5] [--set train.opt_level=O2 ...]
  python benchmarks/recovery/kill_resume.py --config configs/tiny.yaml          # CPU check

Runs ``python -m fp8jax.cli train`` on the config with checkpoints every `--every` steps,
logging every step; once step `--kill-at` is logged (and the checkpoint before it is on
disk) sends SIGKILL, relaunches the same command and measures:

* steps lost: last logged step before the kill - the step the relaunch resumed from;
* time to detect: SIGKILL -> the process is seen dead (a hang is detected by the heartbeat
  after runtime.heartbeat_interval x heartbeat_tolerance instead);
* relaunch -> restored: the process printed "resumed from step" (init + restore);
* relaunch -> first resumed step: the first step after the checkpoint is logged (includes
  compilation, from the persistent compilation cache unless --no-compile-cache).

Prints one table. Checkpoints go to a temporary folder that is deleted afterwards
(--keep-run keeps it).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Run:
  """One trainer process; its output lines are timestamped as they arrive."""

  def __init__(self, cmd: list[str], env: dict):
    self.t0 = time.monotonic()
    self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
    self.lines: list[tuple[float, str]] = []
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append((time.monotonic(), line.rstrip()))

  def first(self, text: str) -> tuple[float, str] | None:
    return next(((t, line) for t, line in self.lines if text in line), None)

  def tail(self, n: int = 30) -> str:
    return "\n".join(line for _, line in self.lines[-n:])


def logged_steps(run_dir: str) -> list[int]:
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  steps = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue
      if "loss" in record:
        steps.append(record["step"])
  return steps


def checkpoint_steps(ckpt_dir: str) -> list[int]:
  if not os.path.isdir(ckpt_dir):
    return []
  return sorted(int(n) for n in os.listdir(ckpt_dir) if n.isdigit()
                and os.path.exists(os.path.join(ckpt_dir, n, "commit_success.txt")))


def wait_until(cond, run: Run, timeout: float, what: str):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    value = cond()
    if value:
      return value
    if run.proc.poll() is not None:
      raise RuntimeError(f"trainer exited ({run.proc.returncode}) before {what}:\n{run.tail()}")
    time.sleep(0.05)
  raise TimeoutError(f"{what} not reached in {timeout:.0f} s:\n{run.tail()}")


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_1_3b.yaml"))
  p.add_argument("--kill-at", type=int, default=12, help="SIGKILL once this step is logged")
  p.add_argument("--every", type=int, default=5, help="checkpoint every N steps")
  p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
  p.add_argument("--timeout", type=float, default=240, help="seconds per phase")
  p.add_argument("--no-compile-cache", action="store_true")
  p.add_argument("--keep-run", action="store_true")
  args = p.parse_args(argv)
  if args.kill_at <= args.every:
    p.error(f"--kill-at={args.kill_at} must be larger than --every={args.every}")

  work = tempfile.mkdtemp(prefix="fp8jax_recovery_")
  run_dir = os.path.join(work, "run")
  overrides = [f"runtime.run_dir={run_dir}", f"train.steps={args.kill_at + 2 * args.every}",
               "train.log_every=1", "train.eval_every=0", "train.fp8_health_every=0",
               "train.warmup_steps=1", f"checkpoint.checkpoint_every_n_steps={args.every}",
               "checkpoint.keep=1", "checkpoint.auto_resume=true"] + args.set
  cmd = [sys.executable, "-m", "fp8jax.cli", "train", "--config", args.config, "--no-progress"]
  for o in overrides:
    cmd += ["--set", o]
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
             PYTHONUNBUFFERED="1")
  env.setdefault("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=false")
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  if not args.no_compile_cache:
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.join(work, "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  ckpt_dir = os.path.join(run_dir, "checkpoints")
  try:
    first = Run(cmd, env)
    wait_until(lambda: any(s >= args.kill_at for s in logged_steps(run_dir)), first,
               args.timeout, f"step {args.kill_at}")
    wait_until(lambda: checkpoint_steps(ckpt_dir), first, args.timeout, "a complete checkpoint")
    first_start = first.t0
    t_first_step = next(t for t, line in first.lines if "fp8jax train: level" in line)
    lost_from = max(logged_steps(run_dir))
    t_kill = time.monotonic()
    os.kill(first.proc.pid, signal.SIGKILL)
    first.proc.wait()
    detect = time.monotonic() - t_kill
    lost_from = max([lost_from] + logged_steps(run_dir))

    second = Run(cmd, env)
    restored = wait_until(lambda: second.first("resumed from step"), second, args.timeout,
                          "the restore")
    resumed_from = int(restored[1].split("resumed from step ")[1].split()[0])
    wait_until(lambda: any(s > resumed_from for s in logged_steps(run_dir)[-3:]), second,
               args.timeout, "the first resumed step")
    t_resumed_step = time.monotonic()
    second.proc.send_signal(signal.SIGTERM)  # preemption path: saves, exits 0
    code = second.proc.wait(timeout=args.timeout)
    rows = [
        ("config", os.path.relpath(args.config, ROOT) + (" " + " ".join(args.set) if args.set
                                                          else "")),
        ("first launch -> trainer built (s)", f"{t_first_step - first_start:.1f}"),
        ("killed (SIGKILL) after step", str(lost_from)),
        ("resumed from checkpoint step", str(resumed_from)),
        ("steps lost", str(lost_from - resumed_from)),
        ("time to detect the kill (s)", f"{detect:.3f}"),
        ("relaunch -> state restored (s)", f"{restored[0] - second.t0:.1f}"),
        ("relaunch -> first resumed step (s)", f"{t_resumed_step - second.t0:.1f}"),
        ("SIGTERM after resuming: exit code", str(code)),
        ("compilation cache", "off" if args.no_compile_cache else "on"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nfp8jax recovery benchmark")
    for k, v in rows:
      print(f"  {k:<{width}}  {v}")
    return 0 if code == 0 and lost_from - resumed_from <= args.every else 1
  finally:
    for run in [r for r in (locals().get("first"), locals().get("second")) if r is not None]:
      if run.proc.poll() is None:
        run.proc.kill()
    if args.keep_run:
      print(f"run kept in {work}")
    else:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main())
