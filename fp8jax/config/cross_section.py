"""The whole config (:class:`Config`: the seven sections) and the rules across its sections:
the data fits the model, the layout rules, offload, tensor and pipeline parallelism, gradient
communication, the fused optimizer, the batch ramp (and its arithmetic: microbatches, batch
size and tokens seen per step), and the :data:`NOT_BUILT_YET` table of refused knobs.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from fp8jax.config.sections import (BatchRamp, CheckpointSection, DataSection, Fp8Section,
                                    ModelSection, ParallelSection, RuntimeSection, TrainSection)
from fp8jax.config.validation import _Section, _fail, _levels, _short
from fp8jax.data import BYTE_VOCAB
from fp8jax.models.family import family as model_family
from fp8jax.parallel import layout_rules
from fp8jax.parallel.collectives import GROWTH_INTERVAL
from fp8jax.parallel.layout_rules import Layout
from fp8jax.recipe import OptLevel


# Features that are not built yet: (key path, values that work now, what the other values need).
# A value outside the second column is refused. Remove the line when the feature lands.
NOT_BUILT_YET = (
    ("model.dropout_rate", (0.0, 0), "dropout RNG plumbing in the train step"),
)


@functools.cache
def _ramp_microbatches(ramp: BatchRamp, quantum: int, steps: int) -> np.ndarray:
  """int64[steps]: microbatches of each step 0..steps-1 of `ramp`, rounded down to whole
  microbatches of `quantum` tokens."""
  counts, seen = np.empty(steps, np.int64), 0
  for step in range(steps):
    counts[step] = ramp.tokens_at(step, seen) // quantum
    seen += int(counts[step]) * quantum
  counts.setflags(write=False)
  return counts



def _section(cls):
  return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True)
class Config(_Section):
  """A whole training config; built from YAML by :func:`load_config`."""
  _path = ""
  model: ModelSection = _section(ModelSection)
  data: DataSection = _section(DataSection)
  train: TrainSection = _section(TrainSection)
  fp8: Fp8Section = _section(Fp8Section)
  parallel: ParallelSection = _section(ParallelSection)
  checkpoint: CheckpointSection = _section(CheckpointSection)
  runtime: RuntimeSection = _section(RuntimeSection)

  def _check(self):
    self.check_layout()
    self._check_data_fits_model()
    self._check_offload()
    self._check_tensor_parallel()
    self._check_pipeline_layers()
    self._check_grad_comm()
    self._check_fused_optimizer()
    self._check_rowwise()
    if self.train.batch_ramp is not None:
      self._check_ramp()
    _refuse_unbuilt(self)

  def _check_data_fits_model(self):
    model = self.model.model_config()
    if model is None:  # a builder's model: checked when it runs
      return
    if self.data.seq_len > model.max_seq_len:
      _fail(f"data.seq_len={self.data.seq_len} is larger than "
            f"model.max_seq_len={model.max_seq_len}; use seq_len <= max_seq_len")
    if self.data.byte_level and model.vocab_size < BYTE_VOCAB:
      _fail(f"model.vocab_size={model.vocab_size} is too small for byte-level text "
            f"(data.source={self.data.source!r}); use vocab_size >= {BYTE_VOCAB}")

  def zero_stage(self) -> int:
    """The ZeRO stage the run uses: parallel.zero_stage, at least the level's
    (``OptLevel.zero_stage_for``; O3: 1)."""
    return self.train.level.zero_stage_for(self.parallel.zero_stage)

  def layout(self, devices: int | None = None) -> Layout:
    """The run's layout numbers (``fp8jax.parallel.layout_rules``) on `devices` devices
    (None: not known yet)."""
    p, t = self.parallel, self.train
    model = self.model.model_config()
    return Layout(
        devices=devices, data=p.data_parallel_size, fsdp=p.fsdp_size,
        tensor=p.tensor_parallel_size, pipe=p.pipeline_parallel_size,
        batch_size=t.batch_size, microbatches=t.microbatches, zero_stage=self.zero_stage(),
        grad_comm=self.grad_comm(),
        balanced=p.device_map is not None,
        n_layers=None if model is None else model.n_layers,
        tensor_splits=() if model is None else model_family(self.model.family).tensor_splits(
            model))

  def check_layout(self, devices: int | None = None) -> None:
    """ValueError (one line naming the numbers) when the run's layout on `devices` devices
    breaks a rule of ``fp8jax.parallel.layout_rules``; with `devices` None only the rules
    the config decides by itself. Called when the config is built and again by the run
    once it knows its devices (``fp8jax.train.build.zero_plan``), before any compile."""
    message = layout_rules.check(self.layout(devices))
    if message is not None:
      _fail(message)

  def _check_tensor_parallel(self):
    tp = self.parallel.tensor_parallel_size
    if tp == 1:
      return
    if self.parallel.device_map is not None:
      _fail(f"parallel.tensor_parallel_size={tp} with parallel.device_map is not supported yet "
            "(the balanced step replicates the weights in each group); drop one of them")

  def grad_comm(self) -> str:
    """How the run reduces gradients: "fp8" or "native". "auto" resolves to "native" (the
    faster of the two where measured: benchmarks/README.md, ZeRO and FP8 gradient
    communication)."""
    return "fp8" if self.parallel.grad_comm == "fp8" else "native"

  def grad_comm_growth_interval(self) -> int:
    """Clean steps before automatic scaling doubles the pre-scale (default FP8-LM's,
    ``fp8jax.parallel.collectives.GROWTH_INTERVAL``)."""
    g = self.parallel.grad_comm_growth_interval
    return GROWTH_INTERVAL if g is None else g

  def _check_pipeline_layers(self):
    """An explicit ``parallel.pipeline_layers`` list sums to the model's layers (a builder's
    is checked when its model is built)."""
    layers = self.parallel.pipeline_layers
    if isinstance(layers, str) or self.model.builder is not None:
      return
    n = self.model.model_config().n_layers
    if sum(layers) != n:
      _fail(f"parallel.pipeline_layers={list(layers)} sums to {sum(layers)}, but the model has "
            f"model.n_layers={n}; give counts that sum to {n}")

  def _check_grad_comm(self):
    p = self.parallel
    if p.grad_comm_scaling == "auto" and self.grad_comm() != "fp8":
      _fail(f"parallel.grad_comm_scaling='auto' needs FP8 gradient communication but "
            f"parallel.grad_comm={p.grad_comm!r} (= native); set parallel.grad_comm=fp8, or "
            f"parallel.grad_comm_scaling 'current'")
    if p.grad_comm_growth_interval is not None and p.grad_comm_scaling != "auto":
      _fail(f"parallel.grad_comm_growth_interval={p.grad_comm_growth_interval} only applies "
            f"to parallel.grad_comm_scaling='auto' (this config has "
            f"{p.grad_comm_scaling!r}); set grad_comm_scaling=auto or remove it")
    if p.grad_comm != "fp8":
      return
    if (p.grad_comm_scaling == "auto" and self.zero_stage() == 3
        and self.model.builder is None):
      _fail("parallel.grad_comm_scaling='auto' is not supported at ZeRO-3: the per-group "
            "loop runs layer-major there and reduces each layer's gradients inside the "
            "backward layer scan, where the automatic scaling state (one pre-scale per "
            "leaf, updated after the step) does not flow; use grad_comm_scaling 'current' "
            "(this step's amax: nothing saturates) or zero_stage <= 2")
    why = None
    if not self.train.level.fp8_gemms:
      why = (f"train.opt_level={self.train.opt_level} (BF16 GEMMs: the baseline communicates "
             f"in its own dtype); use level {_levels(lambda level: level.fp8_gemms)}")
    elif p.tensor_parallel_size != 1:
      why = (f"parallel.tensor_parallel_size={p.tensor_parallel_size} (the FP8 gradient step "
             f"replicates the weights in each data-parallel group); use 1")
    elif p.offload_optimizer:
      why = ("parallel.offload_optimizer=True (the FP8 gradient step keeps the optimizer "
             "state on the devices); use false")
    if why is not None:
      _fail(f"parallel.grad_comm='fp8' is not supported with {why}, or "
            f"parallel.grad_comm 'native' / 'auto'")

  def _check_fused_optimizer(self):
    p = self.parallel
    if self.train.fused_optimizer is not True:
      return
    for key, value, ok in (("zero_stage", p.zero_stage, 0), ("offload_optimizer",
                            p.offload_optimizer, False), ("device_map", p.device_map, None),
                           ("grad_comm", self.grad_comm(), "native"),
                           ("tensor_parallel_size", p.tensor_parallel_size, 1),
                           ("pipeline_parallel_size", p.pipeline_parallel_size, 1)):
      if value != ok:
        _fail(f"train.fused_optimizer=True runs on unsharded arrays (one device); "
              f"parallel.{key}={value!r} is not allowed with it; use {ok!r} or "
              f"train.fused_optimizer false")

  def _check_rowwise(self):
    """Row-wise scaling (fp8.granularity=rowwise) at a level with FP8 GEMMs: not with ZeRO-3
    (its weights are gathered as tensor-scaled FP8) nor with fp8.calibrate=always (row-wise
    scales are current: there is nothing to calibrate)."""
    if self.fp8.granularity != "rowwise" or not self.train.level.fp8_gemms:
      return
    if self.zero_stage() == 3:
      _fail("fp8.granularity='rowwise' is not supported with parallel.zero_stage=3 (ZeRO-3 "
            "gathers each weight as one tensor-scaled FP8 cast); use zero_stage <= 2 or "
            "fp8.granularity 'tensor'")
    if self.fp8.calibrate == "always":
      _fail("fp8.calibrate='always' does not apply to fp8.granularity='rowwise' (every row "
            "is scaled by its own current amax: nothing to calibrate); use calibrate auto or "
            "never")

  def _check_offload(self):
    if self.parallel.offload_optimizer and self.parallel.device_map is not None:
      _fail("parallel.offload_optimizer=True with parallel.device_map is not supported yet "
            "(the balanced step keeps the optimizer state on the devices); drop one of them")
    if self.parallel.offload_optimizer and self.zero_stage() == 0:
      _fail("parallel.offload_optimizer=True is not allowed with parallel.zero_stage=0 at "
            f"train.opt_level={self.train.opt_level}; use zero_stage 1, 2 or 3 (or level "
            f"{_levels(lambda level: level.zero_stage > 0)})")

  def _check_ramp(self):
    """Ramp rule: the microbatch shape is fixed (train.batch_size / train.microbatches
    sequences); the ramp changes how many microbatches a step has. So both ends are multiples
    of the microbatch's tokens, and the ramp ends at the configured batch."""
    ramp, end = self.train.batch_ramp, self.train.batch_size * self.data.seq_len
    if ramp.end_tokens != end:
      _fail(f"train.batch_ramp.end_tokens={ramp.end_tokens} is not allowed; the ramp ends at "
            f"the configured batch: train.batch_size={self.train.batch_size} x "
            f"data.seq_len={self.data.seq_len} = {end} tokens")
    quantum = self._microbatch_tokens
    if ramp.start_tokens % quantum:
      _fail(f"train.batch_ramp.start_tokens={ramp.start_tokens} is not a multiple of {quantum} "
            f"tokens, one microbatch (train.batch_size / train.microbatches = "
            f"{self.train.microbatch_size} sequences x data.seq_len={self.data.seq_len}); the "
            f"ramp adds whole microbatches")

  @property
  def _microbatch_tokens(self) -> int:
    return self.train.microbatch_size * self.data.seq_len

  def microbatches_at(self, step: int) -> int:
    """Microbatches in optimizer step `step` (0-based). Without a ramp: train.microbatches.
    With one: tokens grow linearly from start_tokens (step 0) to end_tokens (after
    ramp_steps steps or ramp_tokens tokens seen), rounded down to whole microbatches."""
    ramp, steps = self.train.batch_ramp, self.train.steps
    if ramp is None or step >= steps:
      return self.train.microbatches
    return int(_ramp_microbatches(ramp, self._microbatch_tokens, steps)[max(step, 0)])

  def batch_size_at(self, step: int) -> int:
    """Sequences in optimizer step `step` (0-based); see :meth:`microbatches_at`."""
    return self.microbatches_at(step) * self.train.microbatch_size

  def tokens_seen(self, step: int) -> int:
    """Training tokens in steps 0..step-1."""
    ramp, steps, full = self.train.batch_ramp, self.train.steps, self._microbatch_tokens
    if ramp is None:
      return max(step, 0) * self.train.microbatches * full
    counts = _ramp_microbatches(ramp, full, steps)
    past = max(step - steps, 0) * self.train.microbatches
    return (int(np.sum(counts[:min(max(step, 0), steps)])) + past) * full

  def notices(self) -> list[str]:
    """One line per value the run adjusts instead of refusing (for the start-of-run log):
    a train.warmup_steps longer than the run is clamped to it."""
    t = self.train
    out = []
    if t.warmup_steps > t.steps:
      out.append(f"train.warmup_steps={t.warmup_steps} is longer than the run "
                 f"(train.steps={t.steps}); warmup clamped to {t.warmup_in_run} steps")
    return out

  def level(self) -> OptLevel:
    """The ``fp8jax`` opt level of train.opt_level, its recipe taken from the fp8 section."""
    lvl = self.train.level
    return dataclasses.replace(lvl, recipe=self.fp8.recipe()) if lvl.fp8_gemms else lvl


def _get(cfg: Config, path: str) -> Any:
  value = cfg
  for key in path.split("."):
    value = getattr(value, key)
  return value


def _refuse_unbuilt(cfg: Config) -> None:
  """Raises for the first knob of NOT_BUILT_YET set to a value that does not work yet."""
  for path, works_now, needs in NOT_BUILT_YET:
    value = _get(cfg, path)
    if not any(value == ok and type(value) is type(ok) for ok in works_now):
      _fail(f"{path}={_short(value)} is not supported yet (it needs {needs}); remove it or "
            f"leave the default (works now: {', '.join(map(repr, works_now))})")
