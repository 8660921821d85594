"""A benchmark variant run in its own process (its own peak memory and compile caches): the
script is run again with arguments that make it time one variant and print
``RESULT <json>``."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_isolated(script: str, argv: list[str], label: str) -> dict | None:
  """``python script *argv`` with this checkout on the path; the dict of its ``RESULT``
  line, or None (the failure and the end of its stderr printed under `label`)."""
  env = {**os.environ, "PYTHONPATH": os.pathsep.join(
      filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
  proc = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, env=env)
  line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
  if line is None:
    print(f"{label}: failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
    return None
  return json.loads(line[len("RESULT "):])
