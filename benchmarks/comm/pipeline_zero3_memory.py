"""Per-device compiled memory of a ZeRO-3 train step inside pipeline stages: each layer gathered
where it runs (fp8jax's steps) against the stage's parameters entering its ``shard_map``
unsharded (how the pipeline steps ran before per-layer gathers), on the uniform pipeline loop
and on pipeline replicas with their own microbatch counts (balanced runs).

  JAX_NUM_CPU_DEVICES=8 python benchmarks/comm/pipeline_zero3_memory.py \
      [--layers 8] [--seq 8] [--level O3]

Pipe 2 x data 4, GPT layers of 512 x 2048 (weights dominate at short sequences), the level's
Adam (FP8/FP16 moments, FP16 master weights at O3); the
uniform loop runs a batch of 16 sequences in 4 microbatches, the replicas counts (1, 3, 0, 2)
of one-sequence microbatches. Bytes are XLA's analysis of the compiled step (temporaries +
arguments + outputs), so any backend with 8 devices answers (CPU: FP8 emulated, a gathered
FP8 weight held as its bytes plus the f32 copy the GEMM multiplies).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from fp8jax import parallel  # noqa: E402
from fp8jax.models.gpt import GPT, ModelConfig  # noqa: E402
from fp8jax.parallel import zero  # noqa: E402
from fp8jax.recipe import opt_level  # noqa: E402
from fp8jax.train.optimizer import make_optimizer  # noqa: E402
from fp8jax.train.state import state_init_fn  # noqa: E402
from fp8jax.train.step import GroupLoop, PipelineLoop, build_step  # noqa: E402

COUNTS = (1, 3, 0, 2)


def compiled_mib(built, abstract, batch) -> float:
  m = built.jitted.lower(abstract, *built.place(batch)).compile().memory_analysis()
  return (m.temp_size_in_bytes + m.argument_size_in_bytes + m.output_size_in_bytes) / 2**20


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--seq", type=int, default=8, help="tokens per sequence")
  p.add_argument("--level", default="O3")
  args = p.parse_args()
  if jax.device_count() < 8:
    sys.exit("needs 8 devices (on CPU: JAX_NUM_CPU_DEVICES=8)")
  cfg = ModelConfig(vocab_size=256, d_model=512, n_layers=args.layers, n_heads=8, d_ff=2048,
                    max_seq_len=max(16, args.seq))
  level = opt_level(args.level)
  model = GPT(cfg, level.recipe)
  tx = make_optimizer(optax.constant_schedule(1e-3), b1=0.9, b2=0.95, eps=1e-8,
                      weight_decay=0.1, clip_norm=1.0, level=level)  # the level's Adam
  abstract = jax.eval_shape(state_init_fn(model, tx, level, 2, args.seq, 0))
  mesh = parallel.make_mesh(data=4, pipe=2, devices=jax.devices()[:8])
  plan = parallel.plan(abstract, mesh, 3, level=level)
  batch = np.zeros((16, args.seq + 1), np.int32)
  loops = {"uniform pipeline": (lambda: PipelineLoop(mesh, model.parts()), 4, batch),
           "pipeline replicas, counts 1,3,0,2": (
               lambda: GroupLoop(mesh, parts=model.parts(), counts=lambda k: COUNTS,
                                 microbatch_size=1, schedule="gpipe"),
               sum(COUNTS), batch[:sum(COUNTS)])}
  per_layer_gather = zero.ZeroPlan.weight_gather
  print(f"| step ({args.layers} layers, {args.seq}-token sequences, {args.level}) | "
        f"per-layer gathers (MiB per device) | stage whole (MiB) |\n|---|---|---|")
  for name, (loop, k, b) in loops.items():
    row = []
    for whole in (False, True):
      # the stage whole: no ZeRO-3 gathering inside the stages (the loops then take the
      # stage's parameters unsharded)
      zero.ZeroPlan.weight_gather = (lambda self, in_stage=False: None) if whole else \
          per_layer_gather
      row.append(compiled_mib(build_step(model.apply, tx, plan, k, loop()), abstract, b))
    zero.ZeroPlan.weight_gather = per_layer_gather
    print(f"| {name} | {row[0]:.1f} | {row[1]:.1f} |")


if __name__ == "__main__":
  main()
