"""The ``fp8jax`` command.

``fp8jax train --config configs/tiny.yaml [--set train.steps=50]``: trains the reference
decoder; ``fp8jax plot RUN_DIR...``: overlays runs' loss curves and FP8 scales in a PNG.
``fp8jax launch -n N [--max-restarts R] -- COMMAND``: N supervised local processes
(``fp8jax.launch``). ``fp8jax profile --config C``: seconds per microbatch vs microbatch size
on this device kind (``fp8jax.train.profile``), written as a throughput profile
(``fp8jax.parallel.profile``). ``fp8jax convert-hf RUN_DIR OUT_DIR``: a llama run's
checkpoint in the Hugging Face layout (``fp8jax.train.export``); ``fp8jax tokenizer train``: a
byte-level BPE tokenizer (``fp8jax.data.train_tokenizer``). ``fp8jax simulate --cluster C
--config F``: predicted step time and memory of a (mixed) cluster (``fp8jax.parallel.
cost_model``); ``fp8jax simulate --table``: per-GPU memory and step time of 7B, 70B and 175B on
8 to 1024 GPUs, the fastest layout that fits (``fp8jax.parallel.sizing``). ``fp8jax check``:
lists the devices, says whether FP8 GEMMs run natively or emulated (and why), and compares
one Dense layer's forward+backward in FP8 against BF16: relative error of output, input
gradient and weight gradient vs a float64 reference, and time per step. ``fp8jax bench
mlp|step|optim|comm|all``: fp8jax's speed claims measured on this machine, each against its
baselines in the same process (``fp8jax.bench``). ``fp8jax eval RUN_DIR|hf:DIR --data
SOURCE``: loss, perplexity and bits per byte of a run's checkpoint or a Hugging Face one, at
BF16 or an FP8 level; ``fp8jax generate RUN_DIR|hf:DIR --prompt TEXT``: sampled text with a
key/value cache (``fp8jax.train.inference``).

Errors: bad input (a missing file, a config value, a data problem: an ``OSError``, or a
``ValueError`` that fp8jax raises about its input) prints one line ``fp8jax: error: ...`` on
stderr and exits 2; a failed run that fp8jax diagnoses (a ``RuntimeError`` it raises) exits 1
the same way; anything else is a bug and shows its traceback. ``--debug`` shows the traceback
of every error. Ctrl-C before training starts exits 130 without a traceback (during training:
``fp8jax.train.guards.Preemption``).
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import textwrap
import traceback

import numpy as np

from fp8jax import bench

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
BASE_CONFIG = os.path.join(os.path.dirname(PACKAGE_DIR), "configs", "base.yaml")
USAGE_EXIT, FAILURE_EXIT, INTERRUPT_EXIT = 2, 1, 130


class UsageError(Exception):
  """Bad command-line input: printed as one ``fp8jax: error:`` line, exit 2."""


def _raised_by_fp8jax(error: BaseException) -> bool:
  """True when the innermost frame of `error`'s traceback is fp8jax code (a deliberate raise
  about its input, not an error deep inside a dependency)."""
  frames = traceback.extract_tb(error.__traceback__)
  return bool(frames) and os.path.abspath(frames[-1].filename).startswith(PACKAGE_DIR + os.sep)


def error_exit_code(error: BaseException) -> int | None:
  """The exit code of an error that is reported in one line (None: a bug, show the traceback).

  2: `UsageError`, any ``OSError`` (a missing or unreadable file, a full disk), and a
  ``ValueError`` raised by fp8jax itself (config, data, checkpoint and mesh checks). 1: a
  ``RuntimeError`` raised by fp8jax itself (a run that cannot go on, with the reason).
  """
  if isinstance(error, (UsageError, OSError)):
    return USAGE_EXIT
  if isinstance(error, ValueError) and _raised_by_fp8jax(error):
    return USAGE_EXIT
  if isinstance(error, RuntimeError) and _raised_by_fp8jax(error):
    return FAILURE_EXIT
  return None


def error_line(error: BaseException) -> str:
  """The one-line report of `error`: ``fp8jax: error: <message>``."""
  if isinstance(error, OSError) and error.filename is not None and error.strerror:
    message = f"{error.filename}: {error.strerror}"
  else:
    message = " ".join(str(error).split()) or type(error).__name__
  return f"fp8jax: error: {message}"


def _devices_report() -> list[str]:
  import jax
  lines = [f"jax {jax.__version__}, {jax.process_count()} process(es), "
           f"{jax.device_count()} device(s)"]
  for d in jax.devices():
    cc = getattr(d, "compute_capability", None)
    lines.append(f"  [{d.id}] {d.platform} {d.device_kind}" + (f" (sm {cc})" if cc else ""))
  return lines


def _rel(a, ref) -> float:
  a = np.asarray(a, np.float64)
  return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))


def compare_dense(m: int, k: int, n: int, steps: int = 5, seed: int = 0) -> dict:
  """FP8 vs BF16 Dense layer y = x @ w, forward + backward, on fresh random inputs.

  Returns {mode: {"out"/"dx"/"dw": rel. error vs float64, "ms": median ms per step}}.
  """
  import jax
  import jax.numpy as jnp
  import fp8jax

  kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32)
  w = jax.random.normal(kw, (k, n), jnp.float32) / np.sqrt(k)
  g = jax.random.normal(kg, (m, n), jnp.float32)
  x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
  ref = {"out": x64 @ w64, "dx": g64 @ w64.T, "dw": x64.T @ g64}
  dn = (((1,), (0,)), ((), ()))
  meta = fp8jax.init_dot_meta()

  def bf16(x, w, g, meta):
    y, vjp = jax.vjp(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16), x, w)
    return (y, *vjp(g)), meta

  def fp8(x, w, g, meta):
    y, vjp = jax.vjp(lambda x, w, mt: fp8jax.fp8_dot_general(x, w, dn, mt), x, w, meta)
    dx, dw, new_meta = vjp(g)
    return (y, dx, dw), new_meta

  results = {}
  args16 = [a.astype(jnp.bfloat16) for a in (x, w, g)]
  for mode, fn in (("bf16", bf16), ("fp8", fp8)):
    step = jax.jit(fn)
    mt = meta
    for _ in range(2):  # warm the delayed scales up on this data
      outs, mt = step(*args16, mt)
    row = {name: _rel(o, ref[name]) for name, o in zip(("out", "dx", "dw"), outs)}
    row["ms"] = bench.timing.time_calls(lambda: step(*args16, mt), steps, warmup=1).median
    results[mode] = row
  return results


def cmd_check(args) -> int:
  import jax
  import fp8jax
  for line in _devices_report():
    print(line)
  reason = fp8jax.native_fp8_reason()
  print("FP8 GEMMs:", "native (cuBLASLt FP8)" if reason is None else f"emulated ({reason})")
  on_gpu = jax.devices()[0].platform == "gpu"
  m, k, n = args.shape or ((8192, 8192, 8192) if on_gpu else (512, 1024, 1024))
  print(f"Dense layer forward+backward, x[{m},{k}] @ w[{k},{n}], bf16 inputs; "
        "relative error vs float64:")
  res = compare_dense(m, k, n, steps=args.steps)
  print(f"  {'mode':6s} {'out':>9s} {'dx':>9s} {'dw':>9s} {'ms/step':>9s}")
  for mode, r in res.items():
    print(f"  {mode:6s} {r['out']:9.2e} {r['dx']:9.2e} {r['dw']:9.2e} {r['ms']:9.3f}")
  print(f"  fp8/bf16 error ratio (out): {res['fp8']['out'] / res['bf16']['out']:.1f}x; "
        f"speed-up: {res['bf16']['ms'] / res['fp8']['ms']:.2f}x")
  bad = [k for k, v in res["fp8"].items() if not np.isfinite(v) or (k != "ms" and v > 0.1)]
  if bad:
    print(f"FAILED: FP8 error out of bounds for {bad}", file=sys.stderr)
    return 1
  return 0


def _config_path(path: str | None) -> str | None:
  """`path` when it names a file; UsageError naming the shipped configs otherwise."""
  if path is None or os.path.isfile(path):
    return path
  shipped = os.path.dirname(BASE_CONFIG)
  names = sorted(n for n in os.listdir(shipped) if n.endswith(".yaml")) \
      if os.path.isdir(shipped) else []
  hint = f"; shipped configs in {shipped}: {', '.join(names)}" if names else ""
  what = "is a directory" if os.path.isdir(path) else "no such file"
  raise UsageError(f"--config {path}: {what}{hint}")


def cmd_train(args) -> int:
  from fp8jax import parallel
  from fp8jax.config import load_config
  from fp8jax.train.loop import Trainer
  config = load_config(_config_path(args.config), args.set)
  parallel.initialize()  # joins `fp8jax launch`'s or a cluster's process group; else no-op
  final = Trainer(config, progress=not args.no_progress, overwrite=args.overwrite).run()
  return INTERRUPT_EXIT if final.get("stopped_by") == "SIGINT" else 0


def cmd_profile(args) -> int:
  import jax
  from fp8jax.config import load_config
  from fp8jax.hardware import GiB
  from fp8jax.parallel import profile
  from fp8jax.train.profile import measure
  if jax.process_count() > 1:
    print("fp8jax profile measures the local devices of one process; run it without "
          "fp8jax launch", file=sys.stderr)
    return 2
  config = load_config(_config_path(args.config), args.set)
  sizes = [int(s) for s in args.sizes.split(",")] if args.sizes else \
      [2**i for i in range(8) if 2**i <= config.train.microbatch_size * 4]
  limit = None if args.memory_limit_gib is None else int(args.memory_limit_gib * GiB)
  data = measure(config, sizes, steps=args.steps, memory_limit_bytes=limit)
  path = profile.write(data, args.out or profile.default_path(data))
  print(profile.table(data))
  print(f"profile written to {path}; use it with --set parallel.device_map=<folder> or "
        f"device_map: {{KIND: {{profile: {path}}}}}")
  return 0


def cmd_launch(args) -> int:
  from fp8jax.launch import launch
  command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
  return launch(command, args.num_processes, args.max_restarts, args.grace)


def cmd_plot(args) -> int:
  from fp8jax.plot import plot_runs
  print(plot_runs(args.run_dirs, args.output))
  return 0


def _stages(text: str) -> list[int]:
  """ZeRO stages of "1,3" (O3 runs stage 0 as 1: it always shards)."""
  try:
    return [int(z) for z in text.split(",") if z.strip()]
  except ValueError:
    raise UsageError(f"--zero {text!r} is not a comma-separated list of stages 0..3") from None


def cmd_convert_hf(args) -> int:
  from fp8jax.train.export import export_hf
  step, files = export_hf(args.run_dir, args.out_dir, step=args.step, dtype=args.dtype,
                          overwrite=args.overwrite)
  print(f"fp8jax convert-hf: step {step} of {args.run_dir} written to {args.out_dir} "
        f"({len(files)} files, {args.dtype})")
  return 0


def cmd_tokenizer_train(args) -> int:
  from fp8jax.data import train_tokenizer
  tokenizer = train_tokenizer(args.files or None, args.vocab_size, args.output,
                              max_bytes=args.max_bytes)
  print(f"fp8jax tokenizer train: {tokenizer.get_vocab_size()} ids written to {args.output} "
        f"(use it with --set data.tokenizer={args.output})")
  return 0


def _calibration(data, count: int):
  """Model inputs int32[B, T] of the first `count` batches of `data`'s train split (made when
  first read: only a model without FP8 state calibrates)."""
  available = data.available("train")
  if available < 1:
    raise UsageError(f"the train split of {data.data.description} is too short to calibrate "
                     "FP8 scales on; use --level O0 or more data")
  for batch in data.batches("train", min(count, available)):
    yield batch[:, :-1]


def cmd_eval(args) -> int:
  import json
  from fp8jax.train import inference
  loaded = inference.load(args.model, step=args.step, dtype=args.dtype)
  data = inference.eval_data(loaded, args.data, tokenizer=args.tokenizer,
                             batch_size=args.batch_size, seq_len=args.seq_len,
                             max_bytes=args.max_bytes)
  saved = (loaded.corpus or {}).get("fingerprint")
  if args.data is None and saved and data.data.fingerprint and saved != data.data.fingerprint:
    print(f"fp8jax eval: warning: {loaded.name} was trained on other data "
          f"({loaded.corpus.get('contents')}; now {data.data.contents}): the {args.split} "
          "split is not the one of its run", file=sys.stderr)
  available = data.available(args.split)
  if available < 1:
    raise UsageError(f"the {args.split} split of {data.data.description} is too short for one "
                     f"batch of {data.batch_size} x {data.seq_len} tokens; lower --batch-size "
                     "or --seq-len")
  model, variables, note = loaded.at_level(args.level,
                                           _calibration(data, args.calibration_batches))
  count = min(args.batches, available)
  result = inference.evaluate(model, variables, data.batches(args.split, count),
                              byte_level=data.byte_level)
  level = args.level or loaded.run_level
  if args.json:
    print(json.dumps({"model": loaded.name, "step": loaded.step, "level": level,
                      "fp8_state": note or None, "data": data.data.description,
                      "split": args.split, "batches": result.batches,
                      "batch_size": data.batch_size, "seq_len": data.seq_len,
                      "tokens": result.tokens, "loss": result.loss,
                      "perplexity": result.perplexity, "bits_per_byte": result.bits_per_byte}))
    return 0
  bpb = "" if result.bits_per_byte is None else f", {result.bits_per_byte:.4f} bits/byte"
  print(f"fp8jax eval: {loaded.name} at {level}" + (f" ({note})" if note else "") +
        f": loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}{bpb} over "
        f"{result.batches} batch{'es' if result.batches != 1 else ''} of {data.batch_size} x "
        f"{data.seq_len} tokens of the {args.split} split of {data.data.description}")
  return 0


def cmd_generate(args) -> int:
  from fp8jax.train import inference
  loaded = inference.load(args.model, step=args.step, dtype=args.dtype)
  codec = loaded.codec(args.tokenizer)
  ids = inference.prompt_ids(codec, args.prompt, loaded.vocab_size)
  room = (loaded.max_seq_len or ids.shape[1] + 1) - ids.shape[1]
  if room < 1:
    raise UsageError(f"the prompt's {ids.shape[1]} tokens fill {loaded.name}'s max_seq_len="
                     f"{loaded.max_seq_len}; shorten it")
  new = min(128, room) if args.max_new_tokens is None else args.max_new_tokens
  model, variables, note = loaded.at_level(args.level, [ids])  # FP8: calibrated on the prompt
  top_k = min(args.top_k, loaded.vocab_size or args.top_k)
  out = inference.generate_text(model, variables, codec, args.prompt, max_new_tokens=new,
                                temperature=args.temperature, top_k=top_k, seed=args.seed)
  level = args.level or loaded.run_level
  how = "greedy" if args.temperature == 0 else \
      f"temperature {args.temperature:g}" + (f", top-k {top_k}" if top_k else "")
  end = "; stopped at the document separator" if out.stopped else ""
  print(f"fp8jax generate: {loaded.name} at {level}" + (f" ({note})" if note else "") +
        f", {codec.describe()}: {len(out.tokens)} new tokens, {how}{end}", file=sys.stderr)
  print(args.prompt + out.text)
  return 0


# Llama-style shapes of the `simulate --table` models: (layers, d_model, heads, key/value
# heads, SwiGLU width, vocabulary). 7B and 70B: LLaMA 2's; 175B: GPT-3's depth, width and heads
# with LLaMA's SwiGLU (8/3 d_model) and vocabulary.
TABLE_MODELS = {"7B": (32, 4096, 32, 32, 11008, 32000),
                "70B": (80, 8192, 64, 8, 28672, 32000),
                "175B": (96, 12288, 96, 96, 32768, 32000)}


def table_model(name: str, seq_len: int):
  """The ``LlamaConfig`` of `name` in :data:`TABLE_MODELS` (full remat, BF16 compute)."""
  from fp8jax.models.llama import LlamaConfig
  if name not in TABLE_MODELS:
    raise UsageError(f"--models: {name!r} is not one of {list(TABLE_MODELS)}")
  layers, d, heads, kv, ff, vocab = TABLE_MODELS[name]
  return LlamaConfig(vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads,
                     n_kv_heads=kv, d_ff=ff, max_seq_len=seq_len, remat=True,
                     remat_policy="full")


def simulate_table(args) -> str:
  """The text `fp8jax simulate --table` prints: for each model, GPU count and level the
  fastest layout that fits (:func:`fp8jax.parallel.sizing.best_layout`), with the models'
  shapes and the assumptions."""
  from fp8jax.hardware import GiB, gpu_spec
  from fp8jax.parallel import sizing
  from fp8jax.train.memory import model_shape
  kind = gpu_spec(args.kind).name
  seq_len = 4096 if args.seq_len is None else args.seq_len
  batch = 1024 if args.batch is None else args.batch
  bw = args.inter_node_gbps * 1e9 / 8
  names = [n.strip().upper() for n in args.models.split(",") if n.strip()]
  levels = [x.strip().upper() for x in (args.levels or "O0,O3").split(",") if x.strip()]
  counts = sizing.gpu_counts(args.gpus)
  stages = _stages(args.zero)
  lines = [f"fp8jax simulate: per-GPU memory and step time on {', '.join(map(str, counts))} x "
           f"{kind} ({gpu_spec(kind).hbm_bytes / GiB:.1f} GiB); for each model, GPU count "
           "and level the fastest setting that fits, else the one needing the least memory "
           "(ZeRO stages tried: " + ", ".join(map(str, stages)) + "); predictions, not "
           "measurements"]
  rows = []
  for name in names:
    cfg = table_model(name, seq_len)
    shape = model_shape(cfg)
    lines.append(f"- {name}: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads "
                 f"({cfg.n_kv_heads} key/value), SwiGLU {cfg.d_ff}, vocab {cfg.vocab_size}, "
                 f"seq {seq_len}: {shape.params / 1e9:.1f}B parameters")
    for gpus in counts:
      for level in levels:
        rows.append((name, sizing.best_layout(shape, kind, gpus, level, seq_len, batch, stages,
                                              gpus_per_node=args.gpus_per_node,
                                              inter_node_bw=bw)))
  lines += [f"- {line}" for line in sizing.assumption_lines(seq_len, batch, args.gpus_per_node,
                                                            bw)]
  lines += ["", sizing.format_rows(rows)]
  return "\n".join(lines)


def cmd_simulate(args) -> int:
  """Prints predicted step times of a mixed cluster, uniform vs balanced split, or (with
  --table) the layout table of :func:`simulate_table`."""
  from fp8jax.config import load_config
  from fp8jax.hardware import gpu_spec
  from fp8jax.parallel import cost_model as cm
  from fp8jax.recipe import opt_level
  from fp8jax.train.memory import model_shape
  if args.table:
    print(simulate_table(args))
    return 0
  if not args.cluster or not args.config:
    raise UsageError("simulate needs --cluster and --config (or --table)")
  config = load_config(_config_path(args.config))
  cluster = cm.parse_cluster(args.cluster, args.gpus_per_node, args.inter_node_gbps * 1e9 / 8)
  batch = args.batch or config.train.batch_size
  seq_len = args.seq_len or config.data.seq_len
  profiles = {}  # {(level, seq_len): {kind: KindProfile}}
  for item in args.profile:
    kind, sep, path = item.partition("=")
    if not sep or not path:
      raise UsageError(f"--profile {item!r} is not KIND=PATH; e.g. H100-SXM=h100.json")
    data, prof = cm.read_profile(path), cm.load_profile(path)
    if gpu_spec(kind).name != prof.kind:
      raise UsageError(f"--profile {item!r}: the file measured {data['device_kind']!r} "
                       f"({prof.kind}), not {gpu_spec(kind).name}")
    profiles.setdefault((data["level"].upper(), data["seq_len"]), {})[prof.kind] = prof
    print(f"profile {path}: {prof.kind} at {data['level']}, T={data['seq_len']} (used for "
          "that level and sequence length only)")
  runs = []
  model = model_shape(config.model)
  stages = args.pipeline or config.parallel.pipeline_parallel_size
  if stages > 1:
    cm.stage_kinds(cluster, stages)  # a bad stage count fails before any table
  for level in [x.strip().upper() for x in (args.levels or "O0,O1,O2,O3").split(",")
                if x.strip()]:
    for stage in sorted({opt_level(level).zero_stage_for(z) for z in _stages(args.zero)}):
      runs.append(cm.predict(cluster, model, seq_len, batch, level, stage,
                             profiles=profiles.get((level, seq_len))))
  uneven = cm.uniform_reason(batch, cluster.gpus)
  if uneven:
    print(f"fp8jax simulate: warning: {uneven}: no uniform split to compare with; use --batch "
          f"{cluster.gpus} or a multiple of it", file=sys.stderr)
  print(cm.format_table(runs))
  if stages > 1:
    schedule = args.schedule or config.parallel.pipeline_schedule
    spec = config.parallel.pipeline_layers
    given = None if isinstance(spec, str) or len(spec) != stages else tuple(spec)
    piped = [cm.predict_pipeline(cluster, model, seq_len, batch, p.level, p.zero_stage, stages,
                                 schedule, given, profiles=profiles.get((p.level, seq_len)))
             for p in runs]
    print(f"\npipeline of {stages} stages ({schedule}) over {cluster.describe()}: each stage "
          f"{cluster.gpus // stages} consecutive GPUs (its data-parallel ranks); layers split "
          "by stage speed (auto, as parallel.pipeline_layers: auto) and evenly; the slowest "
          "stage sets each tick; GiB/GPU holds the deepest stage's layers during the step\n")
    print(cm.format_pipeline_table(piped))
  return 0


DESCRIPTION = ("FP8 training of LLMs with JAX and Flax (MS-AMP levels O0-O3). Bad input ends "
               "in one line 'fp8jax: error: ...' and exit code 2; --debug shows the traceback.")


_TRAIN_DESCRIPTION = "\n\n".join([
    textwrap.fill("Trains the reference decoder LM as a YAML config says; a config file names "
                  "only the keys it changes. Every config key is listed with its default value "
                  "and what it does in the documented base config:"),
    "  " + (BASE_CONFIG if os.path.isfile(BASE_CONFIG) else
            "configs/base.yaml of the fp8jax source tree"),
    textwrap.fill("Without a terminal (or with --no-progress) one line per log window shows "
                  "step, loss, tokens/s and time left. A run folder that holds an earlier run "
                  "is refused unless the run resumes it (checkpoint.auto_resume) or "
                  "--overwrite replaces it. Ctrl-C stops after the current step (saving a "
                  "checkpoint when checkpointing is on) and exits 130; a second Ctrl-C "
                  "aborts."),
])


def _add_debug(parser: argparse.ArgumentParser, top: bool) -> None:
  # accepted before or after the command; a subcommand's default must not hide the top one's
  parser.add_argument("--debug", action="store_true", default=False if top else
                      argparse.SUPPRESS, help="show the traceback of any error")


def _add_check(sub) -> argparse.ArgumentParser:
  check = sub.add_parser("check", help="devices, FP8 support, FP8 vs BF16 layer comparison")
  check.add_argument("--shape", type=int, nargs=3, metavar=("M", "K", "N"),
                     help="Dense layer shape (default: 8192^3 on GPU, 512x1024x1024 on CPU)")
  check.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
  check.set_defaults(func=cmd_check)
  return check


def _add_train(sub) -> argparse.ArgumentParser:
  train = sub.add_parser(
      "train", help="train the reference decoder LM from a YAML config",
      formatter_class=argparse.RawDescriptionHelpFormatter, description=_TRAIN_DESCRIPTION)
  train.add_argument("--config", default=None,
                     help="YAML config, e.g. configs/tiny.yaml (default: the built-in defaults, "
                          "as listed in configs/base.yaml: a 4x128 decoder on the stdlib "
                          "corpus)")
  train.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                     help="override one config value, parsed as YAML (repeatable; keys: "
                          "configs/base.yaml)")
  train.add_argument("--no-progress", action="store_true",
                     help="log lines instead of a progress bar (the default without a terminal)")
  train.add_argument("--overwrite", action="store_true",
                     help="replace an earlier run in the run folder (its logs and checkpoints) "
                          "instead of refusing to mix with it")
  train.set_defaults(func=cmd_train)
  return train


def _add_profile(sub) -> argparse.ArgumentParser:
  prof = sub.add_parser("profile", help="measure seconds per microbatch vs microbatch size on "
                        "this device kind (a throughput profile for parallel.device_map)")
  prof.add_argument("--config", default=None, help="YAML config (model, level, seq_len)")
  prof.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override one config value (repeatable)")
  prof.add_argument("--sizes", default=None, metavar="M1,M2,...",
                    help="microbatch sizes in sequences (default: powers of two up to 4x the "
                         "config's microbatch)")
  prof.add_argument("--steps", type=int, default=5, help="timed steps per size (median)")
  prof.add_argument("--memory-limit-gib", type=float, default=None,
                    help="sizes whose compiled peak exceeds this do not fit (default: the "
                         "device's memory)")
  prof.add_argument("--out", default=None, help="JSON path (default: profiles/<kind>-<level>-"
                    "T<seq_len>.json)")
  prof.set_defaults(func=cmd_profile)
  return prof


def _add_launch(sub) -> argparse.ArgumentParser:
  launch = sub.add_parser("launch", help="run a command as N local processes (jax.distributed "
                          "variables set), restart failed attempts")
  launch.add_argument("-n", "--num-processes", type=int, default=1, help="processes (default 1)")
  launch.add_argument("--max-restarts", type=int, default=0,
                      help="restart all processes after a failure up to this many times")
  launch.add_argument("--grace", type=float, default=30.0,
                      help="seconds the others get to stop after one fails (then SIGTERM, "
                           "SIGKILL)")
  launch.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
  launch.set_defaults(func=cmd_launch)
  return launch


def _add_plot(sub) -> argparse.ArgumentParser:
  plot = sub.add_parser("plot", help="loss curves and FP8 scales of runs, overlaid, to PNG")
  plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  plot.add_argument("-o", "--output", default="runs.png", help="PNG path (default: runs.png)")
  plot.set_defaults(func=cmd_plot)
  return plot


def _add_simulate(sub) -> argparse.ArgumentParser:
  sim = sub.add_parser("simulate", help="predicted step time of a mixed-GPU cluster, uniform "
                       "vs throughput-balanced microbatches (fp8jax.parallel.cost_model); "
                       "--table: per-GPU memory and step time of 7B/70B/175B on 8-1024 GPUs")
  sim.add_argument("--cluster", default=None, help="e.g. 8xA100-80GB+8xH100-SXM")
  sim.add_argument("--config", default=None, help="YAML config, e.g. configs/gpt_7b.yaml")
  sim.add_argument("--table", action="store_true",
                   help="for each of --models on each of --gpus GPUs of --kind and each level: "
                        "the fastest ZeRO stage x tensor x pipeline x microbatch that fits, "
                        "its per-GPU memory, step time, tokens/s and MFU "
                        "(fp8jax.parallel.sizing); --cluster and --config are not used")
  sim.add_argument("--models", default="7B,70B,175B",
                   help=f"--table: models among {', '.join(TABLE_MODELS)} (default all)")
  sim.add_argument("--gpus", default="8,64,256,1024",
                   help="--table: GPU counts, comma-separated (default 8,64,256,1024)")
  sim.add_argument("--kind", default="H100-SXM", help="--table: GPU kind (default H100-SXM)")
  sim.add_argument("--levels", default=None,
                   help="comma-separated (default O0,O1,O2,O3; --table: O0,O3)")
  sim.add_argument("--zero", default="1,3", help="ZeRO stages, comma-separated (default 1,3)")
  sim.add_argument("--batch", type=int, default=None,
                   help="global batch in sequences (default: the config's train.batch_size; "
                        "--table: 1024)")
  sim.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default: the config's data.seq_len; --table: "
                        "4096)")
  sim.add_argument("--gpus-per-node", type=int, default=8, help="default 8")
  sim.add_argument("--inter-node-gbps", type=float, default=400.0,
                   help="inter-node bandwidth per GPU, Gb/s (default 400)")
  sim.add_argument("--pipeline", type=int, default=None,
                   help="pipeline stages: also print the pipeline's step with its layers split "
                        "by stage speed vs evenly (default: the config's "
                        "parallel.pipeline_parallel_size; 1: none)")
  sim.add_argument("--schedule", default=None, choices=("1f1b", "gpipe"),
                   help="--pipeline's schedule (default: the config's "
                        "parallel.pipeline_schedule)")
  sim.add_argument("--profile", action="append", default=[], metavar="KIND=PATH",
                   help="measured profile JSON (`fp8jax profile`) for one kind (repeatable)")
  sim.set_defaults(func=cmd_simulate)
  return sim


def _add_convert_hf(sub) -> argparse.ArgumentParser:
  conv = sub.add_parser("convert-hf", help="write a llama run's checkpoint as a Hugging Face "
                        "checkpoint (config.json + safetensors); import one with "
                        "model.init_from: hf:DIR")
  conv.add_argument("run_dir", metavar="RUN_DIR")
  conv.add_argument("out_dir", metavar="OUT_DIR")
  conv.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
  conv.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"),
                    help="tensor dtype written (default bfloat16)")
  conv.add_argument("--overwrite", action="store_true", help="replace weights in OUT_DIR")
  conv.set_defaults(func=cmd_convert_hf)
  return conv


def _add_tokenizer(sub) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
  """The `tokenizer` command and its `train` subcommand."""
  tok = sub.add_parser("tokenizer", help="tokenizers for text data (data.tokenizer)")
  tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
  tok_train = tok_sub.add_parser("train", help="train a byte-level BPE tokenizer on text files "
                                 "(default: the built-in stdlib corpus)")
  tok_train.add_argument("files", nargs="*", metavar="FILE",
                         help="text files, folders or globs (default: the stdlib corpus)")
  tok_train.add_argument("--vocab-size", type=int, default=4096, help="ids (default 4096)")
  tok_train.add_argument("-o", "--output", default="tokenizer.json",
                         help="tokenizer.json path (default: tokenizer.json)")
  tok_train.add_argument("--max-bytes", type=int, default=4 << 20,
                         help="text bytes read at most (default 4 MiB)")
  tok_train.set_defaults(func=cmd_tokenizer_train)
  return tok, tok_train


def _checkpoint_parent() -> argparse.ArgumentParser:
  """The arguments `eval` and `generate` share: the model to load and how to run it."""
  model_help = ("a run folder of fp8jax train (its newest checkpoint) or hf:DIR (a Hugging "
                "Face LLaMA checkpoint)")
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("model", metavar="RUN_DIR|hf:DIR", help=model_help)
  common.add_argument("--level", default=None, type=str.upper,
                      choices=("O0", "O1", "O2", "O3"),
                      help="O0 (BF16 GEMMs) or O1-O3 (FP8 GEMMs; the levels differ only in "
                           "training). Default: the run's level; O0 for hf:DIR. FP8 scales "
                           "come from the run's checkpoint, else from forward passes")
  common.add_argument("--step", type=int, default=None,
                      help="the run's checkpoint step (default: the newest)")
  common.add_argument("--tokenizer", default=None, metavar="PATH|bytes",
                      help="tokenizer.json for text (default: the run's data.tokenizer, or "
                           "DIR/tokenizer.json); 'bytes': byte-level ids")
  common.add_argument("--dtype", default=None, choices=("bfloat16", "float32"),
                      help="compute dtype (default: the run's; bfloat16 for hf:DIR)")
  return common


def _add_eval(sub, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
  ev = sub.add_parser("eval", parents=[common],
                      help="loss, perplexity and bits per byte of a checkpoint on a token "
                           "source, at BF16 or an FP8 level")
  ev.add_argument("--data", default=None, metavar="SOURCE",
                  help="stdlib, site-packages, text files/dirs/globs or a .bin (default: the "
                       "run's data.source)")
  ev.add_argument("--split", default="val", choices=("val", "train"),
                  help="the split of SOURCE (default val: its last data.val_fraction)")
  ev.add_argument("--batches", type=int, default=50,
                  help="batches evaluated at most, in order (default 50)")
  ev.add_argument("--batch-size", type=int, default=None,
                  help="sequences per batch (default: the run's microbatch; 8 for hf:DIR)")
  ev.add_argument("--seq-len", type=int, default=None,
                  help="tokens per sequence (default: the run's; min(max_seq_len, 1024))")
  ev.add_argument("--max-bytes", type=int, default=None,
                  help="text bytes read at most (default: the run's data.max_bytes; 32 MiB)")
  ev.add_argument("--calibration-batches", type=int, default=4,
                  help="train-split batches whose forward passes set FP8 scales when the "
                       "checkpoint has none (default 4)")
  ev.add_argument("--json", action="store_true", help="print one JSON object")
  ev.set_defaults(func=cmd_eval)
  return ev


def _add_generate(sub, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
  gen = sub.add_parser("generate", parents=[common],
                       help="continue a prompt with a key/value cache (gpt and llama)")
  gen.add_argument("--prompt", required=True, help="the text to continue")
  gen.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated at most (default: 128, or what max_seq_len leaves)")
  gen.add_argument("--temperature", type=float, default=0.8,
                   help="0: greedy (argmax); > 0: sampling temperature (default 0.8)")
  gen.add_argument("--top-k", type=int, default=40,
                   help="sample among the k most likely tokens (0: all; default 40)")
  gen.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
  gen.set_defaults(func=cmd_generate)
  return gen


def build_parser() -> argparse.ArgumentParser:
  """The `fp8jax` argument parser: one subcommand per ``cmd_*`` function (``func``)."""
  parser = argparse.ArgumentParser(prog="fp8jax", description=DESCRIPTION)
  _add_debug(parser, top=True)
  sub = parser.add_subparsers(dest="command", required=True)
  commands = [_add_check(sub), _add_train(sub), _add_profile(sub), _add_launch(sub),
              _add_plot(sub), _add_simulate(sub), _add_convert_hf(sub), *_add_tokenizer(sub)]
  common = _checkpoint_parent()
  commands += [_add_eval(sub, common), _add_generate(sub, common)]
  bench.configure(sub.add_parser("bench", help="measure fp8jax's speed claims here: mlp, step, "
                                 "optim, comm or all, each against its baselines in one run"))
  for command in commands:
    _add_debug(command, top=False)
  return parser


@contextlib.contextmanager
def plain_warnings():
  """While a command runs, fp8jax's log records of level WARNING and above print on stderr
  as their message alone (``fp8jax: ...``), whatever handler another library gave the root
  logger (orbax's prints ``WARNING:fp8jax:fp8jax: ...``); the logger is restored after."""
  log = logging.getLogger("fp8jax")
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(message)s"))
  handler.setLevel(logging.WARNING)
  propagate = log.propagate
  log.addHandler(handler)
  log.propagate = False
  try:
    yield
  finally:
    log.removeHandler(handler)
    log.propagate = propagate


def main(argv=None) -> int:
  """Runs one command; returns its exit code (see the module docstring for errors)."""
  args = build_parser().parse_args(argv)
  try:
    with plain_warnings():
      return args.func(args)
  except KeyboardInterrupt:
    if args.debug:
      raise
    print("fp8jax: interrupted", file=sys.stderr)
    return INTERRUPT_EXIT
  except Exception as e:  # noqa: BLE001 (bugs are re-raised with their traceback)
    code = error_exit_code(e)
    if code is None or args.debug:
      raise
    print(error_line(e), file=sys.stderr)
    return code


if __name__ == "__main__":
  sys.exit(main())
