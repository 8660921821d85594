"""A run's pieces from its :class:`fp8jax.config.Config`: the "auto" model settings resolved
for the devices (:func:`resolve_auto`), model, optimizer, mesh, ZeRO plan, the fused update,
the step of each microbatch count, and the evaluation step and FP8 probe on the step's memory
plan (one place for all users: the Trainer, the device profiler, benchmarks)."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import linen, parallel, xla_env
from fp8jax.dot import native_fp8_reason
from fp8jax.parallel.tensor import GPT_RULES
from fp8jax.hardware import DeviceReport, GiB, device_reason, gpu_spec
from fp8jax.models.layers import AUTO, cudnn_attention_reason
from fp8jax.parallel import device_map as device_map_lib
from fp8jax.parallel import pipeline as pipeline_lib
from fp8jax.parallel.capability import gather_reports
from fp8jax.parallel.mesh import PIPE, pipe_size
from fp8jax.parallel.zero import ZeroPlan
from fp8jax.train import memory as memory_lib
from fp8jax.train.evaluation import EvalStep, Probe, build_eval_step, build_probe
from fp8jax.train.memory import run_bytes
from fp8jax.train.optimizer import make_fused_update, make_optimizer, schedule_for
from fp8jax.train.model import RunModel
from fp8jax.train.step import GroupLoop, PipelineLoop, TrainStep, UniformLoop, build_step

AUTO_FIELDS = ("attention_impl", "remat_policy", "scan_layers")
# Share of a device's memory (the allocator's limit) a step chosen by resolve_auto may fill.
MEMORY_FRACTION = 0.9
# XLA's default share of GPU memory for its allocator (XLA_PYTHON_CLIENT_MEM_FRACTION), for
# GPUs that report no limit.
CLIENT_MEMORY_FRACTION = 0.75
# Unrolled layers compile about linearly longer (1.3B, 24 layers, O2: ~50 s vs 9 s scanned).
UNROLL_MAX_LAYERS = 48


class AutoChoice(NamedTuple):
  """What :func:`choose_auto` gives a config's "auto" model settings, and why.

  Attributes:
    settings: {model field: value} for each field of :data:`AUTO_FIELDS` that was "auto".
    reasons: {model field: why that value}, same keys.
    notes: further lines for the run's start log (the XLA flags fp8jax set, on GPUs).
  """

  settings: dict[str, Any]
  reasons: dict[str, str]
  notes: tuple[str, ...] = ()

  def apply(self, config):
    """`config` with :attr:`settings` in its model section."""
    if not self.settings:
      return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                 **self.settings))

  def lines(self) -> list[str]:
    """The run's start-log lines: one naming every chosen setting and why (none when nothing
    was "auto"), then :attr:`notes`."""
    chosen = "; ".join(f"model.{name}={value} ({self.reasons[name]})"
                       for name, value in self.settings.items())
    return ([f"auto settings: {chosen}"] if chosen else []) + list(self.notes)


def run_reports(devices: Sequence[DeviceReport] | None = None) -> tuple[DeviceReport, ...]:
  """`devices` (one report per process), or every process's report of its local devices
  (``fp8jax.parallel.capability.gather_reports``: a collective when there are several
  processes, so all of them call it)."""
  if devices is None:
    return gather_reports()
  reports = tuple(devices)
  if not reports or not all(isinstance(r, DeviceReport) for r in reports):
    raise ValueError(f"devices={devices!r} is not allowed; use DeviceReports, one per process "
                     "(fp8jax.hardware.local_report), or None for this run's devices")
  return reports


def _usable_bytes(report: DeviceReport) -> float | None:
  """MEMORY_FRACTION of the memory one device of `report` lets the allocator use (XLA's
  default share of the kind's memory where the runtime reports none); None if unknown."""
  memory = report.memory_bytes
  if memory is None:
    try:
      memory = gpu_spec(report.device_kind).hbm_bytes * CLIENT_MEMORY_FRACTION
    except ValueError:
      return None
  return MEMORY_FRACTION * memory


def _policy_candidates(config) -> tuple[str, ...]:
  """Remat policies from least to most recomputation: saving the FP8 input casts pays at
  levels with FP8 GEMMs; at O0 saving the bf16 inputs did not (benchmarks/RESULTS.md)."""
  if config.level().fp8_gemms:
    return ("save_gemm_io", "save_gemm_outputs", "full")
  return ("save_gemm_outputs", "full")


def estimate_stage_layers(config, reports: Sequence[DeviceReport], mesh=None
                          ) -> tuple[int, ...] | None:
  """The layers per pipeline stage the memory estimate of :func:`choose_auto` takes (None:
  an even split): on `mesh` (the run's), the split the run will use (:func:`stage_layers`);
  without it, as ``fp8jax.train.memory.stage_layers`` bounds it from the kinds of `reports`
  (or the declared ``parallel.device_kinds``): the deepest stage the "auto" split could give,
  which only "auto" with a ``device_map`` leaves open."""
  p = config.parallel
  if mesh is not None and p.pipeline_parallel_size > 1:
    return stage_layers(config, mesh, config.model.model_config().n_layers)
  kinds = None if p.device_kinds is not None else [r.device_kind for r in reports]
  return memory_lib.stage_layers(config, kinds)


def _split_needs_mesh(config) -> bool:
  """Whether the layers per pipeline stage of `config`'s run depend on its mesh ("auto" with
  a ``device_map`` and several stages)."""
  p = config.parallel
  return (p.pipeline_parallel_size > 1 and p.pipeline_layers == "auto"
          and p.device_map is not None)


def _choose_policy(config, attention_impl: str, reports, mesh=None) -> tuple[str, str]:
  """(remat policy, why) for a GPU run: the least recomputing policy whose estimated run
  (``fp8jax.train.memory.run_bytes``: the train step, evaluation and FP8 probe of the busiest
  pipeline stage, its layers per stage from :func:`estimate_stage_layers` on `mesh`; FP8
  emulated where a device lacks FP8 GEMMs) fits the smallest device's usable memory."""
  if not config.model.remat:
    return "full", "remat is off: no policy applies"
  usable = [_usable_bytes(r) for r in reports]
  if any(u is None for u in usable):
    return "full", "device memory unknown"
  usable_min = min(usable)
  devices = _run_device_count(config, reports)
  emulated = config.level().fp8_gemms and any(device_reason(r) for r in reports)
  split = estimate_stage_layers(config, reports, mesh)
  stages = "" if split is None else f" (deepest pipeline stage: {max(split)} layers)"
  estimate = 0.0
  for policy in _policy_candidates(config):
    estimate = run_bytes(config, policy, attention_impl, devices, emulated,
                         pipeline_layers=split)
    if estimate <= usable_min:
      return policy, (f"estimated {estimate / GiB:.1f} GiB per device{stages} of "
                      f"{usable_min / GiB:.1f} GiB usable")
  return "full", (f"estimated {estimate / GiB:.1f} GiB per device{stages} even with full "
                  f"remat, {usable_min / GiB:.1f} GiB usable")


def choose_auto(config, devices: Sequence[DeviceReport] | None = None, mesh=None
                ) -> AutoChoice:
  """The values of `config`'s "auto" model settings on `devices` (one
  :class:`fp8jax.hardware.DeviceReport` per process; None: this run's, gathered from every
  process by :func:`run_reports`, so all processes call it). Every process gets the same
  choice from the same reports. `mesh`: the run's mesh, which fixes the layers per pipeline
  stage of ``parallel.pipeline_layers: auto`` with a ``device_map``; None: with `devices`
  None this run's (``parallel.mesh_from_config`` of :func:`run_devices`, as
  :func:`zero_plan` builds it), else unknown (the memory estimate then takes the deepest
  stage that split could give, :func:`estimate_stage_layers`).

  * attention_impl: "cudnn" where every process's devices run cuDNN flash attention for the
    model's shape and dtype (``fp8jax.models.layers.cudnn_attention_reason``), else "xla".
  * remat_policy: on GPUs with remat on, the first of save_gemm_io (levels with FP8 GEMMs),
    save_gemm_outputs, full whose estimated run memory (``fp8jax.train.memory``; with
    pipeline stages the busiest stage's, at the layers per stage the run will use) fits
    :data:`MEMORY_FRACTION` of the smallest device memory; "full" elsewhere.
  * scan_layers: on GPUs, False (unrolled) for at most :data:`UNROLL_MAX_LAYERS` layers when
    remat is off or keeps more than the layer inputs (unrolled layers with full remat ran
    slower than the scan); True elsewhere.
  """
  m = config.model
  auto = [name for name in AUTO_FIELDS if getattr(m, name) == AUTO]
  reports = run_reports(devices)
  gpu = all(r.platform == "gpu" for r in reports)
  line = xla_env.applied_line() if gpu else None
  notes = (line,) if line else ()
  model_config = m.model_config()  # the family's (with init_from: the checkpoint's shape)
  if not auto or model_config is None:  # (a builder's module has no such settings)
    return AutoChoice({}, {}, notes)
  where = ", ".join(sorted({r.device_kind for r in reports}))
  values, reasons = {}, {}
  attention = m.attention_impl
  if attention == AUTO:
    why_not = [w for w in (cudnn_attention_reason(model_config, r) for r in reports) if w]
    attention = "xla" if why_not else "cudnn"
    values["attention_impl"] = attention
    reasons["attention_impl"] = why_not[0] if why_not else f"cuDNN flash attention on {where}"
  policy = m.remat_policy
  if policy == AUTO:
    if gpu:
      if mesh is None and devices is None and _split_needs_mesh(config):
        mesh = parallel.mesh_from_config(config.parallel, run_devices(config))
      policy, why = _choose_policy(config, attention, reports, mesh)
    else:
      policy, why = "full", f"on {where}"
    values["remat_policy"], reasons["remat_policy"] = policy, why
  if m.scan_layers == AUTO:
    if not gpu:
      scan, why = True, f"on {where}"
    elif model_config.n_layers > UNROLL_MAX_LAYERS:
      scan, why = True, f"{model_config.n_layers} layers > {UNROLL_MAX_LAYERS}: compile time"
    elif m.remat and policy == "full":
      scan, why = True, "full remat runs faster scanned"
    else:
      scan = False
      why = "unrolled: remat is off" if not m.remat else f"unrolled: remat policy {policy}"
    values["scan_layers"], reasons["scan_layers"] = scan, why
  return AutoChoice({k: values[k] for k in auto}, {k: reasons[k] for k in auto}, notes)


def resolve_auto(config, devices: Sequence[DeviceReport] | None = None, mesh=None):
  """`config` with its "auto" model settings replaced by :func:`choose_auto`'s values for
  `devices` and `mesh` (None: this run's); a config without "auto" comes back unchanged."""
  return choose_auto(config, devices, mesh).apply(config)


def run_model(config) -> RunModel:
  """The config's model (family, Hugging Face checkpoint or builder) for its microbatches."""
  return RunModel(config, config.train.microbatch_size, config.data.seq_len)


def model_and_optimizer(config, run: RunModel | None = None):
  """(the model at the config's level, learning-rate schedule, optax optimizer with
  clipping); `run`: the config's :func:`run_model` when already built."""
  level, t = config.level(), config.train
  model = (run or run_model(config)).for_recipe(level.recipe)
  schedule = schedule_for(config)
  tx = make_optimizer(schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
                      clip_norm=t.gradient_clipping, level=level)
  return model, schedule, tx


def calibration_on(config) -> bool:
  """fp8.calibrate resolved: whether steps after the first run ``Recipe(calibrated=True)``
  (delayed scaling at an FP8 level; auto: where FP8 GEMMs are native)."""
  recipe, mode = config.level().recipe, config.fp8.calibrate
  if recipe is None or recipe.scaling != "delayed" or mode == "never":
    return False
  return mode == "always" or native_fp8_reason() is None


def weight_cast_fn(config, model, microbatches: int) -> Callable | None:
  """fp8.cast_weights_once resolved for a step of `microbatches`: ``variables -> {collection:
  FP8 weight casts}`` (``fp8jax.linen.cast_weights`` with `model`'s recipe and compute dtype)
  to cast every weight once for all microbatches; None at O0, with one microbatch (the model
  casts once anyway), with pipeline stages (each stage's GEMMs cast their weights per
  microbatch), with row-wise scaling (each GEMM casts its weight per column and per row
  itself) or with the option off."""
  if (not config.fp8.cast_weights_once or getattr(model, "recipe", None) is None
      or model.recipe.rowwise
      or microbatches < 2  # (a builder's converted module casts per microbatch)
      or config.parallel.pipeline_parallel_size > 1):  # (each stage casts its own layers)
    return None
  return functools.partial(linen.cast_weights, recipe=model.recipe,
                           dtype=jnp.dtype(model.config.dtype))


def _runs_on_one_device(config, processes: int) -> bool:
  """Whether a run of `config` over `processes` processes uses one device (see
  :func:`run_devices`)."""
  p = config.parallel
  return (config.zero_stage() == 0 and processes == 1 and p.device_map is None
          and p.data_parallel_size in (-1, 1) and p.fsdp_size == 1
          and p.tensor_parallel_size == 1 and p.pipeline_parallel_size == 1
          and config.grad_comm() == "native")


def _run_device_count(config, reports: Sequence[DeviceReport]) -> int:
  """How many devices a run of `config` spans on the processes of `reports`."""
  return run_device_count(config, sum(r.device_count for r in reports), len(reports))


def run_device_count(config, devices: int, processes: int = 1) -> int:
  """How many devices a run of `config` spans when `processes` processes hold `devices`
  devices in all: 1 for a single-process run that asks for no parallelism (see
  :func:`run_devices`), else `devices`."""
  return 1 if _runs_on_one_device(config, processes) else devices


def run_devices(config) -> list | None:
  """The devices a run's mesh spans: one (the first) for a single-process run that asks for
  no parallelism (ZeRO stage 0, no sizes set, no device_map, native gradient communication),
  else None: every process's devices."""
  return jax.devices()[:1] if _runs_on_one_device(config, jax.process_count()) else None


def check_layout(config) -> None:
  """ValueError (one line naming the numbers) when the config's layout does not fit this
  run's devices (:func:`run_devices`): ``Config.check_layout``, every rule of
  ``fp8jax.parallel.layout_rules``. Pure: nothing is compiled or placed."""
  config.check_layout(run_device_count(config, jax.device_count(), jax.process_count()))


def zero_plan(config, abstract_state, tensor_rules: Sequence = GPT_RULES) -> ZeroPlan:
  """Where `abstract_state` lives on the config's mesh (:func:`run_devices`; one device is a
  mesh of one) and how its step gathers and reduces (``fp8jax.parallel.plan``; the model's
  `tensor_rules`). ValueError when the layout does not fit the devices
  (:func:`check_layout`)."""
  p = config.parallel
  check_layout(config)
  mesh = parallel.mesh_from_config(p, run_devices(config))
  return parallel.plan(abstract_state, mesh, config.zero_stage(), level=config.level(),
                       offload=p.offload_optimizer, reduce_bucket_size=p.reduce_bucket_size,
                       allgather_bucket_size=p.allgather_bucket_size,
                       tensor_rules=tensor_rules)


def fused_update_fn(config, schedule, plan: ZeroPlan) -> Callable | None:
  """train.fused_optimizer resolved: the fused O2 update (one kernel per tensor) or None.
  It runs on unsharded arrays: one device, ZeRO stage 0, FP16 master weights; ``auto`` takes
  it there on GPUs. ValueError when ``true`` is asked for elsewhere."""
  t, level = config.train, config.level()
  single = plan.mesh.size == 1 and plan.stage == 0
  if t.fused_optimizer is True and not single:
    raise ValueError("train.fused_optimizer=True runs on one device (unsharded arrays); this "
                     f"run has {parallel.describe(plan.mesh)}, ZeRO stage {plan.stage}; use "
                     "train.fused_optimizer false or one device")
  use = t.fused_optimizer is True or (t.fused_optimizer == "auto" and level.fused_update
                                      and single and jax.default_backend() == "gpu")
  if not use:
    return None
  return make_fused_update(schedule, b1=t.b1, b2=t.b2, eps=t.eps,
                           weight_decay=t.weight_decay, clip_norm=t.gradient_clipping)


def pipeline_loop(config, plan: ZeroPlan, model) -> PipelineLoop | None:
  """The pipeline loop of a run with ``parallel.pipeline_parallel_size`` > 1 (`model` cut
  into its parts, the configured schedule on the plan's mesh); None without stages."""
  if config.parallel.pipeline_parallel_size == 1:
    return None
  t = config.train
  if not callable(getattr(model, "parts", None)):
    raise ValueError(
        f"parallel.pipeline_parallel_size={config.parallel.pipeline_parallel_size} with "
        f"model.builder={config.model.builder!r}: the pipeline cuts the model into embedding, "
        f"layer stack and head, and this {type(model).__name__} has no parts(); give the linen "
        f"module embed/blocks/head methods, an nn.scan named 'layers' and parts() returning "
        f"fp8jax.models.StackParts (docs/models.md), or use pipeline_parallel_size 1")
  parts = model.parts()
  return PipelineLoop(plan.mesh, parts, config.parallel.pipeline_schedule,
                      microbatch_size=t.microbatch_size, dynamic=t.batch_ramp is not None,
                      matrix_dtype=matrix_dtype(config),
                      stage_layers=stage_layers(config, plan.mesh, parts.n_layers))


def stage_seconds(config, mesh) -> list[float]:
  """Relative seconds per layer of each pipeline stage of `mesh`: its slowest device's, from
  ``parallel.device_map`` and the devices' kinds (``parallel.device_kinds`` if declared)."""
  devices = np.moveaxis(mesh.devices, mesh.axis_names.index(PIPE), 0)
  p = config.parallel
  out = []
  for stage in devices:
    kinds = device_map_lib.declared_kinds(p.device_kinds, list(stage.flat), jax.devices())
    out.append(max(device_map_lib.seconds_per_microbatch(p.device_map, kinds,
                                                         config.train.microbatch_size)))
  return out


def stage_layers(config, mesh, n_layers: int) -> tuple[int, ...] | None:
  """The layers each pipeline stage runs (``parallel.pipeline_layers``): a configured list
  (checked against `n_layers`), or with "auto" and a ``device_map`` whose stages differ in
  speed, `n_layers` split in proportion to their speeds
  (``fp8jax.parallel.pipeline.speed_stage_layers``); None: an even split."""
  spec, stages = config.parallel.pipeline_layers, pipe_size(mesh)
  if not isinstance(spec, str):
    return pipeline_lib.check_stage_layers(tuple(spec), stages, n_layers)
  if spec == "even" or config.parallel.device_map is None:
    return None
  return pipeline_lib.speed_stage_layers(n_layers, stage_seconds(config, mesh))


def step_loop(config, plan: ZeroPlan, model, microbatches: int,
              counts_fn: Callable[[int], Sequence[int]] | None = None):
  """The microbatch loop of a run's step of `microbatches` microbatches: the per-group loop
  (`counts_fn`, balanced runs; or FP8 gradient communication; layer-major at ZeRO-3 for a
  model with ``parts()``; with pipeline stages its groups are pipeline replicas), the
  pipeline's (stages), else the uniform loop."""
  c, t = config, config.train
  pipeline = pipeline_loop(c, plan, model)
  per_group = counts_fn is not None or c.grad_comm() == "fp8"
  if pipeline is not None and not per_group:
    return pipeline
  dynamic = t.batch_ramp is not None
  if per_group:  # (with stages: the groups are pipeline replicas)
    return GroupLoop(plan.mesh, grad_comm=c.grad_comm(),
                     comm_scaling=c.parallel.grad_comm_scaling,
                     growth_interval=c.grad_comm_growth_interval(),
                     parts=model.parts() if callable(getattr(model, "parts", None)) else None,
                     layer_stacks=tuple(getattr(model, "layer_stacks", ())), counts=counts_fn,
                     microbatch_size=t.microbatch_size, dynamic=dynamic,
                     schedule=None if pipeline is None else pipeline.schedule,
                     stage_layers=None if pipeline is None else pipeline.stage_layers)
  return UniformLoop(t.microbatch_size, dynamic, weight_cast_fn(c, model, microbatches),
                     matrix_dtype(c))


def matrix_dtype(config) -> str | None:
  """The dtype a run's steps decode FP16 master GEMM weights to: the model's compute dtype
  (None for a builder's module: decoded to f32)."""
  return config.model.dtype if config.model.builder is None else None


def eval_step(config, plan: ZeroPlan, model, name: str = "eval_step") -> EvalStep:
  """The run's evaluation step on the train step's memory plan
  (``fp8jax.train.evaluation.build_eval_step``): up to ``train.microbatches`` microbatches of
  ``train.microbatch_size`` sequences per call, `model` applied as the step applies it;
  `name`: the program's name."""
  t = config.train
  return build_eval_step(model.apply, plan, t.microbatches, t.microbatch_size,
                         balanced=config.parallel.device_map is not None,
                         pipeline=pipeline_loop(config, plan, model),
                         matrix_dtype=matrix_dtype(config), name=name)


def fp8_probe(config, plan: ZeroPlan, model, health: bool) -> Probe:
  """The run's FP8 probe on one train-step microbatch (``fp8jax.train.evaluation.
  build_probe``: cast health when `health`, calibrated scales) of `model` (the uncalibrated
  model). With pipeline stages it runs through the stages as the step runs them (each stage
  its own layers: no more memory than the step). With `health` it is the run's cast-health
  probe; without, its calibration pass (a smaller program, compiled before the first step,
  while the health probe compiles at its first use)."""
  t = config.train
  pipeline = pipeline_loop(config, plan, model)
  return build_probe(model, plan, t.microbatches, t.microbatch_size, health=health,
                     balanced=config.parallel.device_map is not None, pipeline=pipeline,
                     matrix_dtype=matrix_dtype(config))


class StepCache:
  """The run's compiled train steps: one per model, or one per (model, microbatch count) when
  the count is fixed per step.

  With a batch ramp (``train.batch_ramp``) the step is dynamic (its loop's ``dynamic``,
  :func:`step_loop`): the microbatch count is data, so every step of the ramp runs one compiled
  program built for the largest count.

  Args:
    config: the run's config (gradient communication, weight casts, compute dtype, ramp).
    tx: the optimizer; plan: the ZeRO plan; fused_update: from :func:`fused_update_fn`.
    counts_fn: optional ``microbatches -> counts per data-parallel group`` (balanced runs,
      ``parallel.device_map``); None: every group runs every microbatch.
    saved: optional ``(step, model, microbatches) -> step`` applied to each step built (the
      trainer's program cache, ``fp8jax.train.program_cache``).
  """

  def __init__(self, config, tx, plan: ZeroPlan, fused_update: Callable | None = None,
               counts_fn: Callable[[int], Sequence[int]] | None = None,
               saved: Callable[[TrainStep, Any, int], TrainStep] | None = None):
    self.config, self.tx, self.plan = config, tx, plan
    self.fused_update, self.counts_fn, self.saved = fused_update, counts_fn, saved
    self.dynamic = config.train.batch_ramp is not None
    self._steps: dict = {}

  def get(self, model, microbatches: int) -> TrainStep:
    """The jitted step of `model` that runs steps of `microbatches` microbatches (built
    once; with a ramp, one step for every count up to ``train.microbatches``)."""
    c = self.config
    if self.dynamic:
      if not 1 <= microbatches <= c.train.microbatches:
        raise ValueError(f"a step of {microbatches} microbatches is outside the ramp's 1.."
                         f"{c.train.microbatches}")
      microbatches = c.train.microbatches
    key = (id(model), microbatches)
    if key not in self._steps:
      loop = step_loop(c, self.plan, model, microbatches, self.counts_fn)
      step = build_step(model.apply, self.tx, self.plan, microbatches, loop,
                        fused_update=self.fused_update)
      if self.saved is not None:
        step = self.saved(step, model, microbatches)
      self._steps[key] = (model, step)
    return self._steps[key][1]

  def built(self) -> list[tuple]:
    """(model, microbatches) of every step built so far (with a ramp: the largest count)."""
    return [(m, k[1]) for k, (m, _) in self._steps.items()]
