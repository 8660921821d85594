"""Scaling run: O0 vs O2 vs O3 at ZeRO 1 and 3 over 1, 2, ... 8 GPUs, then the largest
microbatch each of O0 and O3 fits, with the cost model's prediction beside every row.

  python benchmarks/comm/scaling.py --config configs/gpt_7b.yaml --gpus 1,2,8 \
      [--runs O0:1,O0:3,O2:1,O2:3,O3:1,O3:3] [--microbatch 1] [--steps 5] [--max-microbatch]

Every (level, ZeRO stage, GPU count) runs in its own subprocess on the first N GPUs
(CUDA_VISIBLE_DEVICES) as its own Trainer config, timed by benchmarks/comm/zero_step.py's
run_level (``trainer.step_fn``), the per-GPU microbatch fixed (`--microbatch` sequences per GPU, one
microbatch per step): tokens/s, MFU against the BF16 peak, peak memory per GPU, the bytes the
compiled step's collectives move per GPU (from the optimized HLO), and scaling efficiency
tokens/s(N) / (N x tokens/s(1)). A run that does not fit is reported as OOM.
`--max-microbatch`: for O0 and O3 at ZeRO 3 on all GPUs, doubles the microbatch until it no
longer fits and compares the largest (MS-AMP's larger-batch claim).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def one_run(config: str, level: str, stage: int, microbatch: int, overrides: list[str],
            steps: int) -> dict:
  import jax
  from benchmarks.comm.zero_step import run_level
  from fp8jax.config import load_config
  from fp8jax import hardware
  from fp8jax.train.memory import model_shape
  from fp8jax.parallel import cost_model as cm
  n = len(jax.devices())
  result = run_level(config, level, list(overrides) + [
      f"parallel.zero_stage={stage}", f"train.batch_size={microbatch * n}",
      "train.microbatches=1", "train.warmup_steps=0"], steps, stage=stage)
  cfg = load_config(config, overrides)
  try:
    kind = hardware.gpu_spec(jax.devices()[0].device_kind).name
    p = cm.predict(cm.parse_cluster(f"{n}x{kind}"), model_shape(cfg.model), cfg.data.seq_len,
                   microbatch * n, level, stage, microbatch=microbatch)
    result["predicted_ms"] = 1e3 * p.uniform.step_s if p.uniform.feasible else None
  except ValueError as e:
    result["predicted_ms"] = None
    result["prediction_error"] = str(e)
  return result


def _spawn(args, level, stage, gpus, microbatch) -> dict:
  env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(gpus))),
         "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
  cmd = [sys.executable, __file__, "--one", f"{level}:{stage}:{microbatch}", "--config",
         args.config, "--steps", str(args.steps)] + [x for s in args.set for x in ("--set", s)]
  try:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
  except subprocess.TimeoutExpired:
    return {"level": level, "stage": stage, "gpus": gpus, "microbatch": microbatch,
            "failed": f"timeout after {args.timeout} s"}
  lines = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
  if out.returncode or not lines:
    text = out.stdout[-2000:] + out.stderr[-2000:]
    oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
    return {"level": level, "stage": stage, "gpus": gpus, "microbatch": microbatch,
            "failed": "OOM" if oom else text[-600:]}
  return {**json.loads(lines[-1][len("RESULT "):]), "stage": stage, "gpus": gpus,
          "microbatch": microbatch}


def _row(r, base) -> str:
  if "failed" in r:
    failed = r["failed"] if r["failed"] == "OOM" or r["failed"].startswith("timeout") else "failed"
    return (f"| {r['level']} | {r['stage']} | {r['gpus']} | {r['microbatch']} | "
            f"{failed} | | | | | | |")
  comm = sum(r["collectives"].values()) / 2**20
  eff = "" if base is None else f"{r['tokens_per_s'] / (r['gpus'] * base):.2f}"
  pred = "" if not r.get("predicted_ms") else f"{r['predicted_ms']:.0f}"
  peak = f"{r['peak_mem_gib']:.1f}" if "peak_mem_gib" in r else "n/a"
  mfu = "n/a" if r.get("mfu") is None else f"{r['mfu']:.3f}"
  return (f"| {r['level']} | {r['stage']} | {r['gpus']} | {r['microbatch']} | {r['ms']:.0f} | "
          f"{r['tokens_per_s']:,.0f} | {mfu} | {peak} | {comm:,.0f} | {eff} | {pred} |")


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--config", default=os.path.join(ROOT, "configs", "gpt_7b.yaml"))
  p.add_argument("--gpus", default="1,2,8")
  p.add_argument("--runs", default="O0:1,O0:3,O2:1,O2:3,O3:1,O3:3")
  p.add_argument("--microbatch", type=int, default=1, help="sequences per GPU per step")
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--timeout", type=int, default=300, help="seconds per run")
  p.add_argument("--max-microbatch", action="store_true")
  p.add_argument("--set", action="append", default=[])
  p.add_argument("--out", default=None, help="JSON of every row")
  p.add_argument("--one", help=argparse.SUPPRESS)
  a = p.parse_args()
  if a.one:
    level, stage, mb = a.one.split(":")
    print("RESULT " + json.dumps(one_run(a.config, level, int(stage), int(mb), a.set,
                                          a.steps)), flush=True)
    return
  import jax  # only to count the GPUs (no computation in this process)
  have = len(jax.devices())
  counts = [g for g in map(int, a.gpus.split(",")) if g <= have]
  rows = []
  print("| level | ZeRO | GPUs | mb/GPU | ms/step | tokens/s | MFU | peak GiB/GPU | comm MiB/GPU "
        "| scaling eff. | predicted ms |\n|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True)
  for run in a.runs.split(","):
    level, stage = run.split(":")
    base = None
    for g in counts:
      r = _spawn(a, level, int(stage), g, a.microbatch)
      rows.append(r)
      if g == 1 and "failed" not in r:
        base = r["tokens_per_s"]
      print(_row(r, base), flush=True)
  if a.max_microbatch:
    print("\nlargest microbatch at ZeRO 3 on all GPUs:")
    for level in ("O0", "O3"):
      mb, best = a.microbatch, None
      while True:
        r = _spawn(a, level, 3, counts[-1], mb)
        rows.append(r)
        print(_row(r, None), flush=True)
        if "failed" in r:
          break
        best, mb = r, mb * 2
      if best is not None:
        print(f"{level}: largest microbatch {best['microbatch']}/GPU, "
              f"{best['tokens_per_s']:,.0f} tokens/s", flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  main()
