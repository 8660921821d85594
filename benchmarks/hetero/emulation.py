"""What emulated FP8 GEMMs cost: the train step at O0, O1 with native FP8 GEMMs and O1 with FP8
GEMMs emulated (the plan of a pre-Ada GPU installed), on one GPU.

  python benchmarks/hetero/emulation.py --config configs/gpt_1_3b.yaml --microbatch 8 \
      [--set model.attention_impl=cudnn] [--steps 5] [--out FILE.json]

Emulated FP8 GEMMs upcast the FP8 values exactly to BF16 and run BF16 tensor-core GEMMs with
f32 accumulation: what an A100 runs in an FP8 run. The ratio emulated / O0 step time is the
cost model's emulated FP8 step-time factor, measured on this GPU. Each row is the median
seconds of a train step of one microbatch (``fp8jax profile``'s measurement).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax  # noqa: E402

from fp8jax.config import load_config  # noqa: E402
from fp8jax import hardware  # noqa: E402
from fp8jax.parallel import capability  # noqa: E402
from fp8jax.train import profile  # noqa: E402


def emulation(args) -> dict:
  rows = {}
  for name, level, emulate in [("O0 (BF16)", "O0", False), ("O1 native FP8", "O1", False),
                               ("O1 emulated FP8", "O1", True)]:
    config = load_config(args.config, args.set + [f"train.opt_level={level}"])
    report = hardware.local_report()
    if emulate:  # what a pre-Ada GPU would run: FP8 values upcast to BF16
      report = report._replace(device_kind="emulated (A100 plan)", compute_capability="8.0")
    hardware.install_plan(capability.decide([report]))
    data = profile.measure(config, [args.microbatch], steps=args.steps)
    hardware.install_plan(None)
    rows[name] = data["points"][0]
    print(f"{name:>18}: {1e3 * rows[name]['seconds']:8.1f} ms/step "
          f"({rows[name]['tokens_per_s']:,.0f} tokens/s)", flush=True)
  base = rows["O0 (BF16)"]["seconds"]
  for name, p in rows.items():
    print(f"{name:>18}: {base / p['seconds']:.3f}x O0")
  return {"config": args.config, "microbatch": args.microbatch,
          "device": jax.devices()[0].device_kind, "rows": rows}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="configs/gpt_1_3b.yaml")
  parser.add_argument("--set", action="append", default=[])
  parser.add_argument("--microbatch", type=int, default=8, help="sequences per microbatch")
  parser.add_argument("--steps", type=int, default=5, help="timed steps (median)")
  parser.add_argument("--out", default=None, help="JSON output path")
  args = parser.parse_args()
  result = emulation(args)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
