"""``fp8jax bench``: fp8jax's speed claims measured on this machine in one process, each against
its baselines measured in the same run (``benchmarks/RESULTS.md`` holds the H200 numbers).

Subjects (one module each): ``mlp`` (:mod:`fp8jax.bench.mlp`: an MLP block's forward+backward
in BF16, with Flax's FP8 op and with fp8jax), ``step`` (:mod:`fp8jax.bench.step`: train-step
tokens/s at O0 and O2), ``optim`` (:mod:`fp8jax.bench.optim`: the fused O2 update against
``optax.adamw``), ``comm`` (:mod:`fp8jax.bench.comm`: FP8 reduce-scatter against BF16
``psum_scatter``, >= 2 devices), and ``all`` of them in that order. Defaults are the GPU shapes
of RESULTS.md; ``--small`` runs each in well under a minute on a CPU. Tables print as Markdown
(rich on a terminal); ``--json PATH`` also writes every table, the devices and the versions.

Each subject module has ``add_arguments(parser)`` (its flags), ``prepare(args)`` (parsed flags
checked: a function ``log -> [report.Table]``) and ``measure(...)`` (a table from Python
values).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax

import fp8jax
from fp8jax.bench import comm, mlp, optim, report, step
from fp8jax.dot import native_fp8_reason

SUBJECTS = {"mlp": mlp, "step": step, "optim": optim, "comm": comm}
HELP = {"mlp": "MLP block forward+backward: BF16 vs Flax's FP8 op vs fp8jax",
        "step": "train-step tokens/s of the reference decoder, O0 vs O2 (best settings)",
        "optim": "the fused O2 optimizer update vs optax.adamw",
        "comm": "FP8 gradient reduce-scatter vs BF16 psum_scatter (>= 2 devices)",
        "all": "mlp, step, optim and comm with their defaults, in that order"}


def _add_common(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--small", action="store_true",
                      help="small shapes for a quick run on a CPU (default: the GPU shapes "
                           "of benchmarks/RESULTS.md)")
  parser.add_argument("--iters", type=int, default=None, metavar="N",
                      help="timed repetitions per variant (median; default per subject)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
  parser.add_argument("--json", default=None, metavar="PATH",
                      help="also write the results as JSON to PATH")
  parser.add_argument("--plain", action="store_true",
                      help="Markdown tables even on a terminal")
  parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                      help="show the traceback of any error")


def configure(parser: argparse.ArgumentParser) -> None:
  """Adds the subjects and their flags to `parser` (``fp8jax bench``'s parser); the parsed
  namespace's ``func`` runs them (:func:`main`)."""
  parser.description = __doc__.split("\n\n")[0].replace("``", "")
  parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                      help="show the traceback of any error")
  sub = parser.add_subparsers(dest="subject", required=True, metavar="SUBJECT")
  for name, text in HELP.items():
    p = sub.add_parser(name, help=text, description=text)
    _add_common(p)
    if name in SUBJECTS:
      SUBJECTS[name].add_arguments(p)
    p.set_defaults(func=main)


def subject_args(name: str, common: argparse.Namespace) -> argparse.Namespace:
  """`name`'s default flags with the common ones (small, iters, seed) taken from `common`."""
  parser = argparse.ArgumentParser()
  _add_common(parser)
  SUBJECTS[name].add_arguments(parser)
  args = parser.parse_args([])
  for key in ("small", "iters", "seed"):
    setattr(args, key, getattr(common, key))
  return args


def header() -> dict:
  """The versions, devices and XLA flags of this run."""
  devices = jax.local_devices()
  reason = native_fp8_reason()
  return {"fp8jax": fp8jax.__version__, "jax": jax.__version__,
          "backend": jax.default_backend(), "devices": [d.device_kind for d in devices],
          "fp8_gemms": "native" if reason is None else f"emulated ({reason})",
          "xla_flags": os.environ.get("XLA_FLAGS", "")}


def _log(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
  """Runs the subject(s) of parsed ``fp8jax bench`` flags; prints each table as it is done
  and rewrites the JSON file after each subject. Returns the exit code (0; a subject that
  cannot run here, ``comm`` on one device, is reported as skipped)."""
  if args.iters is not None and args.iters < 1:
    raise ValueError(f"bench {args.subject}: --iters {args.iters}: must be >= 1")
  if args.seed < 0:
    raise ValueError(f"bench {args.subject}: --seed {args.seed}: must be >= 0")
  if jax.process_count() > 1:
    raise ValueError("fp8jax bench measures the devices of one process; run it without "
                     "fp8jax launch")
  names = list(SUBJECTS) if args.subject == "all" else [args.subject]
  runs = {name: SUBJECTS[name].prepare(args if args.subject == name else
                                       subject_args(name, args)) for name in names}
  info = header()
  doc = {**info, "args": {k: v for k, v in vars(args).items() if k != "func"},
         "subjects": {}}
  print(f"fp8jax {info['fp8jax']}, jax {info['jax']}, {len(info['devices'])} x "
        f"{info['devices'][0]} ({info['backend']}), FP8 GEMMs {info['fp8_gemms']}; "
        f"XLA_FLAGS={info['xla_flags']!r}\n", flush=True)
  if info["backend"] != "gpu" and not args.small:
    _log(f"fp8jax bench: no GPU ({info['backend']}): the GPU-sized defaults may take very "
         "long here; --small is a quick run")
  for name, run in runs.items():
    t0 = time.perf_counter()
    try:
      tables = run(_log)
    except report.Skipped as e:
      print(f"{name}: skipped: {e}\n", flush=True)
      doc["subjects"][name] = {"skipped": str(e), "seconds": time.perf_counter() - t0}
    else:
      for table in tables:
        report.show(table, plain=args.plain)
      doc["subjects"][name] = {"tables": [t.to_dict() for t in tables],
                               "seconds": time.perf_counter() - t0}
      _log(f"bench {name}: {time.perf_counter() - t0:.1f} s")
    if args.json:
      report.write_json(args.json, doc)
  return 0
