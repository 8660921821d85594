"""``fp8jax launch``: run one command as N local processes, supervised, with restarts.

``fp8jax launch -n N [--max-restarts R] [--grace S] -- COMMAND ...`` starts N copies of
COMMAND, each with

* ``FP8JAX_COORDINATOR``: ``127.0.0.1:<free port>`` (a new port per attempt),
* ``FP8JAX_NUM_PROCESSES``: N, ``FP8JAX_PROCESS_ID``: 0..N-1,
* ``FP8JAX_RESTART``: the attempt number (0 for the first launch),

which ``fp8jax.parallel.initialize()`` (called by ``fp8jax train``) turns into a
``jax.distributed`` initialization. Supervision:

* when one process fails (non-zero exit or killed), the others get `grace` seconds to stop on
  their own (their collectives fail and ``jax.distributed``'s heartbeat ends them), then
  SIGTERM, then SIGKILL 5 s later;
* a failed attempt is restarted, all N processes, up to `max_restarts` times; the command
  should continue from its latest checkpoint (``checkpoint.auto_resume: true``);
* SIGTERM / SIGINT sent to the launcher are forwarded to every process (a trainer saves at
  its current step and exits 0) and nothing is restarted.

Exit code: 0 when every process of the last attempt exited 0; otherwise the first failing
process's code (128 + N when it was killed by signal N).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Sequence

from fp8jax.parallel.distributed import ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID

ENV_RESTART = "FP8JAX_RESTART"
KILL_AFTER_TERM_S = 5.0


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _exit_code(returncode: int) -> int:
  """A process's status as a shell would report it (128 + N for signal N)."""
  return 128 - returncode if returncode < 0 else returncode


def _log(message: str) -> None:
  print(f"fp8jax launch: {message}", file=sys.stderr, flush=True)


class _Attempt:
  """N processes of one attempt."""

  def __init__(self, command: Sequence[str], n: int, attempt: int):
    port = _free_port()
    self.procs = []
    for pid in range(n):
      env = dict(os.environ, **{ENV_COORDINATOR: f"127.0.0.1:{port}",
                                ENV_NUM_PROCESSES: str(n), ENV_PROCESS_ID: str(pid),
                                ENV_RESTART: str(attempt)})
      self.procs.append(subprocess.Popen(list(command), env=env, start_new_session=True))

  def codes(self) -> list[int | None]:
    return [p.poll() for p in self.procs]

  def signal_all(self, signum: int) -> None:
    for p in self.procs:
      if p.poll() is None:
        try:
          os.killpg(p.pid, signum)
        except ProcessLookupError:
          pass

  def wait_all(self, timeout: float) -> bool:
    """True when every process ended within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if all(c is not None for c in self.codes()):
        return True
      time.sleep(0.05)
    return all(c is not None for c in self.codes())

  def stop(self, grace: float) -> None:
    """Lets the processes end on their own for `grace` s, then SIGTERM, then SIGKILL."""
    if not self.wait_all(grace):
      _log(f"processes still running {grace:.0f} s after the failure: SIGTERM")
      self.signal_all(signal.SIGTERM)
      if not self.wait_all(KILL_AFTER_TERM_S):
        _log("SIGKILL")
        self.signal_all(signal.SIGKILL)
        self.wait_all(KILL_AFTER_TERM_S)


def launch(command: Sequence[str], num_processes: int = 1, max_restarts: int = 0,
           grace: float = 30.0) -> int:
  """Runs `command` as `num_processes` local processes, restarting a failed attempt up to
  `max_restarts` times; returns the exit code (see the module docstring)."""
  if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes={num_processes!r} is not allowed; use an integer >= 1")
  if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
    raise ValueError(f"max_restarts={max_restarts!r} is not allowed; use an integer >= 0")
  if not (isinstance(grace, (int, float)) and grace >= 0):
    raise ValueError(f"grace={grace!r} is not allowed; use a number of seconds >= 0")
  if not command:
    raise ValueError("no command given; use fp8jax launch -n N -- COMMAND [ARGS...]")
  stop_signal: list[int] = []
  current: list[_Attempt] = []

  def forward(signum, frame):
    stop_signal.append(signum)
    if current:
      current[0].signal_all(signum)

  old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    for attempt in range(max_restarts + 1):
      current[:] = [_Attempt(command, num_processes, attempt)]
      code = _supervise(current[0], grace, stop_signal)
      if code == 0 or stop_signal or attempt == max_restarts:
        return code
      _log(f"restarting all {num_processes} process(es) (restart {attempt + 1} of "
           f"{max_restarts}); the command resumes from its latest checkpoint")
    return code
  finally:
    for s, handler in old.items():
      signal.signal(s, handler)


def _supervise(attempt: _Attempt, grace: float, stop_signal: list) -> int:
  """Waits for the attempt; on the first failure stops the rest. Returns the exit code."""
  while True:
    codes = attempt.codes()
    failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
    if failed and not stop_signal:
      i, c = failed[0]
      t_fail = time.monotonic()
      how = f"was killed by signal {-c}" if c < 0 else f"exited with code {c}"
      _log(f"process {i} {how}; stopping the others (grace {grace:.0f} s)")
      attempt.stop(grace)
      _log(f"all processes stopped {time.monotonic() - t_fail:.1f} s after the failure")
      return _exit_code(c)
    if all(c is not None for c in codes):
      bad = [c for c in codes if c != 0]
      return _exit_code(bad[0]) if bad else 0
    if stop_signal:
      attempt.stop(grace)
      codes = attempt.codes()
      bad = [c for c in codes if c not in (0, None)]
      return _exit_code(bad[0]) if bad else 0
    time.sleep(0.05)


__all__ = ["ENV_COORDINATOR", "ENV_NUM_PROCESSES", "ENV_PROCESS_ID", "ENV_RESTART",
           "launch"]
