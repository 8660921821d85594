"""The Trainer: config -> model, data, optimizer -> steps with validation, logs and progress."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from fp8jax import checkpoint as checkpoint_lib
from fp8jax import data as data_lib
from fp8jax import optim as fp8_optim
from fp8jax.config import Config, config_to_dict, save_config
from fp8jax.dot import native_fp8_reason
from fp8jax.models.gpt import GPT, ModelConfig, flops_per_token, param_count
from fp8jax.parallel import balance, capability
from fp8jax.scaling import Fp8Meta
from fp8jax.parallel.mesh import describe as parallel_describe
from fp8jax.parallel import device_map as device_map_lib
from fp8jax.train import balanced, guards
from fp8jax.train import metrics as metrics_lib
from fp8jax.train.health import fp8_cast_health
from fp8jax.train.build import calibrated, calibration_on, model_and_optimizer, weight_cast_fn
from fp8jax.train.optimizer import make_fused_update
from fp8jax.train.state import TrainState, init_state
from fp8jax.train.step import cross_entropy, make_eval_step, make_train_step

logger = logging.getLogger("fp8jax")


class Trainer:
  """Trains the reference decoder as `config` says: on one device, or over all devices with
  the ZeRO plan of ``fp8jax.parallel`` when a ZeRO stage is set (level O3: at least 1) or the
  run has several processes."""

  def __init__(self, config: Config, progress: bool = True):
    self.config, self.progress = config, progress
    self.level = config.level()
    self.model_config = ModelConfig(**dataclasses.asdict(config.model))
    self.model, self.schedule, self.tx = model_and_optimizer(config)
    d = config.data
    self.data = data_lib.load_data(None if d.source == "stdlib" else d.source,
                                   val_fraction=d.val_fraction, max_bytes=d.max_bytes,
                                   vocab_size=config.model.vocab_size)
    t = config.train
    self.train_batches = self.data.batches("train", t.microbatch_size, d.seq_len, seed=d.seed)
    self.capability = capability.agree(config.parallel.fp8_capability)
    self.first_model = self.model  # casts never-observed FP8 states just in time
    self.calibration = calibration_on(config)
    if self.calibration:  # after the first step: every cast trusts its stored scale
      self.model = calibrated(self.model)
    self._uncalibrated: bool | None = None  # None: not checked yet for the current state
    self.state = self._init_state()
    self.grad_comm = config.grad_comm()  # "fp8" or "native"
    self.zero = self._zero_plan()  # None: single device, as before
    if self.grad_comm == "fp8" and balanced.group_count(self.zero.mesh) < 2:
      raise ValueError("parallel.grad_comm='fp8' needs at least 2 data-parallel ranks; this "
                       f"run has {parallel_describe(self.zero.mesh)}; use parallel.grad_comm "
                       "'native' / 'auto' or more devices")
    if t.fused_optimizer is True and self.zero is not None:
      raise ValueError("train.fused_optimizer=True runs on one device (unsharded arrays); this "
                       f"run has {parallel_describe(self.zero.mesh)}; use "
                       "train.fused_optimizer false or one device")
    fused = t.fused_optimizer is True or (
        t.fused_optimizer == "auto" and self.level.name == "O2" and self.zero is None
        and jax.default_backend() == "gpu")
    self.fused_update = make_fused_update(
        self.schedule, b1=t.b1, b2=t.b2, eps=t.eps, weight_decay=t.weight_decay,
        clip_norm=t.gradient_clipping) if fused else None
    if self.zero is not None:
      self.state = self.zero.shard_state(self.state)
    self.group_seconds = self._group_seconds()  # None: uniform split (no device_map)
    self._steps: dict[tuple[int, bool], Any] = {}
    self._eval = jax.jit(make_eval_step(self.model.apply))
    self._health = jax.jit(lambda variables, batch: fp8_cast_health(
        self.model, variables, batch, self.level.recipe)) if self.level.fp8_gemms else None
    if jax.process_count() > 1 and self._health is not None:
      logger.warning("fp8jax: the FP8 cast-health probe runs in single-process runs only; "
                     "off in this %d-process run", jax.process_count())
      self._health = None
    self.run_dir = config.runtime.run_path
    self.flops_per_token = flops_per_token(self.model_config, d.seq_len)
    self.fp8_peak = self.level.fp8_gemms and native_fp8_reason() is None
    self._init_guards()

  def _init_state(self) -> TrainState:
    t, d = self.config.train, self.config.data
    state = init_state(self.model, self.tx, self.level, t.microbatch_size, d.seq_len, t.seed)
    if self.config.parallel.grad_comm_scaling == "auto":  # FP8-LM automatic comm scaling
      state = state._replace(comm=balanced.init_grad_comm_scaling(
          jax.eval_shape(state.model_params)))
    return state

  def _zero_plan(self):
    """The ZeRO plan over all devices when the run shards (stage > 0, tensor parallelism,
    balanced microbatches) or has several processes; None for the single-device path."""
    stage = self.config.zero_stage()
    p = self.config.parallel
    if stage == 0 and jax.process_count() == 1 and p.device_map is None and \
        p.tensor_parallel_size == 1 and self.grad_comm != "fp8":
      return None
    from fp8jax import parallel
    mesh = parallel.mesh_from_config(self.config.parallel)
    logger.info("%s; ZeRO stage %d", parallel.describe(mesh), stage)
    p = self.config.parallel
    return parallel.plan(self.state, mesh, stage, level=self.level, offload=p.offload_optimizer,
                         reduce_bucket_size=p.reduce_bucket_size,
                         allgather_bucket_size=p.allgather_bucket_size)

  def _group_seconds(self) -> list[float] | None:
    """Seconds per microbatch of each data-parallel group, from parallel.device_map."""
    if self.config.parallel.device_map is None:
      return None
    kinds = [d.device_kind for d in balanced.group_devices(self.zero.mesh)]
    return device_map_lib.seconds_per_microbatch(self.config.parallel.device_map, kinds,
                                                 self.config.train.microbatch_size)

  def balanced_counts(self, microbatches: int) -> tuple[int, ...]:
    """Microbatches per data-parallel group for a step of `microbatches` (device_map runs)."""
    return balance.balance_counts(self.group_seconds, microbatches)

  def _balanced_step_fn(self, microbatches: int, apply_fn):
    counts = self.balanced_counts(microbatches)
    mesh, m = self.zero.mesh, self.config.train.microbatch_size
    sharding = balanced.batch_sharding(mesh)
    step = self._jit_shard_map_step(apply_fn)
    counts_array = balanced.put_global(np.asarray(counts, np.int32), sharding)
    return lambda state, batch: step(
        state, balanced.put_global(balanced.layout_batch(batch, counts, m), sharding),
        counts_array)

  def _jit_shard_map_step(self, apply_fn):
    """The jitted shard_map data-parallel step ``(state, batch, counts) -> (state, metrics)``
    (fp8jax.train.balanced) of model `apply_fn` with this run's gradient communication."""
    mesh = self.zero.mesh
    sharding = balanced.batch_sharding(mesh)
    return jax.jit(guards.skip_nonfinite_steps(
        balanced.make_balanced_train_step(
            apply_fn, self.tx, mesh, grad_comm=self.grad_comm,
            comm_scaling=self.config.parallel.grad_comm_scaling,
            growth_interval=self.config.grad_comm_growth_interval(),
            gather_params=self.zero.gather_fn())),
        in_shardings=(self.zero.state, sharding, sharding),
        out_shardings=(self.zero.state, jax.sharding.NamedSharding(mesh, P())),
        donate_argnums=0, compiler_options=self.zero.compiler_options or None)

  def _fp8_step_fn(self, microbatches: int, apply_fn):
    step, place = self.fp8_step_parts(microbatches, apply_fn)
    return lambda state, batch: step(state, *place(batch))

  def fp8_step_parts(self, microbatches: int, apply_fn=None):
    """(jitted ``step(state, batch, counts)``, ``place(batch) -> (batch, counts)``) of the
    uniform step with FP8 gradient communication: the balanced (shard_map) step with
    every group running all `microbatches` microbatches on its 1/G of each, i.e. the same
    split of the sequences over the devices as the native ZeRO step."""
    mesh = self.zero.mesh
    groups = balanced.group_count(mesh)
    sharding = balanced.batch_sharding(mesh)
    m = self.config.train.microbatch_size
    if m % groups:
      raise ValueError(f"parallel.grad_comm='fp8': a microbatch of {m} sequences "
                       f"(train.batch_size / train.microbatches) does not split over the "
                       f"{groups} data-parallel ranks; use a microbatch size that is a "
                       f"multiple of {groups}")
    step = self._jit_shard_map_step(apply_fn or self.model.apply)
    counts = balanced.put_global(np.full((groups,), microbatches, np.int32), sharding)
    return step, lambda batch: (balanced.put_global(
        balanced.layout_split(batch, microbatches, groups), sharding), counts)

  def _put_replicated(self, batch) -> jax.Array:
    """`batch` (the same on every process) on every device of the mesh."""
    return balanced.put_global(batch, jax.sharding.NamedSharding(self.zero.mesh, P()))

  def _put_eval(self, batch):
    """Placement of an evaluation batch: sharded over the batch axes (uniform runs) or
    replicated (balanced runs: its size need not divide by the groups)."""
    if self.group_seconds is not None:
      return self._put_replicated(batch)
    return self.zero.shard_batch(batch) if self.zero is not None else batch

  def step_fn(self, microbatches: int):
    """The train step ``(state, batch) -> (state, metrics)`` for `microbatches` microbatches.

    With calibration on (fp8.calibrate), steps run the model whose casts fall back to just-in-
    time scales (``self.first_model``) until every FP8 state has observed a tensor (the first
    step of a fresh run; checked after each such step), then the calibrated model, whose
    casts trust the stored scales. One compile each.
    """
    def run(state, batch):
      if self._uncalibrated is None:
        self._uncalibrated = self.calibration and _any_unobserved(state.fp8)
      first = self._uncalibrated
      state, metrics = self._compiled_step(microbatches, first)(state, batch)
      if first:
        self._uncalibrated = _any_unobserved(state.fp8)
      return state, metrics
    return run

  def _compiled_step(self, microbatches: int, first: bool):
    """The jitted step of the first (uncalibrated) or the calibrated model (one compile per
    microbatch count and model)."""
    key = (microbatches, first)
    if key in self._steps:
      return self._steps[key]
    model = self.first_model if first else self.model
    apply_fn = model.apply
    cast = weight_cast_fn(self.config, model, microbatches)  # stages 0-2, no shard_map
    if self.group_seconds is not None:
      step = self._balanced_step_fn(microbatches, apply_fn)
    elif self.grad_comm == "fp8":
      step = self._fp8_step_fn(microbatches, apply_fn)
    elif self.zero is not None:
      below3 = self.zero.stage < 3  # stage 3 gathers (and decodes) its weights itself
      zero_step = self.zero.train_step(apply_fn, self.tx, microbatches,
                                       wrap=guards.skip_nonfinite_steps,
                                       cast_weights=cast if below3 else None,
                                       matrix_dtype=self.config.model.dtype if below3 else None)
      step = lambda state, batch: zero_step(state, self.zero.shard_batch(batch))
    else:
      inside = ("params", "opt_state") if self.fused_update is not None else ()
      step = jax.jit(guards.skip_nonfinite_steps(
          make_train_step(apply_fn, self.tx, microbatches, fused_update=self.fused_update,
                          cast_weights=cast, matrix_dtype=self.config.model.dtype),
          skipped_inside=inside),
          donate_argnums=0)
    self._steps[key] = step
    return step

  def next_batch(self, step: int) -> np.ndarray:
    """int32[microbatches * microbatch_size, T+1] for optimizer step `step`."""
    n = self.config.microbatches_at(step)
    return np.concatenate([self.train_batches.next() for _ in range(n)])

  def evaluate(self) -> float:
    """Mean validation loss over `eval_batches` fixed batches (the same ones every time)."""
    t, d = self.config.train, self.config.data
    val = self.data.batches("val", t.microbatch_size, d.seq_len, seed=d.seed)
    losses = [float(self._eval(self.state, self._put_eval(val.next())))
              for _ in range(t.eval_batches)]
    return float(np.mean(losses))

  def _log_window(self, step, losses, tokens, seconds, grad_norm, comm=()) -> dict:
    tokens_per_s = tokens / max(seconds, 1e-9)
    out = {"loss": float(np.mean(losses)), "grad_norm": grad_norm,
           "lr": float(self.schedule(step)), "tokens_per_s": tokens_per_s,
           "mfu": metrics_lib.mfu(self.flops_per_token, tokens_per_s, self.fp8_peak),
           **metrics_lib.memory_in_use(), **metrics_lib.comm_scaling(comm)}
    if self.state.fp8:
      out.update(metrics_lib.fp8_health(self.state.fp8, self.level.recipe))
    return out

  def run(self) -> dict:
    """Trains for config.train.steps steps; returns the final metrics."""
    cfg, t = self.config, self.config.train
    primary = jax.process_index() == 0  # one process writes logs (all take part in checkpoints)
    os.makedirs(self.run_dir, exist_ok=True)
    if primary:
      save_config(cfg, os.path.join(self.run_dir, "config.yaml"))
    start = self.resume() if cfg.checkpoint.auto_resume else 0
    if cfg.checkpoint.auto_resume and primary:  # steps after the restored one run again (all
      # of them when a killed run left no finished checkpoint): drop their old records
      metrics_lib.drop_records_after(os.path.join(self.run_dir, "metrics.jsonl"), start)
    if start >= t.steps:
      print(f"fp8jax train: {self.run_dir} already finished {start} of {t.steps} steps")
      return {"resumed_from": start}
    writer = metrics_lib.MetricWriter(self.run_dir) if primary else metrics_lib.NullWriter()
    self._writer = writer
    n = param_count(self.state.model_params())
    state_bytes = fp8_optim.tree_bytes((self.state.params, self.state.opt_state)) / n
    if jax.process_count() > 1:
      print(f"fp8jax train: process {jax.process_index()} of {jax.process_count()}")
    if primary:
      for line in self.capability.lines():
        print(f"fp8jax train: {line}")
      if self.group_seconds is not None:
        print(f"fp8jax train: {self._balance_line(cfg.microbatches_at(start))}")
    print(f"fp8jax train: level {self.level.name}, {n / 1e6:.2f}M params "
          f"({state_bytes:.2f} bytes/param of weights + optimizer state), {t.steps} steps, "
          f"data: {self.data.description}; logs: {os.path.abspath(self.run_dir)}")
    final: dict[str, Any] = {}
    losses, comm, tokens, t0 = [], [], 0, time.perf_counter()
    with _progress(t.steps, self.progress) as advance, guards.Preemption() as preemption, \
        self._heartbeat() as heartbeat:
      advance(start, None)
      for step in range(start, t.steps):
        batch = self.next_batch(step)
        bf16_loss = self._bf16_loss(self.state, batch) if self.watchdog.due(step) else None
        self.state, m = self.step_fn(self.config.microbatches_at(step))(self.state, batch)
        self._after_step(step, m, bf16_loss, writer)
        heartbeat.beat()
        losses.append(m["loss"])
        if "comm_pre_scale_min" in m and not bool(m["skipped"]):  # a skip keeps the state
          comm.append((m["comm_pre_scale_min"], m["comm_saturated_max"]))
        tokens += batch.shape[0] * (batch.shape[1] - 1)
        last = step + 1 == t.steps
        if (step + 1) % t.log_every == 0 or last:
          losses = [float(x) for x in losses]  # waits for the device
          window = self._log_window(step, losses, tokens, time.perf_counter() - t0,
                                    float(m["grad_norm"]), comm)
          writer.write(step + 1, window)
          final.update(window)
          advance(0, window)
          losses, comm, tokens, t0 = [], [], 0, time.perf_counter()
        if self._health is not None and t.fp8_health_every and (
            (step + 1) % t.fp8_health_every == 0 or last):
          probe = batch[:t.microbatch_size]
          writer.write(step + 1, {k: float(v) for k, v in
                                  self._health(self.state.variables(), probe).items()})
        if (t.eval_every and (step + 1) % t.eval_every == 0) or last:
          final["val_loss"] = self.evaluate()
          writer.write(step + 1, {"val_loss": final["val_loss"]})
          t0 = time.perf_counter()  # evaluation is not training time
        advance(1, None)
        if self.checkpoints is not None and (
            self.checkpoints.should_save(step + 1) or last or preemption.requested):
          self.save(step + 1)
          heartbeat.beat()
        if preemption.requested:
          self.checkpoints.wait() if self.checkpoints is not None else None
          writer.close()
          print(f"preempted: stopped after step {step + 1}" + (
              f", checkpoint saved in {self.checkpoints.directory}"
              if self.checkpoints is not None else " (checkpointing is off)"))
          return {**final, "preempted_at": step + 1}
    if self.checkpoints is not None:
      self.checkpoints.wait()
    writer.close()
    print(f"done: loss {final['loss']:.4f}, val_loss {final['val_loss']:.4f}; "
          f"TensorBoard/JSONL logs in {os.path.abspath(self.run_dir)}")
    return final

  def _balance_line(self, microbatches: int) -> str:
    """The balanced split of a step of `microbatches` and its predicted gain, in words."""
    counts = self.balanced_counts(microbatches)
    kinds = [d.device_kind for d in balanced.group_devices(self.zero.mesh)]
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

  def _init_guards(self) -> None:
    c, r = self.config.checkpoint, self.config.runtime
    # Commit the state to its devices: a restored state is committed, and jit keys its
    # compiled program (and the persistent compilation cache) on that.
    self.state = jax.device_put(self.state, jax.tree.map(lambda x: x.sharding, self.state))
    self.checkpoints = None
    if c.enabled:
      self.checkpoints = checkpoint_lib.CheckpointManager(
          c.dir or os.path.join(self.run_dir, "checkpoints"),
          save_every=c.checkpoint_every_n_steps, keep=c.keep, keep_every=c.keep_every,
          async_save=c.async_save)
    self.skips = guards.SkipCounter(r.max_consecutive_skips)
    self.watchdog = guards.DivergenceWatchdog(r.divergence_check_every if self.level.fp8_gemms
                                              else 0, r.divergence_threshold)
    self.fallback_reason: str | None = None
    self._bf16_eval: dict[int, Any] = {}
    self._writer = None

  def _heartbeat(self):
    r = self.config.runtime
    if r.heartbeat_interval is None:
      return contextlib.nullcontext(_NoHeartbeat())
    return guards.Heartbeat(r.heartbeat_interval, r.heartbeat_tolerance)

  def checkpoint_meta(self) -> dict:
    """What a checkpoint holds besides the state: data position, config, guard records."""
    return {"data": self.train_batches.state(), "config": config_to_dict(self.config),
            "skipped_steps": self.skips.total, "bf16_fallback": self.fallback_reason}

  def save(self, step: int) -> None:
    """Starts an asynchronous checkpoint of the state after `step` steps."""
    self.checkpoints.save(step, self.state, self.checkpoint_meta())

  def resume(self, shardings=None) -> int:
    """Restores the newest good checkpoint (state onto `shardings`, default: the current
    state's; data position; guard records); returns its step (0: none found)."""
    if self.checkpoints is None:
      return 0
    meta = self._peek_meta()
    if meta is not None:
      self._check_same_run(meta)
    if meta is not None and meta.get("bf16_fallback"):
      self.fall_back_to_bf16(meta["bf16_fallback"], record=False)
    restored = self.checkpoints.restore(self.state, shardings)
    if restored is None:
      return 0
    if restored.meta.get("bf16_fallback") and self.fallback_reason is None:
      raise RuntimeError(f"checkpoint step {restored.step} ran with BF16 GEMMs but the newer "
                         "damaged one did not; resume it explicitly")
    self.state = restored.state
    self._uncalibrated = None
    self.train_batches.restore(restored.meta["data"])
    self.skips.total = int(restored.meta.get("skipped_steps", 0))
    print(f"fp8jax train: resumed from step {restored.step} ({self.checkpoints.directory})")
    return restored.step

  def _check_same_run(self, meta: dict) -> None:
    """Refuses to resume a checkpoint of another model or level (its state would not fit;
    orbax would fail on every checkpoint)."""
    saved = meta.get("config", {})
    mine = config_to_dict(self.config)
    for section, key in [("model", k) for k in mine["model"]] + [("train", "opt_level")]:
      old = saved.get(section, {}).get(key, mine[section][key])
      if old != mine[section][key]:
        raise ValueError(
            f"{section}.{key}={mine[section][key]!r} but the checkpoints in "
            f"{self.checkpoints.directory} were written with {section}.{key}={old!r}; use "
            f"the same value to resume, or another checkpoint.dir / auto_resume: false")

  def _peek_meta(self) -> dict | None:
    """The JSON metadata of the newest checkpoint (None when absent or unreadable)."""
    step = self.checkpoints.latest_step()
    if step is None:
      return None
    try:
      with open(os.path.join(self.checkpoints.directory, str(step), "meta", "metadata")) as f:
        return json.load(f)
    except (OSError, ValueError):
      return None

  def _after_step(self, step: int, metrics: dict, bf16_loss, writer) -> None:
    """Skip accounting (reload after K in a row) and the divergence check of step `step`."""
    skipped = bool(metrics["skipped"])
    if skipped:
      logger.warning("step %d skipped: non-finite loss or gradients (%d skipped so far)",
                     step, self.skips.total + 1)
    if self.skips.update(skipped):
      writer.write(step + 1, {"skipped_steps": self.skips.total})
      self._reload_after_skips(step)
    elif skipped:
      writer.write(step + 1, {"skipped_steps": self.skips.total})
    if bf16_loss is not None and not skipped:
      reason = self.watchdog.check(step, float(metrics["loss"]), float(bf16_loss))
      if reason is not None:
        self.fall_back_to_bf16(reason)

  def _reload_after_skips(self, step: int) -> None:
    """Reloads model, FP8 and optimizer state from the newest checkpoint; the data position
    stays where it is (the bad batches are not replayed)."""
    limit = self.config.runtime.max_consecutive_skips
    restored = self.checkpoints.restore(self.state) if self.checkpoints is not None else None
    if restored is None:
      raise RuntimeError(f"{limit} consecutive steps had non-finite loss or gradients (last: "
                         f"step {step}) and there is no checkpoint to reload; enable "
                         "checkpoint.checkpoint_every_n_steps or lower the learning rate")
    now = jax.device_put(jnp.asarray(step + 1, jnp.int32), restored.state.step.sharding)
    self.state = restored.state._replace(step=now)
    self._uncalibrated = None
    logger.warning("%d consecutive non-finite steps: reloaded checkpoint step %d, continuing "
                   "at step %d with the next batches", limit, restored.step, step + 1)

  def _bf16_loss(self, state: TrainState, batch) -> jax.Array:
    """Mean loss of `batch` with BF16 (O0) GEMMs and the same parameters, averaged over
    microbatches like the train step's loss."""
    n = batch.shape[0] // self.config.train.microbatch_size
    if n not in self._bf16_eval:
      model = GPT(self.model_config, None)

      def loss(params, batch):
        parts = batch.reshape(n, -1, batch.shape[-1])
        each = jax.lax.map(lambda b: cross_entropy(model.apply({"params": params}, b[:, :-1]),
                                                   b[:, 1:]), parts)
        return jnp.mean(each)
      self._bf16_eval[n] = jax.jit(loss)
    return self._bf16_eval[n](state.model_params(), self._put_eval(batch))

  def fall_back_to_bf16(self, reason: str, record: bool = True) -> None:
    """Switches the run to BF16 (O0) GEMMs, keeping parameters and optimizer state; the
    reason is logged, written to metrics.jsonl and saved with every later checkpoint."""
    self.fallback_reason = reason
    self.model = self.first_model = GPT(self.model_config, None)
    self.calibration, self._uncalibrated = False, False
    self.state = self.state._replace(fp8={})
    self._steps, self._health = {}, None
    self._eval = jax.jit(make_eval_step(self.model.apply))
    self.watchdog = guards.DivergenceWatchdog(0)
    self.fp8_peak = False
    if record:
      logger.warning(reason)
      print(f"fp8jax train: {reason}")
      if self._writer is not None:
        self._writer.write(int(self.state.step), {"bf16_fallback": 1.0})
      with open(os.path.join(self.run_dir, "events.jsonl"), "a") as f:
        f.write(json.dumps({"step": int(self.state.step), "event": "bf16_fallback",
                            "reason": reason}) + "\n")


def _any_unobserved(fp8_state) -> bool:
  """True when some FP8 state (an Fp8Meta of `fp8_state`, stacked or not) has never observed
  a tensor: its whole amax history is zero. Reads the values (waits for the device)."""
  metas = jax.tree.leaves(fp8_state, is_leaf=lambda x: isinstance(x, Fp8Meta))
  for m in metas:
    if isinstance(m, Fp8Meta):
      h = m.amax_history
      h = np.asarray(h.addressable_data(0) if hasattr(h, "addressable_data") else h)
      if h.size and bool((h.max(axis=-1) <= 0).any()):
        return True
  return False


class _NoHeartbeat:
  def beat(self) -> None:
    pass


class _progress:
  """A rich progress bar showing loss and tokens/s (a no-op when disabled)."""

  def __init__(self, total: int, enabled: bool):
    self.total, self.enabled, self.bar = total, enabled, None

  def __enter__(self):
    if self.enabled:
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                 TimeRemainingColumn)
      self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                          TimeRemainingColumn(), TextColumn("{task.fields[info]}"))
      self.bar.__enter__()
      self.task = self.bar.add_task("train", total=self.total, info="")
    return self.advance

  def advance(self, n: int, window: dict | None) -> None:
    if self.bar is None:
      return
    info = None
    if window is not None:
      info = f"loss {window['loss']:.4f}  {window['tokens_per_s']:,.0f} tok/s"
    self.bar.update(self.task, advance=n, **({"info": info} if info else {}))

  def __exit__(self, *exc):
    if self.bar is not None:
      self.bar.__exit__(*exc)
