"""A train step's peak device memory from its config: which terms of the one memory model,
:func:`fp8jax.parallel.step_memory.device_memory`, a :class:`fp8jax.config.Config`'s run has.

``fp8jax.train.build.choose_auto`` compares :func:`run_bytes` (the largest of the run's phases,
:func:`phase_bytes`: the train step, the evaluation step, the FP8 probe) with the device's
memory to choose ``model.remat_policy``; ``fp8jax simulate`` and :mod:`fp8jax.parallel.sizing` read
:func:`model_shape`. The terms (state; the backward's gradients, accumulator, decoded,
gathered and cast weights, activations per remat policy and attention implementation; the
update) are written in ``device_memory``'s and ``step_memory.activation_bytes``' docstrings.
From the config come:

* the ZeRO shards (:func:`data_ranks`: the devices the run spans over its tensor- and
  pipeline-parallel sizes; ``fp8jax.train.build`` counts the devices: one for a run that asks
  for no parallelism);
* the level, the ZeRO stage (``Config.zero_stage``), the microbatches of a step
  (``train.microbatches``; with a batch ramp the step is built for that many) and the
  sequences each device runs per microbatch (:func:`device_sequences`);
* the per-group step (``local_grads``) with ``parallel.device_map`` or FP8 gradient
  communication; the fused O2 update as ``train.fused_optimizer`` takes it on GPUs;
* the layers per pipeline stage (:func:`stage_layers`): every device holds the deepest
  stage's during the step, so the estimate is that stage's. ``parallel.pipeline_layers:
  auto`` with a ``device_map`` splits by the stages' speeds, known only with the mesh:
  ``fp8jax.train.build.choose_auto`` passes the run's split (``build.stage_layers``) as
  `pipeline_layers`; without it the estimate takes the deepest stage that split could give.

The estimates (:func:`step_memory`, :func:`step_bytes`) are bytes per device from an analytic
count (nothing is compiled). They are meant to err high: a wrong estimate should cost a less
saving remat policy, not an out-of-memory step. They are not a bound: over several devices
they can fall below the compiled peak. How they compare with compiled and measured peaks:
benchmarks/RESULTS.md ("The memory estimate against measured peaks");
tests/integration/test_simulate.py checks them against compiled steps on CPU devices.
"""
from __future__ import annotations

import math
from typing import Sequence

import jax
import numpy as np

from fp8jax.models.family import family_of
from fp8jax.parallel import cost_inputs as ci, device_map as device_map_lib, step_memory as sm
from fp8jax.parallel import pipeline as pipeline_lib

REMAT_POLICIES = ci.REMAT_POLICIES
ATTENTION_IMPLS = ci.ATTENTION_IMPLS


def _family_config(model):
  """The family config of a config's model section (itself when already one); ValueError
  for a builder's module, which has none."""
  if not hasattr(model, "model_config"):
    return model
  cfg = model.model_config()
  if cfg is None:
    raise ValueError("the memory model covers the built-in families (model.family gpt or "
                     f"llama); this config's model comes from model.builder={model.builder!r}")
  return cfg


def model_shape(model, remat_policy: str | None = None,
                attention_impl: str | None = None) -> ci.ModelShape:
  """The :class:`fp8jax.parallel.cost_inputs.ModelShape` of a built-in family's config
  (``ModelConfig``, ``LlamaConfig``) or of a config's model section.

  `remat_policy` / `attention_impl` replace the model's; None keeps it, with "auto" read as
  the choice that needs the least memory, "full" remat, and cuDNN flash attention (what
  "auto" takes on the GPUs the cost model covers).
  """
  cfg = _family_config(model)
  fam = family_of(cfg)
  d, v = cfg.d_model, cfg.vocab_size
  matmul = fam.matmul_param_count(cfg)
  # flops_per_token is affine in seq_len: its slope and intercept from two lengths
  per_position = fam.flops_per_token(cfg, 2) - fam.flops_per_token(cfg, 1)
  policy = remat_policy or getattr(cfg, "remat_policy", "full")
  attention = attention_impl or getattr(cfg, "attention_impl", "cudnn")
  return ci.ModelShape(
      n_layers=cfg.n_layers, d_model=d, d_ff=cfg.d_ff, vocab_size=v,
      kernel_params=matmul - (d * v if cfg.tie_embeddings else 0),
      other_params=v * d + cfg.n_layers * 2 * d + d,  # embedding (a lookup) and norms
      matmul_params=matmul, flops_per_token_fixed=fam.flops_per_token(cfg, 1) - per_position,
      flops_per_position=per_position, remat=cfg.remat,
      layer_kernel_params=(matmul - d * v) // cfg.n_layers, embedding_params=v * d,
      gated_mlp=getattr(cfg, "mlp", "swiglu") == "swiglu",
      remat_policy="full" if policy == "auto" else policy,
      compute_bytes=int(np.dtype(cfg.dtype).itemsize), n_heads=cfg.n_heads,
      attention_impl="cudnn" if attention == "auto" else attention)


def data_ranks(config, devices: int = 1) -> int:
  """Data-parallel ranks (the ZeRO shards) of a run of `config` over `devices` devices: the
  devices over the tensor- and pipeline-parallel sizes."""
  p = config.parallel
  return max(devices // (p.tensor_parallel_size * p.pipeline_parallel_size), 1)


def device_sequences(config, devices: int = 1) -> int:
  """Sequences one device runs per microbatch: the microbatch split over the data-parallel
  ranks (:func:`data_ranks`), or whole with ``parallel.device_map``."""
  if config.parallel.device_map is not None:
    return config.train.microbatch_size
  return math.ceil(config.train.microbatch_size / data_ranks(config, devices))


def _fused_update(config, devices: int) -> bool:
  """train.fused_optimizer as ``fp8jax.train.build.fused_update_fn`` resolves it on GPUs."""
  mode = config.train.fused_optimizer
  if mode is True or mode is False:
    return mode
  return config.level().fused_update and devices == 1 and config.zero_stage() == 0


def stage_layers(config, kinds: Sequence[str] | None = None) -> tuple[int, ...] | None:
  """The layers each pipeline stage runs as far as the config (and `kinds`) tell, for a
  memory estimate made without the run's mesh: an explicit ``parallel.pipeline_layers``
  list; None (an even split) with one stage, ``pipeline_layers: even``, or "auto" without a
  ``device_map``.

  With "auto" and a ``device_map`` the run splits the layers by its stages' speeds, which
  depend on which devices each stage gets (the mesh: ``fp8jax.train.build.stage_layers``;
  pass that split as :func:`step_memory`'s `pipeline_layers` where the mesh is known). Without
  the mesh the split is not known, so this is the deepest stage it could give: the split
  (``fp8jax.parallel.pipeline.speed_stage_layers``) of one stage of the fastest of `kinds`
  against stages of the slowest (default `kinds`: the declared ``parallel.device_kinds``,
  else every kind of the ``device_map``). Every device holds the deepest stage's layers
  during the step, so an estimate with this split errs high, never below the run's."""
  p = config.parallel
  spec, stages = p.pipeline_layers, p.pipeline_parallel_size
  if stages == 1:
    return None
  if not isinstance(spec, str):
    return tuple(spec)
  if spec == "even" or p.device_map is None:
    return None
  if kinds is None:
    kinds = (device_map_lib.parse_kinds(p.device_kinds) if p.device_kinds is not None
             else device_map_lib.kinds(p.device_map))
  seconds = device_map_lib.seconds_per_microbatch(p.device_map, sorted(set(kinds)),
                                                  config.train.microbatch_size)
  return pipeline_lib.speed_stage_layers(_family_config(config.model).n_layers,
                                         [min(seconds)] + [max(seconds)] * (stages - 1))


def step_memory(config, remat_policy: str, attention_impl: str, devices: int = 1,
                emulated: bool = False, assumptions: ci.Assumptions = ci.Assumptions(),
                slots: int | None = None,
                pipeline_layers: tuple[int, ...] | None = None) -> sm.DeviceMemory:
  """Bytes on one device of `config`'s train step by term
  (:func:`fp8jax.parallel.step_memory.device_memory`), with remat policy `remat_policy` (not
  "auto") and `attention_impl` ("xla" or "cudnn"), on a run over `devices` devices;
  `emulated`: the devices run FP8 GEMMs emulated (no FP8 tensor cores); `assumptions`: the
  model's constants (the default's are H200 measurements); `slots`: microbatches of the
  busiest rank (default :func:`busiest_count`); `pipeline_layers`: the layers each pipeline
  stage runs (default :func:`stage_layers`: the config's split, or with "auto" and a
  ``device_map`` the deepest stage that split could give)."""
  if remat_policy not in REMAT_POLICIES:
    raise ValueError(f"remat_policy={remat_policy!r} is not allowed; use one of "
                     f"{list(REMAT_POLICIES)}")
  if attention_impl not in ATTENTION_IMPLS:
    raise ValueError(f"attention_impl={attention_impl!r} is not allowed; use one of "
                     f"{list(ATTENTION_IMPLS)}")
  if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
    raise ValueError(f"devices={devices!r} is not allowed; use an integer >= 1")
  p, t = config.parallel, config.train
  split = stage_layers(config) if pipeline_layers is None else tuple(pipeline_layers)
  layout = sm.Layout(data=data_ranks(config, devices), tensor=p.tensor_parallel_size,
                     pipeline=p.pipeline_parallel_size, schedule=p.pipeline_schedule,
                     stage_layers=split)
  shape = model_shape(config.model, remat_policy, attention_impl)
  local = p.device_map is not None or config.grad_comm() == "fp8"
  return sm.device_memory(shape, config.level().name, config.zero_stage(), config.data.seq_len,
                          device_sequences(config, devices), t.microbatches, layout,
                          assumptions, emulated=emulated, local_grads=local,
                          fused_update=_fused_update(config, devices),
                          slots=busiest_count(config, devices) if slots is None else slots)


def busiest_count(config, devices: int = 1) -> int:
  """Microbatches the busiest data-parallel rank runs in a step of `config` over `devices`
  devices: every one (each rank runs its part of each, :func:`device_sequences`), or with
  ``parallel.device_map`` (whole microbatches, counts not known before the devices are)
  twice the even share, at most every microbatch (an estimate that errs high)."""
  ranks, k = data_ranks(config, devices), config.train.microbatches
  if config.parallel.device_map is None:
    return k
  return min(k, 2 * -(-k // ranks))


def step_bytes(config, remat_policy: str, attention_impl: str, devices: int = 1,
               emulated: bool = False, assumptions: ci.Assumptions = ci.Assumptions(),
               pipeline_layers: tuple[int, ...] | None = None) -> float:
  """Estimated peak bytes per device of `config`'s train step: the peak of
  :func:`step_memory` (same arguments)."""
  return float(step_memory(config, remat_policy, attention_impl, devices, emulated,
                           assumptions, pipeline_layers=pipeline_layers).peak)


# The phases of a run besides its optimizer steps run on the train step's memory plan
# (``fp8jax.train.evaluation``): the step's microbatch, remat policy, decoded and gathered
# weights, and no parameter gradient.
PHASES = ("train step", "evaluation", "FP8 probe")


def phase_bytes(config, remat_policy: str, attention_impl: str, devices: int = 1,
                emulated: bool = False, assumptions: ci.Assumptions = ci.Assumptions(),
                pipeline_layers: tuple[int, ...] | None = None) -> dict[str, float]:
  """Estimated peak bytes per device of each phase of a run of `config` (:data:`PHASES`;
  arguments as for :func:`step_memory`):

  * train step: :func:`step_bytes`;
  * evaluation: the state, the step's decoded and gathered weights, and one microbatch's
    forward (one layer's working set and the f32 logits, ``fp8jax.parallel.step_memory.activation_bytes``
    of no saved layers);
  * FP8 probe (cast health and the calibration pass; levels with FP8 GEMMs): the state, the
    step's weights and its activations, without the gradients, their accumulator and the
    once-per-step weight casts.

  Each is the step's state plus a subset of its backward terms: the evaluation and the probe
  never exceed the step in this model (``tests/integration/test_phase_memory.py`` checks the
  compiled programs)."""
  mem = step_memory(config, remat_policy, attention_impl, devices, emulated, assumptions,
                    pipeline_layers=pipeline_layers)
  state, b = sum(mem.state.values()), mem.backward
  weights = sum(b.get(k, 0.0) for k in ("decoded weights", "gathered weights",
                                        "gathered model", "widened FP8 weight"))
  shape = model_shape(config.model, remat_policy, attention_impl)
  forward = sm.activation_bytes(shape, config.data.seq_len, device_sequences(config, devices),
                                config.level().name, config.parallel.tensor_parallel_size,
                                layers=0)
  out = {"train step": float(mem.peak), "evaluation": state + weights + forward}
  if config.level().fp8_gemms:
    out["FP8 probe"] = state + weights + b["activations"]
  return out


def run_bytes(config, remat_policy: str, attention_impl: str, devices: int = 1,
              emulated: bool = False, assumptions: ci.Assumptions = ci.Assumptions(),
              pipeline_layers: tuple[int, ...] | None = None) -> float:
  """Estimated peak bytes per device of a run of `config`: the largest of
  :func:`phase_bytes` (same arguments; with pipeline stages every device holds the deepest
  stage's layers during the step, so this is the busiest stage's)."""
  return max(phase_bytes(config, remat_policy, attention_impl, devices, emulated,
                         assumptions, pipeline_layers=pipeline_layers).values())


def program_bytes(compiled, resident=()) -> int:
  """Bytes per device that `compiled` (a ``jax.stages.Compiled``) needs besides the arrays
  of `resident` (a pytree of its arguments the run holds anyway, e.g. the train state):
  XLA's ``memory_analysis`` temporaries, outputs not aliased to inputs, and the other
  arguments (one device's shard of each array)."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes - device_bytes(resident) + m.output_size_in_bytes
             - m.alias_size_in_bytes + m.temp_size_in_bytes)


def device_bytes(tree) -> int:
  """Bytes that one device holds of the arrays of `tree` (one shard of each; all of a
  replicated one)."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))
