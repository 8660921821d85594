"""Which parallel layout trains a model on N GPUs of one kind, and how fast.

For a level, :func:`best_layout` tries every ZeRO stage x tensor size x pipeline size x
microbatch size of N GPUs and returns the fastest step that fits (or, when none does, the
one that needs the least memory), as a :class:`LayoutStep`: per-GPU memory
(:func:`fp8jax.parallel.step_memory.device_memory`), step time, tokens/s and MFU.
``fp8jax simulate --table`` prints it for 7B, 70B and 175B on 8 to 1024 GPUs.

GPUs are placed tensor ranks innermost, then data-parallel ranks, then pipeline stages: a
group's collectives run over NVLink when the GPUs it spans fit one node
(``gpus_per_node``), else over the inter-node link per GPU. A step of k microbatches of m
sequences per data-parallel rank (k = global batch / (data x m)) is

  step = k x t / (1 - b) + tensor comm + (1 - overlap) x (pipeline + data comm) + update

with t one microbatch's seconds on one GPU (:func:`fp8jax.parallel.cost_model.
microbatch_seconds` / (tensor x P)), b the schedule's bubble fraction
(:func:`fp8jax.parallel.pipeline.bubble_fraction`: (P-1)/(k+P-1) with GPipe,
2(P-1)/(k+2(P-1)) with the lockstep 1F1B), tensor comm 4 all-reduces of the microbatch's activations (n d x compute bytes)
per layer and microbatch (2 more under remat: the recomputed forward), on the critical path;
pipeline comm one activation forward and one gradient back per microbatch and stage boundary;
data comm the ZeRO stage's collectives of the GPU's parameters over the data-parallel ranks
(:func:`fp8jax.parallel.cost_model.comm_bytes`); the update from HBM bytes. The compute
efficiency (MFU) is the same at every tensor size (tensor parallelism's smaller GEMMs are not
modelled). Pure Python, deterministic.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple, Sequence

from fp8jax.hardware import GiB, fp8_native, gpu_spec
from fp8jax.parallel import cost_inputs as ci, cost_model as cm, step_memory as sm
from fp8jax.parallel.pipeline import bubble_fraction

STAGES = (1, 3)  # the ZeRO stages tried by default


class LayoutStep(NamedTuple):
  """One setting of `gpus` GPUs of `kind` and its predicted step. Seconds; bytes per GPU."""

  kind: str
  gpus: int
  level: str
  zero_stage: int
  layout: sm.Layout
  microbatch: int          # sequences per microbatch
  microbatches: int        # per data-parallel rank and step
  memory: sm.DeviceMemory  # the fullest GPU's
  fits: bool               # memory.peak within the kind's usable HBM
  compute_s: float         # k microbatches through one pipeline stage, no bubble
  bubble_s: float
  tensor_comm_s: float
  pipeline_comm_s: float   # before overlap
  data_comm_s: float       # before overlap
  optimizer_s: float
  step_s: float
  tokens_per_s: float
  mfu: float               # model FLOPs / BF16 peak of all GPUs


def _bandwidth(span: int, gpus_per_node: int, nvlink_bw: float, inter_node_bw: float) -> float:
  """Bytes/s per GPU of a collective over GPUs that span `span` consecutive GPUs."""
  return nvlink_bw if span <= gpus_per_node else inter_node_bw


def _check_int(name: str, value, low: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    raise ValueError(f"{name}={value!r} is not allowed; use an integer >= {low}")
  return value


def layout_step(model: ci.ModelShape, kind: str, level: str, zero_stage: int,
                layout: sm.Layout, seq_len: int, global_batch: int, microbatch: int,
                a: ci.Assumptions = ci.Assumptions(), gpus_per_node: int = 8,
                inter_node_bw: float = 50e9) -> LayoutStep:
  """The step of `model` on ``layout.gpus`` GPUs of `kind` at `level` and ZeRO stage
  `zero_stage` (over ``layout.data``), `global_batch` sequences of `seq_len` tokens per step
  in microbatches of `microbatch` sequences (see the module docstring).

  Raises ValueError when the batch does not split into whole microbatches per
  data-parallel rank, or the model's layers or widths do not split over the layout.
  """
  layout = layout.check()
  level = ci._check_level(level)
  stage = ci._check_stage(level, zero_stage)
  a = a.check()
  spec = gpu_spec(kind)
  _check_int("seq_len", seq_len)
  _check_int("global_batch", global_batch)
  _check_int("microbatch", microbatch)
  d, t, pp = layout.data, layout.tensor, layout.pipeline
  if global_batch % (d * microbatch):
    raise ValueError(f"global batch {global_batch} does not split into microbatches of "
                     f"{microbatch} over {d} data-parallel ranks; use a microbatch that divides "
                     f"{global_batch} / {d}")
  if pp > model.n_layers:
    raise ValueError(f"pipeline={pp} is not allowed for {model.n_layers} layers; use at most "
                     "one stage per layer")
  if model.d_ff % t or model.d_model % t:
    raise ValueError(f"tensor={t} does not divide d_model={model.d_model} and "
                     f"d_ff={model.d_ff}; use a tensor size that divides both")
  k = global_batch // (d * microbatch)
  emulated = ci._level(level).fp8_gemms and not fp8_native(spec.name)
  memory = sm.device_memory(model, level, stage, seq_len, microbatch, k, layout, a, emulated)
  t_mb = cm.microbatch_seconds(model, seq_len, microbatch, level, spec.name, a) / (t * pp)
  layers = -(-model.n_layers // pp)
  tokens = microbatch * seq_len
  activation = tokens * model.d_model * model.compute_bytes
  tensor_comm = 0.0
  if t > 1:
    per_layer = 4 + (2 if model.remat else 0)
    tensor_comm = k * layers * per_layer * 2 * (t - 1) / t * activation / (
        _bandwidth(t, gpus_per_node, spec.nvlink_bw, inter_node_bw) * a.comm_efficiency)
  pipe_comm = 0.0
  if pp > 1:
    pipe_comm = k * 2 * activation / (
        _bandwidth(d * t * pp, gpus_per_node, spec.nvlink_bw, inter_node_bw) * a.comm_efficiency)
  # a stage's parameters: the last stage's (LM head) or, one stage, the whole model's
  kernels = layers * model.layer_kernels / t + model.head_kernels
  others = layers * model.layer_others + (model.embedding if pp == 1 else 0)
  payload = cm.comm_bytes(level, stage, kernels, others, k, False,
                          compute_bytes=model.compute_bytes)
  bw = _bandwidth(d * t, gpus_per_node, spec.nvlink_bw, inter_node_bw)
  data_comm = sum(cm.ring_seconds(b, d, bw, a) for b in payload.values())
  eff = a.fp8_optimizer_hbm_efficiency if ci._level(level).scaled_master else a.hbm_efficiency
  optimizer = ci.optimizer_bytes_per_param(level) * (kernels + others) / (
      d if stage >= 1 else 1) / (spec.hbm_bw * eff)
  compute = k * t_mb
  idle = bubble_fraction(pp, k, layout.schedule) if pp > 1 else 0.0
  bubble = compute * idle / (1 - idle)
  step = compute + bubble + tensor_comm + (1 - a.overlap) * (pipe_comm + data_comm) + optimizer
  tokens_per_s = global_batch * seq_len / step
  mfu = model.flops_per_token(seq_len) * tokens_per_s / (layout.gpus * spec.bf16_flops)
  return LayoutStep(spec.name, layout.gpus, level, stage, layout, microbatch, k, memory,
                    memory.peak <= sm.usable_bytes(spec.name, a), compute, bubble, tensor_comm,
                    pipe_comm, data_comm, optimizer, step, tokens_per_s, mfu)


def layouts(gpus: int, model: ci.ModelShape, global_batch: int, gpus_per_node: int = 8,
            schedule: str = "1f1b") -> Iterator[sm.Layout]:
  """Every layout of `gpus` GPUs: tensor sizes of powers of two within one node that divide
  d_model and d_ff, pipeline sizes of powers of two up to the layer count, and a
  data-parallel size that divides the global batch."""
  _check_int("gpus", gpus)
  t = 1
  while t <= min(gpus, gpus_per_node):
    if gpus % t == 0 and model.d_ff % t == 0 and model.d_model % t == 0:
      pp = 1
      while pp <= model.n_layers and t * pp <= gpus:
        if (gpus // t) % pp == 0 and global_batch % (gpus // (t * pp)) == 0:
          yield sm.Layout(gpus // (t * pp), t, pp, schedule)
        pp *= 2
    t *= 2


def candidates(model: ci.ModelShape, kind: str, gpus: int, level: str, seq_len: int,
               global_batch: int, stages: Sequence[int] = STAGES,
               a: ci.Assumptions = ci.Assumptions(), gpus_per_node: int = 8,
               inter_node_bw: float = 50e9, schedule: str = "1f1b") -> list[LayoutStep]:
  """The step of every stage in `stages` (raised to the level's least) x :func:`layouts` x
  power-of-two microbatch that divides the batch of a data-parallel rank into at least as
  many microbatches as the layout has pipeline stages (what the step runs)."""
  level = ci._check_level(level)
  for name, value in (("gpus", gpus), ("seq_len", seq_len), ("global_batch", global_batch)):
    _check_int(name, value)
  out = []
  for stage in sorted({ci._level(level).zero_stage_for(ci._check_stage("O0", s))
                       for s in stages}):
    for layout in layouts(gpus, model, global_batch, gpus_per_node, schedule):
      per_rank = global_batch // layout.data
      m = 1
      while m <= per_rank:
        if per_rank % m == 0 and per_rank // m >= layout.pipeline:
          out.append(layout_step(model, kind, level, stage, layout, seq_len, global_batch, m,
                                 a, gpus_per_node, inter_node_bw))
        m *= 2
  return out


def best_layout(model: ci.ModelShape, kind: str, gpus: int, level: str, seq_len: int,
                global_batch: int, stages: Sequence[int] = STAGES,
                a: ci.Assumptions = ci.Assumptions(), gpus_per_node: int = 8,
                inter_node_bw: float = 50e9, schedule: str = "1f1b") -> LayoutStep:
  """The fastest of :func:`candidates` that fits (ties: less memory); when none fits, the
  one that needs the least memory (``fits`` False). ValueError when there is no layout."""
  steps = candidates(model, kind, gpus, level, seq_len, global_batch, stages, a,
                     gpus_per_node, inter_node_bw, schedule)
  if not steps:
    raise ValueError(f"no layout of {gpus} GPUs splits a global batch of {global_batch} "
                     "sequences; use a batch divisible by the data-parallel size")
  fitting = [s for s in steps if s.fits]
  if fitting:
    return min(fitting, key=lambda s: (s.step_s, s.memory.peak))
  return min(steps, key=lambda s: (s.memory.peak, s.step_s))


def assumption_lines(seq_len: int, global_batch: int, gpus_per_node: int,
                     inter_node_bw: float, a: ci.Assumptions = ci.Assumptions()) -> list[str]:
  """The table's assumptions, one per line."""
  return [f"global batch {global_batch} sequences x {seq_len} tokens "
          f"({global_batch * seq_len / 2**20:.0f}M tokens) per step; full remat, flash "
          "attention, BF16 compute",
          f"{gpus_per_node} GPUs per node on NVLink, {inter_node_bw * 8 / 1e9:.0f} Gb/s "
          "per GPU between nodes; GPUs placed tensor ranks innermost, then data, then "
          "pipeline; 1F1B pipeline schedule",
          "tensor parallelism: 4 all-reduces of activations per layer and microbatch (6 "
          "under remat), not overlapped; same MFU at every tensor size",
          *a.describe()]


def format_rows(rows: Sequence[tuple[str, LayoutStep]], a: ci.Assumptions = ci.Assumptions()
                ) -> str:
  """Markdown table of (model name, step) rows."""
  lines = ["| model | GPUs | level | ZeRO | tensor | pipe | data | mb x k | GiB/GPU | fits "
           "| step s | tokens/s | MFU |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for name, s in rows:
    usable = sm.usable_bytes(s.kind, a) / GiB
    fits = "yes" if s.fits else f"no (> {usable:.0f})"
    lo = s.layout
    lines.append(f"| {name} | {s.gpus} | {s.level} | {s.zero_stage} | {lo.tensor} | "
                 f"{lo.pipeline} | {lo.data} | {s.microbatch} x {s.microbatches} | "
                 f"{s.memory.peak / GiB:.1f} | {fits} | {s.step_s:.2f} | "
                 f"{s.tokens_per_s:,.0f} | {s.mfu:.3f} |")
  return "\n".join(lines)


def gpu_counts(text: str) -> list[int]:
  """GPU counts of "8,64,256" (ValueError naming a bad entry)."""
  out = []
  for part in str(text).split(","):
    try:
      value = int(part)
    except ValueError:
      value = None
    if value is None or value < 1:
      raise ValueError(f"GPU count {part.strip()!r} in {text!r} is not allowed; use "
                       "comma-separated integers >= 1, e.g. 8,64,256,1024")
    out.append(value)
  return out

