"""Balanced vs uniform microbatches across 2 local CPU processes, one slowed down, with the
step-time prediction (makespan of the measured per-group seconds + the measured fixed cost)
next to the measured step. Runs tests/distributed/hetero_worker.py twice under jax.distributed on
127.0.0.1 (1 CPU device per process). No GPU needed.

  python benchmarks/hetero/balance_cpu.py [--repeats 2,0] [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from fp8jax.parallel import balance  # noqa: E402


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", default="2,0", help="extra passes per microbatch per process")
  parser.add_argument("--steps", type=int, default=5, help="timed steps per split (median)")
  args = parser.parse_args()
  out = tempfile.mkdtemp(prefix="fp8jax-hetero-")
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
         "JAX_PLATFORMS": "cpu", "FP8JAX_COORDINATOR": f"127.0.0.1:{_port()}",
         "FP8JAX_NUM_PROCESSES": "2",
         # One compute thread per process: the two "devices" then do not share cores, as two
         # GPUs would not (else a process alone borrows the other's core and the solo
         # measurements understate the contended step).
         "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
  cmd = [sys.executable, os.path.join(ROOT, "tests", "distributed", "hetero_worker.py"), out, "1,3",
         args.repeats, str(args.steps)]
  procs = [subprocess.Popen(cmd, env={**env, "FP8JAX_PROCESS_ID": str(i)}) for i in range(2)]
  if any(p.wait(timeout=900) for p in procs):
    sys.exit("a worker failed")
  t = json.load(open(os.path.join(out, "timing.json")))
  per_mb = [(t["3,0"] - t["1,0"]) / 2, (t["0,3"] - t["0,1"]) / 2]
  fixed = (t["1,0"] - per_mb[0] + t["0,1"] - per_mb[1]) / 2
  print(f"2 CPU processes, repeats {args.repeats}: seconds per microbatch "
        f"{[round(s * 1e3, 1) for s in per_mb]} ms, fixed {fixed * 1e3:.1f} ms")
  print(f"{'split':>8} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
  for split in ("2,2", "1,3"):
    counts = [int(c) for c in split.split(",")]
    predicted = balance.makespan(counts, per_mb) + fixed
    print(f"{split:>8} {t[split] * 1e3:12.1f} {predicted * 1e3:13.1f} "
          f"{100 * (predicted / t[split] - 1):+6.1f}%")
  best = balance.balance_counts(per_mb, 4)
  print(f"balancer's choice for 4 microbatches: {best}; measured uniform/balanced "
        f"{t['2,2'] / t['1,3']:.2f}x")


if __name__ == "__main__":
  main()
