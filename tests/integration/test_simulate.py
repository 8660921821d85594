"""The cost model's per-device memory (fp8jax.parallel.step_memory.device_memory) against the
compiled train step's memory analysis (arguments + outputs + temporaries - aliased) on 8 CPU
devices: ZeRO-3 with per-layer weight gathers (the uniform and the per-group step), and
ZeRO-1 for contrast, at O3, the config read as fp8jax.train.memory reads it.

The model's weights dominate (6 layers of 256 x 1024 SwiGLU, 4.8M parameters; a batch of 8 x
16 tokens: 0.4 MiB of activations), so the comparison checks the state, gradient, decoded
weight and gathered-layer terms, not the activations. XLA's CPU backend differs from the GPU
in three ways, which the test's assumptions say (each measured on another shape, the 8- and
16-layer 512 x 2048 GELU model, compiled the same way):

* the optimizer update keeps 8.3 bytes of temporaries per updated parameter (the compiled
  temporaries grow by 1.42 bytes per parameter per device from 8 to 16 layers at ZeRO-3 over
  8 devices: 11.35 per shard parameter, of which 4 are its f32 gradient; H200: 3);
* an emulated FP8 GEMM widens its weight to f32 (4 bytes; BF16 on an A100);
* the gradient all-reduce works in place (no second buffer; H200: one).
"""
import jax
import numpy as np
import pytest

from fp8jax.config import load_config
from fp8jax.parallel import cost_inputs as ci
from fp8jax.train import build, memory
from fp8jax.train.state import state_init_fn

CPU = ci.Assumptions(update_temp_bytes=8.3, emulated_weight_bytes=4.0,
                     all_reduce_copy_bytes=0.0)
SHAPE = ["model.d_model=256", "model.n_layers=6", "model.n_heads=4", "model.d_ff=1024",
         "model.mlp=swiglu", "model.vocab_size=256", "model.max_seq_len=16", "data.seq_len=16",
         "train.batch_size=8", "model.remat=true", "model.attention_impl=xla",
         "train.opt_level=O3"]


def _compiled_bytes(cfg) -> int:
  """Per-device bytes of the step the Trainer builds for `cfg` on all 8 devices."""
  run = build.run_model(cfg)
  model, _, tx = build.model_and_optimizer(cfg, run)
  t, d = cfg.train, cfg.data
  abstract = jax.eval_shape(state_init_fn(model, tx, cfg.level(), t.microbatch_size,
                                          d.seq_len, 0))
  plan = build.zero_plan(cfg, abstract, run.tensor_rules)
  assert plan.mesh.size == 8
  counts = (lambda k: (k // 8,) * 8) if cfg.parallel.device_map is not None else None
  step = build.StepCache(cfg, tx, plan, counts_fn=counts).get(model, t.microbatches)
  batch = np.zeros((t.batch_size, d.seq_len + 1), np.int32)
  m = step.jitted.lower(abstract, *step.place(batch)).compile().memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
          - m.alias_size_in_bytes)


@pytest.mark.slow
@pytest.mark.xla_cpu_scheduler
def test_device_memory_tracks_the_compiled_step_at_zero3_zero1_and_per_group():
  """Within 15% at both stages (measured: ZeRO-3 15.07 MiB compiled vs 14.82 modelled,
  ZeRO-1 65.23 vs 59.78), and the model's ZeRO-1 / ZeRO-3 ratio within 15% of the
  compiled one (4.3x: ZeRO-3 holds no gathered model). The per-group step at ZeRO-3 (FP8
  gradient communication: shards in, kernels gathered per layer in BF16, f32 decoded weights
  and accumulator shards) within 15% too (measured 24.44 MiB compiled vs 23.43 modelled). The
  config reaches the model through fp8jax.train.memory.step_memory, as choose_auto's
  estimate does."""
  compiled, modelled = {}, {}
  balanced = ["parallel.zero_stage=3", "train.microbatches=8",
              "parallel.device_map={cpu: 1.0}"]  # (1, ..., 1) of one sequence: layer-major
  for name, extra in ((3, ["parallel.zero_stage=3"]), (1, ["parallel.zero_stage=1"]),
                      ("group", ["parallel.zero_stage=3", "parallel.grad_comm=fp8"]),
                      ("balanced", balanced)):
    cfg = load_config(None, SHAPE + extra)
    compiled[name] = _compiled_bytes(cfg)
    modelled[name] = memory.step_memory(cfg, "full", "xla", 8, emulated=True,
                                        assumptions=CPU, slots=1 if name == "balanced" else None)
  print({s: (compiled[s] / 2**20, modelled[s].peak / 2**20) for s in compiled})
  for name in compiled:
    assert abs(modelled[name].peak / compiled[name] - 1) < 0.15, (name, compiled, modelled)
  ratio = (modelled[1].peak / modelled[3].peak) / (compiled[1] / compiled[3])
  assert abs(ratio - 1) < 0.15, (compiled, modelled)
  # the weights dominate: a per-layer gather, not the gathered model, at ZeRO-3
  assert modelled[3].backward["activations"] < 0.05 * modelled[3].peak
  assert compiled[3] < 0.3 * compiled[1] and compiled["group"] < 0.5 * compiled[1]


@pytest.mark.slow
@pytest.mark.xla_cpu_scheduler
def test_device_memory_tracks_the_compiled_step_of_uneven_pipeline_stages():
  """Pipeline stages of unequal depth (parallel.pipeline_layers [2, 6] of 8 layers over 2
  stages x 4 data-parallel ranks, ZeRO-1, GPipe, 4 microbatches): the model's per-device
  bytes (the deepest stage's 6 layers during the step, the stored 4 at rest) within 15% of
  the compiled step's, and the growth over the even split within 15% of the compiled growth
  (measured: even 69.65 MiB compiled vs 67.36 modelled, uneven 92.38 vs 93.39)."""
  shape = [s for s in SHAPE if not s.startswith(("model.n_layers", "train.batch_size"))]
  base = shape + ["model.n_layers=8", "train.batch_size=16", "train.microbatches=4",
                  "parallel.zero_stage=1", "parallel.pipeline_parallel_size=2"]
  compiled, modelled = {}, {}
  for name, extra in (("even", []), ("uneven", ["parallel.pipeline_layers=[2, 6]"])):
    cfg = load_config(None, base + extra)
    compiled[name] = _compiled_bytes(cfg)
    modelled[name] = memory.step_memory(cfg, "full", "xla", 8, emulated=True, assumptions=CPU)
  print({s: (compiled[s] / 2**20, modelled[s].peak / 2**20) for s in compiled})
  assert "padded layers" in modelled["uneven"].backward
  for name in compiled:
    assert abs(modelled[name].peak / compiled[name] - 1) < 0.15, (name, compiled, modelled)
  growth = (modelled["uneven"].peak / modelled["even"].peak) / (
      compiled["uneven"] / compiled["even"])
  assert abs(growth - 1) < 0.15 and compiled["uneven"] > 1.2 * compiled["even"], (
      compiled, modelled)
