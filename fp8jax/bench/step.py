"""``fp8jax bench step``: train-step throughput of the reference decoder, level O0 (BF16) against
O2 (FP8 GEMMs, FP16 master weights, FP8/FP16 Adam state), side by side in one process.

Each run is the step ``fp8jax train`` runs (``fp8jax.train.loop.Trainer`` on the config, the
level and the run's overrides): where ``fp8.calibrate`` says so the Trainer's calibration pass
gives the FP8 state its first scales (``Trainer.calibrate``; with pipeline stages the first
steps run the uncalibrated model), then the calibrated model's step, compiled ahead of time;
after the warm-up steps every FP8 state must have observed a tensor (else the run is refused), then
``--iters`` steps on one batch are timed, each waited for (median). Runs are measured one after
the other, each Trainer freed before the next.

Default (GPU): ``configs/gpt_1_3b.yaml`` (24 x 2048, GELU, T2048) at each level's best
measured settings (``benchmarks/RESULTS.md``, best against best): cuDNN attention, unrolled
layers, batch 16; O0 saves the GEMM outputs across remat, O2 their inputs too. ``--small``:
a 2-layer, 64-wide model on 32-token sequences (seconds on a CPU).

Columns: ms per step, tokens/s, tokens/s against the first run, model TFLOP/s and MFU (against
the FP8 peak at FP8 levels, BF16's at O0; "-" where the device's peak is unknown), the compiled
step's memory (arguments + outputs + temporaries, XLA's analysis, GiB), the last step's loss
(the same step of every run: each run takes one step before the timed ones, an uncalibrated
first step counting as it), the seconds the train step took to compile (ahead of time, with
JAX's persistent compilation cache off for every run) and the seconds from the Trainer's
set-up to the end of the warm-up (initialisation, calibration and compiles included).
"""
from __future__ import annotations

import gc
import os
import time
from typing import Callable

import jax
import numpy as np

from fp8jax.bench import report
from fp8jax.bench.timing import memory_gib, time_calls
from fp8jax.config import load_config
from fp8jax.hardware import peak_flops
from fp8jax.train.calibration import any_unobserved
from fp8jax.train.loop import Trainer

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "configs", "gpt_1_3b.yaml")
# Every run: unrolled layers, little text to load (the timed batch is repeated).
SETTINGS = ("model.scan_layers=false", "data.max_bytes=4194304", "train.eval_every=0")
GPU_SETTINGS = ("model.attention_impl=cudnn",)
RUNS = ("O0 saved, B16=O0,model.remat_policy=save_gemm_outputs,train.batch_size=16",
        "O2 io, B16=O2,model.remat_policy=save_gemm_io,train.batch_size=16")
SMALL_SETTINGS = ("model.vocab_size=256", "model.d_model=64", "model.n_layers=2",
                  "model.n_heads=2", "model.d_ff=256", "model.max_seq_len=32", "data.seq_len=32",
                  "data.max_bytes=200000", "train.batch_size=4", "train.warmup_steps=1")
SMALL_RUNS = ("O0 saved=O0,model.remat_policy=save_gemm_outputs",
              "O2 io=O2,model.remat_policy=save_gemm_io")
ITERS, SMALL_ITERS = 5, 2
FIRST_STEPS = 3  # at most this many uncalibrated steps before the calibrated one
COLUMNS = (report.Column("batch", "batch"), report.Column("ms", "ms/step", ".1f"),
           report.Column("tokens_per_s", "tokens/s", ",.0f"),
           report.Column("x_base", "tokens/s vs baseline"),
           report.Column("tflops", "model TFLOP/s", ".4g"), report.Column("mfu", "MFU", ".3f"),
           report.Column("gib", "compiled GiB", ".3g"), report.Column("loss", "loss", ".3f"),
           report.Column("compile_s", "step compile s", ".1f"),
           report.Column("warmup_s", "set-up+warm-up s", ".0f"))


def add_arguments(parser) -> None:
  """The subject's flags."""
  parser.add_argument("--config", default=None,
                      help="YAML config (default: configs/gpt_1_3b.yaml; --small: a 2-layer "
                           "model on the built-in defaults)")
  parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                      help="override one config value in every run (repeatable)")
  parser.add_argument("--run", action="append", default=[], metavar="LABEL=LEVEL[,K=V...]",
                      help="a run: a label, its level and its own overrides (repeatable; the "
                           "first is the baseline; default: O0 and O2 at their best settings)")


def parse_run(text: str) -> tuple[str, str, list[str]]:
  """'LABEL=LEVEL[,section.key=value...]' -> (label, level, overrides); ValueError if not."""
  label, sep, rest = text.partition("=")
  level, *overrides = rest.split(",") if sep else ("",)
  if not label.strip() or not level.strip():
    raise ValueError(f"bench step: --run {text!r}: use LABEL=LEVEL[,section.key=value...], "
                     "e.g. 'O2 io=O2,model.remat_policy=save_gemm_io'")
  return label.strip(), level.strip(), [o for o in overrides if o.strip()]


def prepare(args) -> Callable[[Callable[[str], None]], list[report.Table]]:
  """The subject from parsed flags (``small``, ``iters`` and :func:`add_arguments`' flags),
  checked: ``log -> tables`` (`log` prints a progress line)."""
  small = args.small
  runs = [parse_run(r) for r in (args.run or (SMALL_RUNS if small else RUNS))]
  settings = list(SETTINGS) + (list(SMALL_SETTINGS) if small else []) + [
      f"train.seed={args.seed}", f"data.seed={args.seed}"]
  if jax.default_backend() == "gpu" and not any(s.startswith("model.attention_impl=")
                                                for s in args.set):
    settings += GPU_SETTINGS
  config = args.config if args.config is not None else (None if small else CONFIG)
  if config is not None and not os.path.isfile(config):
    raise ValueError(f"bench step: --config {config}: no such file")
  iters = args.iters or (SMALL_ITERS if small else ITERS)
  overrides = settings + list(args.set)
  labels = [label for label, _, _ in runs]
  if len(set(labels)) < len(labels):
    raise ValueError(f"bench step: --run labels {labels}: give each run its own label")
  for label, level, own in runs:  # a bad key or value is refused before anything runs
    try:
      load_config(config, overrides + own + [f"train.opt_level={level}"])
    except ValueError as e:
      raise ValueError(f"bench step: run {label!r}: {e}") from None
  return lambda log: [measure(config, runs, overrides, iters, log=log)]


def measure(config: str | None, runs, overrides=(), iters: int = ITERS,
            log=print) -> report.Table:
  """The table of `runs` ((label, level, overrides) each; the first is the baseline) on
  `config` (a YAML path or None: the defaults) with `overrides` applied to every run."""
  where = os.path.basename(config) if config else "the built-in defaults"
  table = report.Table("step", f"train step on {where}, median of {iters} steps", COLUMNS)
  for i, (label, level, own) in enumerate(runs):
    try:
      values = time_run(config, level, list(overrides) + own, iters, log=lambda m: log(
          f"step {label}: {m}"))
    except jax.errors.JaxRuntimeError as e:
      if "RESOURCE_EXHAUSTED" not in str(e):
        raise
      gc.collect()
      if i == 0:
        raise ValueError(f"bench step: the baseline run {label!r} ran out of device memory; "
                         "choose a baseline that fits (a smaller batch or more remat)") from None
      table.notes.append(f"{label}: out of device memory ({_first_line(e)})")
      log(f"step {label}: out of device memory")
      continue
    gc.collect()  # the run's Trainer and state are gone before the next run starts
    table.rows.append(report.Row(label, values, baseline=i == 0))
    if values.pop("skipped"):
      table.notes.append(f"{label}: {values['skipped_steps']} of {iters} timed steps were "
                         "skipped as non-finite: not a training step's time")
  base = table.rows[0].values["tokens_per_s"]
  for r in table.rows:
    r.values["x_base"] = report.ratio(r.values["tokens_per_s"], base)
  table.notes.append("every run: " + " ".join(overrides))
  table.notes.append("each run with its own overrides: " + "; ".join(
      f"{label} = {level}{''.join(',' + o for o in own)}" for label, level, own in runs))
  return table


def _first_line(e: Exception) -> str:
  """The first line of an error's message, without XLA's status prefix, shortened."""
  line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  return line.removeprefix("RESOURCE_EXHAUSTED: ")[:120]


def time_run(config: str | None, level: str, overrides, iters: int, log=print) -> dict:
  """One run's row values (see the module docstring)."""
  t0 = time.perf_counter()
  # every program compiles (a persistent cache would serve a re-run's): step compile s is
  # the step's own compile, lowered ahead of time
  cfg = load_config(config, ["runtime.compile_cache=false", *overrides,
                             f"train.opt_level={level}"])
  trainer = Trainer(cfg, progress=False)
  batch = trainer.next_batch(0)
  microbatches = cfg.microbatches_at(0)
  # the Trainer's calibration pass where fp8.calibrate asks for one (no step program of its
  # own); with pipeline stages the uncalibrated model until every FP8 state observed a tensor
  state, first = trainer.calibrate(trainer.state, batch), 0
  for _ in range(FIRST_STEPS):
    if not trainer.calibration.uses_first(state.fp8):
      break
    state, _ = trainer.compiled_step(microbatches, calibrated=False)(state, batch)
    trainer.calibration.observed(state.fp8)
    first += 1
  step = trainer.compiled_step(microbatches, calibrated=True)
  placed = step.place(batch)
  t1 = time.perf_counter()
  compiled = step.jitted.lower(state, *placed).compile()
  compile_s = time.perf_counter() - t1
  if not first:  # one step, as a run of uncalibrated first steps takes one: the timed steps
    state, _ = compiled(state, *placed)  # and their losses are then the same in every run
  log(f"compiled in {time.perf_counter() - t0:.1f} s (with the Trainer's set-up)")
  carry = {"state": state, "metrics": []}

  def one_step():
    carry["state"], metrics = compiled(carry["state"], *placed)
    carry["metrics"].append(metrics)
    return metrics
  jax.block_until_ready(one_step())
  if trainer.level.fp8_gemms and any_unobserved(carry["state"].fp8):
    raise RuntimeError(f"bench step {level}: some FP8 state observed no tensor during warm-up; "
                       "timing would run on never-updated scales")
  warmup_s = time.perf_counter() - t0
  carry["metrics"].clear()
  timing = time_calls(one_step, iters, warmup=1)
  timed = carry["metrics"][-iters:]
  skipped = sum(bool(m.get("skipped", False)) for m in timed)
  tokens = batch.shape[0] * (batch.shape[1] - 1)
  tps = tokens / (timing.median / 1e3)
  devices = list(trainer.plan.mesh.devices.flat)
  fp8 = bool(trainer.fp8_peak)
  peaks = [peak_flops(d.device_kind, fp8) for d in devices]
  flops = trainer.flops_per_token * tps
  values = {"batch": int(batch.shape[0]), "ms": timing.median, "tokens_per_s": tps,
            "tflops": flops / 1e12, "mfu": None if None in peaks else flops / sum(peaks),
            "gib": memory_gib(compiled)["total"], "loss": float(np.asarray(timed[-1]["loss"])),
            "compile_s": compile_s, "warmup_s": warmup_s, "skipped": skipped > 0, "skipped_steps": skipped,
            "auto": " ".join(trainer.auto.lines())}
  log(f"{values['ms']:.1f} ms/step, {tps:,.0f} tokens/s")
  return values
