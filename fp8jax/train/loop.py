"""The Trainer: a config -> model, data, optimizer and sharded state -> steps with validation,
logs, checkpoints and guards.

Setup (``Trainer.__init__``): the config's layout checked against the devices
(``build.check_layout``: one-line refusals before data or compiles), its "auto" model
settings resolved for the devices (``build.choose_auto``), the config's model and optimizer
(``fp8jax.train.build``), the agreed FP8 capability of every process, the abstract state
(``jax.eval_shape``), its ZeRO plan on the config's mesh (one device is a mesh of one), then
the state initialised straight into its shardings. Every step, whatever the layout, comes from
``build.StepCache`` (one builder: ``fp8jax.train.step.build_step``); evaluation, the FP8
calibration pass and the FP8 cast-health probe run on the step's memory plan
(``fp8jax.train.evaluation``).

:meth:`Trainer.run` starts the run (the run folder claimed, the config saved, a checkpoint
resumed, the logs opened, the first step's programs compiled) and runs the loop: each step,
then what is due after it (``Trainer._due``: the guards' read, the log window, the FP8 health
probe, the evaluation, the checkpoint, a preemption stop). The log window's clock (tokens/s)
leaves out the evaluation and the compiles of programs at their first use (the health probe,
the guards' BF16 loss); their running time counts as a cost of training. Out of device
memory in any phase ends it with ``fp8jax.train.oom.OutOfMemory``, except in the two
monitors a run has by default (the FP8 cast-health probe and the FP8-BF16 loss gap): the
monitor is switched off with a one-line warning and training goes on (single-process runs).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from typing import Any, Callable

import flax.linen as nn
import jax
import numpy as np

from fp8jax import data as data_lib
from fp8jax import optim as fp8_optim
from fp8jax.config import Config, config_to_dict, save_config
from fp8jax.dot import native_fp8_reason
from fp8jax.parallel import balance, capability, layout, pipeline
from fp8jax.parallel import device_map as device_map_lib
from fp8jax.train import build, compiles, guards, memory, oom, program_cache, startup
from fp8jax.train import metrics as metrics_lib
from fp8jax.train.calibration import Calibration
from fp8jax.train.compiles import use_compile_cache
from fp8jax.train.fallback import Bf16Loss, record_fallback
from fp8jax.train.model import describe_conversion
from fp8jax.train.progress import ProgressBar
from fp8jax.train.resume import (RunCheckpoints, RunRecords, check_same_data, claim_run_dir,
                                 corpus_record, records_of, saved_fallback, stopped_line)
from fp8jax.train.state import load_params, state_init_fn
from fp8jax.train.startup import StartupClock
from fp8jax.train.step import TrainStep

logger = logging.getLogger("fp8jax")


class Trainer:
  """Trains the reference decoder as `config` says, over every device of the run (the mesh
  of ``parallel``, ZeRO stage ``config.zero_stage()``). `progress`: a progress bar on a
  terminal (log lines otherwise, ``fp8jax.train.progress``); `overwrite`: replace an earlier
  run in the run folder instead of refusing to mix with it (``resume.claim_run_dir``)."""

  def __init__(self, config: Config, progress: bool = True, overwrite: bool = False):
    self.startup = StartupClock()  # the first step's wait counts from here
    self.progress, self.overwrite = progress, overwrite
    with self.startup.phase(startup.SETUP):
      self._set_up(config)
    with self.startup.phase(startup.DATA):
      d = self.config.data
      vocab = getattr(self.model_config, "vocab_size", None)
      self.data = data_lib.load_data(d.source,
                                     val_fraction=d.val_fraction, max_bytes=d.max_bytes,
                                     vocab_size=vocab, tokenizer=d.tokenizer,
                                     cache_dir=d.cache_dir, progress=None if progress else False)
      self.train_batches = self.data.batches("train", self.config.train.microbatch_size,
                                             d.seq_len, seed=d.seed)
    with self.startup.phase(startup.STATE):
      self._init_state()
    with self.startup.phase(startup.SETUP):
      self._build_run()

  def _set_up(self, config: Config) -> None:
    """Checks the layout, opens the compilation cache, applies the ``auto`` settings, builds
    the model and optimizer."""
    build.check_layout(config)  # before reading data or compiling anything
    # before the first compile: every program of the run is read from / written to the cache
    self.compile_cache = use_compile_cache(config.runtime.compile_cache)
    self.auto = build.choose_auto(config)  # "auto" model settings for these devices
    config = self.auto.apply(config)
    self.config = config
    self.level = config.level()
    self.run_model = build.run_model(config)
    self.model_config = self.run_model.model_config  # the family's config (None: a builder)
    self._model, self.schedule, self.tx = build.model_and_optimizer(config, self.run_model)

  def _init_state(self) -> None:
    """Agrees on the FP8 capability, plans the ZeRO shardings and initialises the state in
    them (with ``model.init_from``: its weights)."""
    config, t, d = self.config, self.config.train, self.config.data
    self.capability = capability.agree(config.parallel.fp8_capability)
    init = state_init_fn(self._model, self.tx, self.level, t.microbatch_size, d.seq_len, t.seed,
                         comm_scaling=config.parallel.grad_comm_scaling == "auto")
    self.plan = build.zero_plan(config, jax.eval_shape(init), self.run_model.tensor_rules)
    self.checkpoints = None
    self._phase = oom.INIT
    with self._out_of_memory_diagnosed():
      self.state = jax.jit(init, out_shardings=self.plan.state)()  # no unsharded copy
      pretrained = self.run_model.pretrained_params()
      if pretrained is not None:  # model.init_from: its weights, into the plan's shardings
        self.state = load_params(self.state, pretrained, self.level, self.plan.state.params)

  def _build_run(self) -> None:
    """The run's programs, checkpoints, guards and metric writer."""
    config = self.config
    self.group_seconds = self._group_seconds()  # None: uniform split (no device_map)
    self._programs: program_cache.ProgramCache | None = None  # (:meth:`_program_cache`)
    self._fused_update = build.fused_update_fn(config, self.schedule, self.plan)
    self._build_programs(self.level.recipe, calibrate=build.calibration_on(config))
    self.run_dir = config.runtime.run_path
    self.flops_per_token = self.run_model.flops_per_token
    self.fp8_peak = self.level.fp8_gemms and native_fp8_reason() is None
    self.checkpoints = (RunCheckpoints(config, self.run_dir) if config.checkpoint.enabled
                        else None)
    r = config.runtime
    self.skips = guards.SkipCounter(r.max_consecutive_skips)
    self.watchdog = guards.DivergenceWatchdog(
        r.divergence_check_every if self.level.fp8_gemms else 0, r.divergence_threshold)
    self.fallback_reason: str | None = None
    self._loss_gap_on = True  # (off after it ran out of device memory)
    # (step, metrics) of the steps whose skip flags and losses the guards have not read yet
    self._unchecked_metrics: list[tuple[int, dict]] = []
    bf16 = self.run_model.for_recipe(None)
    self._bf16_loss = Bf16Loss(self._kept(build.eval_step(config, self.plan, bf16, "bf16_loss"),
                                          "bf16_loss", bf16))
    self.writer: metrics_lib.MetricWriter | metrics_lib.NullWriter = metrics_lib.NullWriter()

  def _build_programs(self, recipe, calibrate: bool) -> None:
    """Builds what runs the model with `recipe`'s GEMMs (None: BF16): the calibration
    (``fp8.calibrate``: its pass, a probe without cast health), the train steps, the
    evaluation step and the FP8 cast-health probe, all on the train step's memory plan."""
    first = self.run_model.for_recipe(recipe)
    steady = self.run_model.for_recipe(recipe.replace(calibrated=True)) if calibrate else None
    self.calibration = Calibration(first, steady)
    self.steps = build.StepCache(
        self.config, self.tx, self.plan, self._fused_update,
        self.balanced_counts if self.group_seconds is not None else None,
        saved=lambda step, model, k: self._kept(step, "train_step", model, k,
                                                donate_argnums=(0,)))
    self._eval = self._kept(build.eval_step(self.config, self.plan, self.calibration.model),
                            "eval_step", self.calibration.model)
    self.health_on = self._health_on(recipe, first)
    self._probe = (self._kept(build.fp8_probe(self.config, self.plan, first, health=True),
                              "fp8_probe", first) if self.health_on else None)
    self._calibrate = (
        self._kept(build.fp8_probe(self.config, self.plan, first, health=False),
                   "fp8_calibration", first) if self.calibration.enabled else None)

  def _kept(self, program, name: str, model, *static, donate_argnums=()):
    """`program` (a NamedTuple with a ``jitted``: a step, evaluation step or probe of
    `model`) with its traced programs kept in the compilation cache's folder under `name`,
    `model`'s recipe and `static` (``fp8jax.train.program_cache``); `program` itself when
    :meth:`_program_cache` is None."""
    cache = self._program_cache()
    if cache is None:
      return program
    key = repr((name, self.run_model.recipe_of(model), static))
    return program._replace(jitted=cache.wrap(program.jitted, key, donate_argnums,
                                              self.plan.compiler_options))

  def _program_cache(self) -> program_cache.ProgramCache | None:
    """The run's traced programs' cache (made at the first call), keyed by the resolved
    config but for what names the run's folders; None: no compilation cache, a user's model
    (its code is not part of a program's key), several processes."""
    if (self.compile_cache is None or self.model_config is None or jax.process_count() > 1
        or not program_cache.available()):
      return None
    if self._programs is None:
      run = dict(config_to_dict(self.config), model_config=repr(self.model_config),
                 group_seconds=self.group_seconds)
      run["runtime"] = {k: v for k, v in run["runtime"].items()
                        if k not in ("name", "run_dir", "compile_cache")}
      self._programs = program_cache.ProgramCache(
          os.path.join(self.compile_cache, program_cache.FOLDER),
          json.dumps(run, sort_keys=True, default=str))
    return self._programs

  def _health_on(self, recipe, model) -> bool:
    """Whether the run probes FP8 cast health (``train.fp8_health_every``): FP8 GEMMs, a linen
    model (the probe reads its collections), one process."""
    if recipe is None or not self.config.train.fp8_health_every or not self.level.fp8_gemms:
      return False
    if not isinstance(model, nn.Module):
      return False
    if jax.process_count() > 1:
      logger.warning("fp8jax: the FP8 cast-health probe runs in single-process runs only; "
                     "off in this %d-process run", jax.process_count())
      return False
    return True

  @property
  def model(self):
    """The model steps run once FP8 scales are calibrated."""
    return self.calibration.model

  # ------------------------------------------------------------------ the loop

  def run(self) -> dict:
    """Trains for config.train.steps steps; returns the final metrics (with
    ``first_step_s``: seconds from the Trainer's construction to the end of the run's first
    step, also printed; ``startup``: where they went, ``fp8jax.train.startup.StartupClock.
    summary``).

    Out of device memory in any phase raises :class:`fp8jax.train.oom.OutOfMemory` (the
    phase, what it asked for, what to change); with checkpointing on, the run's last good
    state is on disk first (after an evaluation or probe: the state of the steps done; after
    a failed step: the previous checkpoint, pending saves finished)."""
    with self._out_of_memory_diagnosed():
      with self.startup.phase(startup.RESTORE):
        start = self._start_run()
      if start >= self.config.train.steps:
        print(f"fp8jax train: {self.run_dir} already finished {start} of "
              f"{self.config.train.steps} steps")
        return {"resumed_from": start}
      with self.startup.phase(startup.SETUP):
        self._open_logs(start)
      self._compile_first_programs(start)
      return self._train(start)

  def _train(self, start: int) -> dict:
    """Steps `start`..train.steps-1, each followed by what is due after it (:meth:`_due`);
    returns the final metrics (with ``preempted_at`` and ``stopped_by`` when a signal stopped
    the run)."""
    final, window = {}, _LogWindow()
    with self._loop_context(start) as (bar, preemption, heartbeat):
      for step in range(start, self.config.train.steps):
        with self.startup.phase(startup.DATA):
          batch = self.next_batch(step)
        with self.startup.phase(startup.BF16_LOSS):
          bf16_loss = self._watchdog_loss(step, batch, window)
        metrics = self._train_step(step, batch, heartbeat)
        if step == start:
          final["first_step_s"] = self._first_step_seconds(metrics)
          final["startup"] = self.startup_summary
        window.add(metrics, batch)
        due = self._due(step, preemption.requested, watchdog=bf16_loss is not None)
        if due.read_guards:
          self._read_guards(step, bf16_loss)
        if due.ramp_record:
          self._record_ramp(step, window)
        if due.log:
          final.update(self._log_window(step, window, metrics))
        if self._health_due(step):
          self._probe_health(step, batch, window)
        if due.evaluate:
          final["val_loss"] = self._evaluate_and_record(step, window)
        bar.advance(1, final if due.log else None)
        if due.save:
          self._save_checkpoint(step + 1, heartbeat)
        if due.stop:
          return self._stop_preempted(step + 1, preemption, final)
    return self._finish(final)

  # ------------------------------------------------------------------ set-up of a run

  def _start_run(self) -> int:
    """Claims the run folder (``resume.claim_run_dir``), saves the config there, resumes
    with ``checkpoint.auto_resume`` (the metrics of the steps after the restored one are
    dropped: they run again); returns the first step to run."""
    cfg = self.config
    primary = jax.process_index() == 0  # one process writes logs (all take part in checkpoints)
    claim_run_dir(cfg, self.run_dir, overwrite=self.overwrite, checkpoints=self.checkpoints)
    os.makedirs(self.run_dir, exist_ok=True)
    if primary:
      save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
    self._phase = oom.RESTORE
    start = self.resume() if cfg.checkpoint.auto_resume else 0
    if cfg.checkpoint.auto_resume and primary:  # steps after the restored one run again
      metrics_lib.drop_records_after(os.path.join(self.run_dir, "metrics.jsonl"), start)
    return start

  def _open_logs(self, start: int) -> None:
    """Opens the metric writer (the first process's; the others write nothing) and prints
    the run's start lines and the metrics these devices cannot give."""
    primary = jax.process_index() == 0
    self.writer = metrics_lib.MetricWriter(self.run_dir) if primary else metrics_lib.NullWriter()
    self._print_start(start, primary)
    self._note_absent_metrics(start, primary)

  def _compile_first_programs(self, start: int) -> None:
    """Compiles (or loads from the cache) the programs step `start` runs first, each while
    the next is traced (``compiles.compile_ahead``): the calibration pass when one runs, the
    BF16 loss when due before the step, and the train step of the model that step will run.
    (The health probe runs after a step: it compiles at its first use.) A program that fails
    here compiles again, and fails, where it runs."""
    t = self.config.train
    k = self.config.microbatches_at(start)
    batch = np.zeros((k * t.microbatch_size, self.config.data.seq_len + 1), np.int32)
    state, fp8 = self.state, self.state.fp8
    passing = self._calibrate is not None and self.calibration.wants_pass(fp8)
    programs = []
    if passing:
      programs.append(lambda: self._calibrate.lower(state, batch))
    if self.watchdog.due(start) or self._loss_gap_due(start):
      programs.append(lambda: self._bf16_loss.eval_step.lower(state, batch))
    calibrated = passing or not self.calibration.uses_first(fp8)
    programs.append(lambda: self.compiled_step(k, calibrated=calibrated).lower(state, batch))
    compiles.compile_ahead(programs)

  # ------------------------------------------------------------------ one step

  @contextlib.contextmanager
  def _loop_context(self, start: int):
    """The loop's progress bar (advanced to `start`), preemption signal handler
    (``guards.Preemption``) and heartbeat (``runtime.heartbeat_interval``), entered in that
    order; yields the three."""
    with ProgressBar(self.config.train.steps, self.progress) as bar, \
        guards.Preemption() as preemption, self._heartbeat() as heartbeat:
      bar.advance(start)
      yield bar, preemption, heartbeat

  def _loss_gap_due(self, step: int) -> bool:
    """Whether ``fp8/loss_gap`` is measured at step `step` (0-based): FP8 GEMMs, at the
    steps the FP8 health probe follows (every ``train.fp8_health_every``-th step and the
    last: a long run's first step waits for no BF16 program), until a fallback to BF16."""
    t = self.config.train
    return (bool(t.fp8_health_every) and self.level.fp8_gemms and self.fallback_reason is None
            and self._loss_gap_on
            and ((step + 1) % t.fp8_health_every == 0 or step + 1 == t.steps))

  def _watchdog_loss(self, step: int, batch, window: "_LogWindow") -> Any:
    """The BF16 loss of `batch` on the state before step `step` when the divergence watchdog
    checks that step (``runtime.divergence_check_every``) or the FP8-BF16 loss gap is
    measured (:meth:`_loss_gap_due`), else None. Its running time counts in `window`'s
    clock (a cost of training), its compile at its first use does not."""
    guard = self.watchdog.due(step)
    self._phase = oom.WATCHDOG if guard else oom.LOSS_GAP
    if not (guard or self._loss_gap_due(step)):
      return None
    self._wait_for_steps()
    try:
      with window.without_compiles():
        return self._bf16_loss(self.state, batch)
    except jax.errors.JaxRuntimeError as error:
      # Fatal: in the guard the user asked for, and in a run of several processes (the
      # others would wait in the program's collectives for this one).
      if guard or jax.process_count() > 1 or not oom.is_out_of_memory(error):
        raise
      self._loss_gap_on = False
      self._monitor_off(error)
      return None

  def _monitor_off(self, error: BaseException) -> None:
    """Warns (one line) that the monitor of ``self._phase`` ran out of device memory
    (`error`) and is off for the rest of the run (the caller switches it off); the state is
    intact (a monitor donates nothing)."""
    logger.warning("fp8jax: %s. The %s is off for the rest of the run; training goes on",
                   oom.diagnosis(self._phase, error, self.config), self._phase)

  def _wait_for_steps(self) -> None:
    """Waits for the device to finish the steps dispatched so far (before a program that
    may compile: GPU autotuning runs kernels in device memory, which a running step may
    have filled)."""
    jax.block_until_ready(self.state)

  def _train_step(self, step: int, batch, heartbeat) -> dict:
    """Runs optimizer step `step` on `batch` (dispatched: nothing is read back), reports
    progress to `heartbeat`, and queues the step's metrics for :meth:`_read_guards`; returns
    the metrics (device values)."""
    self.state, metrics = self.step_fn(self.config.microbatches_at(step))(self.state, batch)
    self._phase = oom.STEP  # (reading the step's results)
    heartbeat.beat()
    self._unchecked_metrics.append((step, metrics))
    return metrics

  def _due(self, step: int, stop: bool, watchdog: bool) -> "_Due":
    """What the loop does after step `step` (0-based): `stop`, a preemption signal came;
    `watchdog`, the divergence watchdog checks this step."""
    t, done = self.config.train, step + 1
    last = done == t.steps
    log = done % t.log_every == 0 or last
    save = self.checkpoints is not None and (self.checkpoints.should_save(done) or last or stop)
    return _Due(log=log, save=save, stop=stop, read_guards=log or save or watchdog,
                ramp_record=t.batch_ramp is not None and not log,
                evaluate=bool(t.eval_every and done % t.eval_every == 0) or last)

  def _health_due(self, step: int) -> bool:
    """Whether the FP8 cast health is probed after step `step` (``train.fp8_health_every``
    and the last step; asked after the guards' read, which may switch the run to BF16)."""
    t = self.config.train
    return self.health_on and ((step + 1) % t.fp8_health_every == 0 or step + 1 == t.steps)

  def _record_ramp(self, step: int, window: "_LogWindow") -> None:
    """Writes the batch ramp's batch of step `step` (steps that do not log)."""
    self.writer.write(step + 1, {"batch_tokens": window.last_tokens,
                                 "tokens_seen": self.config.tokens_seen(step + 1)})

  def _evaluate_and_record(self, step: int, window: "_LogWindow") -> float:
    """The validation loss after step `step`, written to the logs; not training time (the
    log window's clock)."""
    self._phase = oom.EVAL
    with window.paused(self._wait_for_steps):
      val_loss = self.evaluate()
    self.writer.write(step + 1, {"val_loss": val_loss})
    return val_loss

  def _save_checkpoint(self, step: int, heartbeat) -> None:
    """Starts the checkpoint of the state after `step` steps (the loop has read the guards of
    the steps before it), then reports progress to `heartbeat`."""
    self._phase = oom.CHECKPOINT
    self.save(step)
    heartbeat.beat()

  def _first_step_seconds(self, metrics: dict) -> float:
    """Seconds from the Trainer's construction to the end of the run's first step (set-up,
    data, compiles or cache loads, calibration, the step), printed on the primary process
    with where they went (``fp8jax.train.startup``; :attr:`startup_summary`)."""
    with self.startup.phase(startup.STEP):
      jax.block_until_ready(metrics["loss"])
    self.startup_summary = self.startup.stop()
    if jax.process_index() == 0:
      print(f"fp8jax train: first step done {self.startup_summary['total_s']:.1f} s after "
            f"start ({startup.describe(self.startup_summary)})", flush=True)
    return self.startup_summary["total_s"]

  def _finish(self, final: dict) -> dict:
    """After the last step: waits for pending checkpoints, closes the logs, prints the final
    losses; returns `final`."""
    if self.checkpoints is not None:
      self.checkpoints.wait()
    self.writer.close()
    print(f"done: loss {final['loss']:.4f}, val_loss {final['val_loss']:.4f}; "
          f"TensorBoard/JSONL logs in {os.path.abspath(self.run_dir)}")
    return final

  def next_batch(self, step: int) -> np.ndarray:
    """int32[microbatches * microbatch_size, T+1] for optimizer step `step`."""
    n = self.config.microbatches_at(step)
    return np.concatenate([self.train_batches.next() for _ in range(n)])

  def step_fn(self, microbatches: int):
    """The train step ``(state, batch) -> (state, metrics)`` for `microbatches` microbatches
    (``fp8.calibrate``): while some FP8 state has observed nothing, a calibration pass (the
    FP8 probe on the batch's first microbatch, :func:`fp8jax.train.calibration.
    calibrated_scales`; with pipeline stages through the stages) gives it a scale and the
    calibrated model's step runs: one compiled train step per run, pipeline or not. Only a
    state still unobserved after that pass and its step (a GEMM the first microbatch did
    not reach) makes the uncalibrated model's step run until every state has observed a
    tensor (a second compile)."""
    def run(state, batch):
      with self.startup.phase(startup.CALIBRATION):
        state = self.calibrate(state, batch)
        first = self.calibration.uses_first(state.fp8)
      self._phase = oom.STEP
      with self.startup.phase(startup.STEP):  # (the check after a pass waits for the step)
        state, metrics = self.compiled_step(microbatches, calibrated=not first)(state, batch)
        self.calibration.observed(state.fp8)
      return state, metrics
    return run

  def calibrate(self, state, batch):
    """`state` whose never-observed FP8 states have the scales of a calibration pass on the
    first microbatch of `batch` (the step's batch), when ``fp8.calibrate`` asks for one and
    none ran on this state yet; else `state` as it is."""
    if self._calibrate is None or not self.calibration.wants_pass(state.fp8):
      return state
    self._phase = oom.CALIBRATION
    _, fp8 = self._calibrate(state, batch)
    self.calibration.passed()
    return state._replace(fp8=fp8)

  def compiled_step(self, microbatches: int, calibrated: bool = True) -> TrainStep:
    """The jitted step of the calibrated (or first) model for `microbatches` microbatches:
    ``step.jitted(state, *step.place(batch))``."""
    model = self.calibration.model if calibrated else self.calibration.first
    return self.steps.get(model, microbatches)

  def phase_memory(self) -> dict[str, int]:
    """{phase: bytes of device memory its compiled program needs per device besides the
    train state} for each program the run has (``fp8jax.train.oom`` phase names): the train
    step (the calibrated model, the first step's microbatch count), the evaluation step, the
    FP8 calibration pass and the cast-health probe (where the run has them) and the BF16 loss
    of the divergence check and the FP8-BF16 loss gap (levels with FP8 GEMMs). Each is
    XLA's ``memory_analysis``: temporaries, outputs not aliased to inputs, and arguments
    that are not the state. Compiles what is not compiled yet (the persistent cache serves
    a second call); runs nothing and reads no data."""
    t, state = self.config.train, self.state
    k = self.config.microbatches_at(0)
    batch = np.zeros((k * t.microbatch_size, self.config.data.seq_len + 1), np.int32)
    step = self.compiled_step(k)
    lowered = {oom.STEP: step.jitted.lower(state, *step.place(batch))}
    resident = (state.params, state.fp8)
    evaluation = {oom.EVAL: self._eval}
    if self.level.fp8_gemms:
      evaluation[oom.LOSS_GAP] = self._bf16_loss.eval_step
    for phase, program in evaluation.items():
      rows = batch[:program.microbatches * t.microbatch_size]
      lowered[phase] = program.jitted.lower(*resident, *program.place(rows))
    for phase, probe in ((oom.CALIBRATION, self._calibrate), (oom.PROBE, self._probe)):
      if probe is not None:
        lowered[phase] = probe.jitted.lower(*resident, probe.place(batch))
    return {phase: memory.program_bytes(program.compile(),
                                        state if phase == oom.STEP else resident)
            for phase, program in lowered.items()}

  def evaluate(self) -> float:
    """Mean validation loss per token over `eval_batches` fixed microbatches of the train
    step's size (the same ones every time), run by the evaluation step in calls of up to
    the step's microbatch count (``fp8jax.train.evaluation``: the train step's memory plan)."""
    t, d = self.config.train, self.config.data
    val = self.data.batches("val", t.microbatch_size, d.seq_len, seed=d.seed)
    parts = [val.next() for _ in range(t.eval_batches)]
    k = self._eval.microbatches
    sums = [self._eval(self.state, parts[i:i + k]) for i in range(0, len(parts), k)]
    totals = np.sum(np.asarray(jax.device_get(sums), np.float64), axis=0)  # one read
    return float(totals[0] / totals[1])

  # ------------------------------------------------------------------ logs

  def _print_start(self, start: int, primary: bool) -> None:
    t = self.config.train
    n = fp8_optim.num_params(jax.eval_shape(self.state.model_params))  # (nothing decoded)
    state_bytes = fp8_optim.tree_bytes((self.state.params, self.state.opt_state)) / n
    if jax.process_count() > 1:
      print(f"fp8jax train: process {jax.process_index()} of {jax.process_count()}")
    if primary:
      for line in (self.capability.lines() + self.auto.lines() + self.config.notices()
                   + list(describe_conversion(self.run_model.convert_report))):
        print(f"fp8jax train: {line}")
      kept = "compiled and traced" if self._programs else "compiled"
      print(f"fp8jax train: {kept} programs cached in {self.compile_cache} "
            "(runtime.compile_cache)" if self.compile_cache else
            "fp8jax train: compilation cache off (runtime.compile_cache)")
      if self.group_seconds is not None:
        print(f"fp8jax train: {self._balance_line(self.config.microbatches_at(start))}")
      stages, schedule = (self.config.parallel.pipeline_parallel_size,
                          self.config.parallel.pipeline_schedule)
      if stages > 1:
        k = self.config.microbatches_at(start)
        split = build.pipeline_loop(self.config, self.plan,
                                    self.run_model.for_recipe(self.level.recipe)).stage_layers
        print(f"fp8jax train: pipeline of {stages} stages over {k} microbatches "
              f"({schedule}): bubble {pipeline.bubble_fraction(stages, k, schedule):.1%} "
              f"of each stage's step; layers per stage: "
              f"{', '.join(map(str, split)) if split else 'even'}")
    if primary and self.epochs() > 1:
      print(f"fp8jax train: data: the run's {self.config.tokens_seen(t.steps):,} training "
            f"tokens are {self.epochs():.2f} epochs of the {len(self.data.train):,} of "
            f"{self.data.description} ({self.data.contents}); later epochs repeat it")
    print(f"fp8jax train: model {self.run_model.name}, level {self.level.name}, "
          f"{n / 1e6:.2f}M params "
          f"({state_bytes:.2f} bytes/param of weights + optimizer state), {t.steps} steps, "
          f"data: {self.data.description}; logs: {os.path.abspath(self.run_dir)}")

  def epochs(self) -> float:
    """Passes over the training split the run's train.steps make (windows read / windows
    per epoch)."""
    windows = self.config.tokens_seen(self.config.train.steps) / self.config.data.seq_len
    return windows / self.train_batches.windows_per_epoch

  def _note_absent_metrics(self, step: int, primary: bool) -> None:
    """Says once (stdout, TensorBoard text, events.jsonl) which metrics these devices cannot
    give and why (``metrics.absent_metrics``)."""
    absent = metrics_lib.absent_metrics(self.fp8_peak)
    self.writer.note_absent(step, absent)
    if primary and absent:
      print(f"fp8jax train: {metrics_lib.describe_absent(absent)}")

  def _log_window(self, step: int, window: "_LogWindow", last_metrics: dict) -> dict:
    """Writes and returns the metrics of the log window ending with step `step`; `window`
    then starts the next window."""
    losses = [float(x) for x in window.losses]  # waits for the device
    tokens_per_s = window.tokens / max(window.seconds(), 1e-9)
    out = {"loss": float(np.mean(losses)), "grad_norm": float(last_metrics["grad_norm"]),
           "batch_tokens": window.last_tokens, "tokens_seen": self.config.tokens_seen(step + 1),
           "lr": float(self.schedule(step)), "tokens_per_s": tokens_per_s,
           "mfu": metrics_lib.mfu(self.flops_per_token, tokens_per_s, self.fp8_peak),
           **metrics_lib.memory_in_use(), **metrics_lib.comm_scaling(
               [(p, s) for p, s, skipped in window.comm if not bool(skipped)])}  # a skip keeps it
    if self.state.fp8:
      out.update(metrics_lib.fp8_health(self.state.fp8, self.level.recipe))
    self.writer.write(step + 1, out)
    window.reset()
    return out

  def _probe_health(self, step: int, batch, window: "_LogWindow") -> None:
    """Writes the FP8 cast health of the first microbatch of `batch` (``fp8/...``). Its
    running time counts in `window`'s clock (a cost of training), its compile at its first
    use does not."""
    self._phase = oom.PROBE
    self._wait_for_steps()
    try:
      with window.without_compiles():
        health, _ = self._probe(self.state, batch)
    except jax.errors.JaxRuntimeError as error:
      if not oom.is_out_of_memory(error):
        raise
      self.health_on = False
      self._monitor_off(error)
      return
    self.writer.write(step + 1, {k: float(v) for k, v in health.items()})

  # ------------------------------------------------------------------ layout

  def _group_seconds(self) -> list[float] | None:
    """Seconds per microbatch of each data-parallel group, from parallel.device_map."""
    if self.config.parallel.device_map is None:
      return None
    return device_map_lib.seconds_per_microbatch(self.config.parallel.device_map,
                                                 self._group_kinds(),
                                                 self.config.train.microbatch_size)

  def _group_kinds(self) -> list[str]:
    """The device kind of each data-parallel group (``parallel.device_kinds`` if declared)."""
    return device_map_lib.declared_kinds(self.config.parallel.device_kinds,
                                         layout.group_devices(self.plan.mesh), jax.devices())

  def balanced_counts(self, microbatches: int) -> tuple[int, ...]:
    """Microbatches per data-parallel group for a step of `microbatches` (device_map runs)."""
    return balance.balance_counts(self.group_seconds, microbatches)

  def _balance_line(self, microbatches: int) -> str:
    """The balanced split of a step of `microbatches` and its predicted gain, in words."""
    counts = self.balanced_counts(microbatches)
    kinds = self._group_kinds()
    uniform = balance.uniform_counts(len(counts), microbatches)
    gain = ""
    if uniform is not None:
      ratio = balance.makespan(uniform, self.group_seconds) / balance.makespan(
          counts, self.group_seconds)
      gain = f"; predicted compute time uniform / balanced = {ratio:.2f}x"
    split = ", ".join(f"{k}: {c}" for k, c in zip(kinds, counts))
    return (f"balanced microbatches of {self.config.train.microbatch_size} sequences per "
            f"device ({microbatches} per step): {split}{gain}")

  # ------------------------------------------------------------------ fault tolerance

  def _heartbeat(self):
    r = self.config.runtime
    if r.heartbeat_interval is None:
      return guards.NoHeartbeat()
    return guards.Heartbeat(r.heartbeat_interval, r.heartbeat_tolerance)

  @contextlib.contextmanager
  def _out_of_memory_diagnosed(self):
    """Turns XLA's out-of-memory error inside into :class:`fp8jax.train.oom.OutOfMemory`
    naming the phase that ran (``self._phase``), after keeping what checkpointing can keep."""
    try:
      yield
    except jax.errors.JaxRuntimeError as error:
      if not oom.is_out_of_memory(error):
        raise
      saved = (self._keep_after_out_of_memory() if self.checkpoints is not None else
               "" if self._phase == oom.INIT else
               "Checkpointing is off: the steps done are lost (checkpoint."
               "checkpoint_every_n_steps keeps them)")
      raise oom.OutOfMemory(oom.diagnosis(self._phase, error, self.config, saved)) from None

  def _keep_after_out_of_memory(self) -> str:
    """Finishes pending saves; after an evaluation or probe (the state of the steps done is
    intact and its batches are consumed) saves that state; says what is on disk."""
    note = ""
    try:
      self.checkpoints.wait()
      newest = self.checkpoints.manager.latest_step()
      leaves = jax.tree.leaves(self.state)
      intact = not any(getattr(x, "is_deleted", lambda: False)() for x in leaves)
      if self._phase in (oom.EVAL, oom.PROBE) and intact:
        done = int(self.state.step)
        if done > (newest or 0):  # (a probe before the first step has nothing to keep)
          self.save(done)
          self.checkpoints.wait()
          newest = done
    except Exception as error:  # noqa: BLE001 (the diagnosis is what matters; say why not)
      note = f" (saving after the error failed: {' '.join(str(error).split())[:200]})"
      newest = self.checkpoints.manager.latest_step()
    if newest is None:
      return "No checkpoint was saved yet" + note
    return (f"The newest checkpoint is step {newest} in {self.checkpoints.directory}; "
            f"fp8jax train resumes from it with checkpoint.auto_resume" + note)

  def records(self) -> RunRecords:
    """What a checkpoint holds besides the state: data position and fingerprint, guard
    records."""
    return RunRecords(self.train_batches.state(), self.skips.total, self.fallback_reason,
                      corpus_record(self.data))

  def save(self, step: int) -> None:
    """Starts an asynchronous checkpoint of the state after `step` steps."""
    self.checkpoints.save(step, self.state, self.records())

  def resume(self, shardings=None) -> int:
    """Restores the newest good checkpoint (state onto `shardings`, default: the plan's;
    data position; guard records); returns its step (0: none found). ValueError when the
    checkpoint was written on other data (``resume.check_same_data``)."""
    if self.checkpoints is None:
      return 0
    meta = self.checkpoints.newest_meta()
    check_same_data(meta, corpus_record(self.data), self.checkpoints.directory)
    reason = saved_fallback(meta)
    if reason:
      self.fall_back_to_bf16(reason, record=False)
    restored = self.checkpoints.restore(self.state, shardings or self.plan.state)
    if restored is None:
      return 0
    check_same_data(restored.meta, corpus_record(self.data), self.checkpoints.directory)
    saved = records_of(restored.meta)
    if saved.bf16_fallback and self.fallback_reason is None:
      raise RuntimeError(f"checkpoint step {restored.step} ran with BF16 GEMMs but the newer "
                         "damaged one did not; resume it explicitly")
    self.state = restored.state
    self.calibration.reset()
    self.train_batches.restore(saved.data)
    self.skips.total = saved.skipped_steps
    print(f"fp8jax train: resumed from step {restored.step} ({self.checkpoints.directory})")
    return restored.step

  def _stop_preempted(self, step: int, preemption: guards.Preemption, final: dict) -> dict:
    """Waits for the preemption checkpoint of `step`, closes the logs, says how to resume;
    returns `final` with ``preempted_at`` (`step`) and ``stopped_by`` (the signal's name)."""
    if self.checkpoints is not None:
      self.checkpoints.wait()
    self.writer.close()
    print(stopped_line(step, preemption.signal_name, self.config, self.checkpoints), flush=True)
    return {**final, "preempted_at": step, "stopped_by": preemption.signal_name}

  def _read_guards(self, step: int, bf16_loss=None) -> None:
    """Reads the steps run since the last read, up to `step`: skip accounting (a reload after
    K in a row) and, with `bf16_loss` (a watchdog step), the divergence check of `step`."""
    skipped, metrics = False, None
    for done, metrics in self._unchecked_metrics:
      skipped = bool(metrics["skipped"])
      if skipped:
        logger.warning("step %d skipped: non-finite loss or gradients (%d skipped so far)",
                       done, self.skips.total + 1)
      reload = self.skips.update(skipped)
      if skipped:
        self.writer.write(done + 1, {"skipped_steps": self.skips.total})
      if reload:
        self._reload_after_skips(step)  # continues after the newest step
    self._unchecked_metrics = []
    if bf16_loss is not None and metrics is not None and not skipped:
      fp8_loss, bf16 = float(metrics["loss"]), float(bf16_loss)
      if math.isfinite(fp8_loss) and math.isfinite(bf16):
        self.writer.write(step + 1, {"fp8/loss_gap": guards.loss_gap(fp8_loss, bf16)})
      reason = self.watchdog.check(step, fp8_loss, bf16) if self.watchdog.due(step) else None
      if reason is not None:
        self.fall_back_to_bf16(reason)

  def _reload_after_skips(self, step: int) -> None:
    """K skips in a row: the newest checkpoint's state, continuing after step `step`."""
    limit = self.config.runtime.max_consecutive_skips
    if self.checkpoints is None:
      raise RuntimeError(f"{limit} consecutive steps had non-finite loss or gradients (last: "
                         f"step {step}) and checkpointing is off; enable "
                         "checkpoint.checkpoint_every_n_steps or lower the learning rate")
    self.state, restored = self.checkpoints.reload_after_skips(self.state, step, limit)
    self.calibration.reset()
    logger.warning("%d consecutive non-finite steps: reloaded checkpoint step %d, continuing "
                   "at step %d with the next batches", limit, restored, step + 1)

  def fall_back_to_bf16(self, reason: str, record: bool = True) -> None:
    """Switches the run to BF16 (O0) GEMMs, keeping parameters and optimizer state; the
    reason is logged, written to metrics.jsonl and saved with every later checkpoint."""
    self.fallback_reason = reason
    self.state = self.state._replace(fp8={})
    self.plan = dataclasses.replace(self.plan, state=self.plan.state._replace(fp8={}))
    self._build_programs(None, calibrate=False)
    self.watchdog = guards.DivergenceWatchdog(0)
    self.fp8_peak = False
    if record:
      record_fallback(reason, int(self.state.step), self.run_dir, self.writer)


@dataclasses.dataclass(frozen=True)
class _Due:
  """What the loop does after a step (:meth:`Trainer._due`)."""
  log: bool  # the log window ends: its metrics are written and shown
  save: bool  # a checkpoint of the state after the step
  stop: bool  # a preemption signal came (by the time of the checkpoint decision): stop after
  # the step and its checkpoint
  read_guards: bool  # the host reads the device (log, checkpoint and watchdog steps only:
  # the other steps are dispatched while earlier ones still run)
  ramp_record: bool  # the batch ramp's batch of a step that does not log
  evaluate: bool  # the validation loss


class _LogWindow:
  """Losses, FP8 grad-comm scaling records, tokens and seconds of one log window.
  `clock`: seconds (``time.perf_counter``)."""

  def __init__(self, clock: Callable[[], float] = time.perf_counter):
    self.clock = clock
    self.reset()

  def reset(self) -> None:
    """Empties the window; its clock starts now."""
    self.losses: list = []
    self.comm: list = []
    self.tokens = self.last_tokens = 0
    self.t0 = self.clock()

  @contextlib.contextmanager
  def paused(self, wait: Callable[[], Any]):
    """Leaves the time of the block out of the window's seconds (work that is not training:
    the evaluation). ``wait()`` runs first and counts: it waits for the device to finish the
    window's steps dispatched before the block."""
    wait()
    t0 = self.clock()
    try:
      yield
    finally:
      self.t0 += self.clock() - t0

  @contextlib.contextmanager
  def without_compiles(self, totals: Callable[[], compiles.Totals] = compiles.totals):
    """Leaves the tracing, lowering and compiling inside the block (a program's first use;
    `totals`: the process's compile work, ``compiles.totals``) out of the window's seconds;
    the rest of the block counts."""
    before = totals()
    try:
      yield
    finally:
      self.t0 += (totals() - before).work_s

  def add(self, metrics: dict, batch) -> None:
    self.losses.append(metrics["loss"])
    if "comm_pre_scale_min" in metrics:  # read at the log step
      self.comm.append((metrics["comm_pre_scale_min"], metrics["comm_saturated_max"],
                        metrics["skipped"]))
    self.last_tokens = batch.shape[0] * (batch.shape[1] - 1)
    self.tokens += self.last_tokens

  def seconds(self) -> float:
    return self.clock() - self.t0
