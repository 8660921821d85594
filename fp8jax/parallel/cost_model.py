"""Step-time model of a data-parallel cluster that mixes GPU kinds, uniform vs balanced split.

Every GPU is one data-parallel group with equal microbatch shapes; the uniform split gives
each the same number of microbatches (a batch that does not split equally over the GPUs has no
uniform split: it is infeasible, whatever the order of the cluster's groups), the balanced
split (:mod:`fp8jax.parallel.balance`) gives faster kinds more, and may leave slow GPUs idle
(they still hold their ZeRO shards and take part in the collectives). A step is modelled as

  step = compute makespan + (1 - overlap) x communication + optimizer update

with compute from FLOPs and an MFU calibrated on fp8jax runs (or from measured profiles),
communication from ring-collective bytes over the slowest link, the update from HBM bytes.
Memory per GPU (:func:`fp8jax.parallel.step_memory.device_memory`, the package's one memory
model of a train step) decides the largest microbatch and whether a kind can run the level at
all. Pure Python: no devices are needed. Every modelling constant is a field of
:class:`~fp8jax.parallel.cost_inputs.Assumptions`; GPU facts come from :mod:`fp8jax.hardware`,
the model's from a :class:`~fp8jax.parallel.cost_inputs.ModelShape`
(``fp8jax.train.memory.model_shape`` builds one from a model config).
"""
from __future__ import annotations

import math
import os
import re
from typing import Mapping, NamedTuple, Sequence

from fp8jax.hardware import GPU_SPECS, GiB, fp8_native, gpu_spec
from fp8jax.parallel import profile as profile_lib
from fp8jax.parallel.balance import KindProfile, balance_counts, makespan, uniform_counts
from fp8jax.parallel.cost_inputs import Assumptions, ModelShape, _check_level, _check_stage, \
    _level, gather_bytes, grad_comm_bytes, master_bytes, optimizer_bytes_per_param
from fp8jax.parallel.pipeline import bubble_fraction, check_stage_layers, split_layers
from fp8jax.parallel.step_memory import Layout, device_memory, usable_bytes

PROFILE_FORMAT = profile_lib.FORMAT


# ----------------------------------------------------------------------------- cluster

class ClusterSpec(NamedTuple):
  """GPU groups as (kind, count) in mesh order; bandwidths bytes/s per GPU per direction."""

  groups: tuple[tuple[str, int], ...]
  gpus_per_node: int = 8
  inter_node_bw: float = 50e9  # 400 Gb/s, one NIC per GPU

  @property
  def gpus(self) -> int:
    """Data-parallel GPUs in all."""
    return sum(n for _, n in self.groups)

  def kinds(self) -> tuple[str, ...]:
    """The kind of every GPU, in mesh order."""
    return tuple(k for k, n in self.groups for _ in range(n))

  def describe(self) -> str:
    """The cluster as parse_cluster reads it, e.g. "8xA100-80GB+8xH100-SXM"."""
    return "+".join(f"{n}x{k}" for k, n in self.groups)


_GROUP = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\S.*?)\s*$")


def parse_cluster(text: str, gpus_per_node: int = 8, inter_node_bw: float = 50e9) -> ClusterSpec:
  """ClusterSpec of "8xA100-80GB+8xH100-SXM" (groups joined by "+", each COUNTxKIND)."""
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"cluster {text!r} is empty; use e.g. '8xA100-80GB+8xH100-SXM'")
  if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
    raise ValueError(f"gpus_per_node={gpus_per_node!r} is not allowed; use an integer >= 1")
  if not (inter_node_bw > 0 and math.isfinite(inter_node_bw)):
    raise ValueError(f"inter_node_bw={inter_node_bw!r} is not allowed; use bytes/s > 0")
  groups = []
  for part in text.split("+"):
    match = _GROUP.match(part)
    if not match:
      raise ValueError(f"cluster group {part.strip()!r} in {text!r} is not COUNTxKIND; use "
                       f"e.g. '8xH100-SXM' (kinds: {sorted(GPU_SPECS)})")
    count = int(match.group(1))
    if count < 1:
      raise ValueError(f"cluster group {part.strip()!r} has count {count}; use a count >= 1")
    groups.append((gpu_spec(match.group(2)).name, count))
  return ClusterSpec(tuple(groups), gpus_per_node, float(inter_node_bw))



# ----------------------------------------------------------------------------- time

_OVERHEAD_KIND = "H200"  # where Assumptions.microbatch_overhead_s_per_param was measured


def fp8_speedup(d_model: int, a: Assumptions) -> float:
  """Native FP8 step speedup over BF16 at this width (linear between the measured widths)."""
  lo, hi = a.fp8_speedup_small_d, a.fp8_speedup_large_d
  t = min(max((d_model - lo) / (hi - lo), 0.0), 1.0)
  return a.fp8_speedup_small + t * (a.fp8_speedup_large - a.fp8_speedup_small)


def level_speedup(level: str, kind: str, d_model: int, a: Assumptions) -> float:
  """Step speedup over BF16 of `level` on `kind`: 1 at O0; FP8's where native; < 1 emulated."""
  if not _level(level).fp8_gemms:
    return 1.0
  return fp8_speedup(d_model, a) if fp8_native(kind) else 1.0 / a.emulated_fp8_overhead


def microbatch_seconds(model: ModelShape, seq_len: int, microbatch: int, level: str, kind: str,
                       a: Assumptions) -> float:
  """Seconds of one microbatch (`microbatch` sequences x `seq_len`) forward+backward."""
  spec = gpu_spec(kind)
  flops = model.flops_per_token(seq_len) * microbatch * seq_len
  compute = flops / (spec.bf16_flops * a.bf16_mfu) / level_speedup(level, kind, model.d_model,
                                                                   a)
  overhead = a.microbatch_overhead_s_per_param * model.matmul_params * \
      GPU_SPECS[_OVERHEAD_KIND].hbm_bw / spec.hbm_bw
  return compute + overhead



# ----------------------------------------------------------------------------- communication

def link_bandwidth(cluster: ClusterSpec) -> float:
  """Bytes/s per GPU of the ring: NVLink (slowest kind) within one node, else inter-node."""
  if cluster.gpus <= cluster.gpus_per_node:
    return min(gpu_spec(k).nvlink_bw for k, _ in cluster.groups)
  return cluster.inter_node_bw


def ring_seconds(nbytes: float, gpus: int, bw: float, a: Assumptions) -> float:
  """One reduce-scatter or all-gather of `nbytes` (whole buffer) over a ring of `gpus`."""
  if gpus <= 1:
    return 0.0
  return (gpus - 1) / gpus * nbytes / (bw * a.comm_efficiency)


def comm_bytes(level: str, stage: int, kernels: float, others: float, loops: int,
               balanced: bool, grad_comm: str = "native",
               compute_bytes: int = 2) -> dict[str, float]:
  """Ring payloads per step (bytes, whole buffers; an all-reduce counts 2x) by collective.

  `loops`: accumulation iterations of the step (of the busiest GPU with `balanced`, the
  per-group step). Gradients travel as :func:`~.cost_inputs.grad_comm_bytes`. Stage 0/1: one
  gradient all-reduce; stage 1/2 add an all-gather of the updated weights (stored dtype).
  Stage 2: the uniform step reduce-scatters every microbatch's gradients, the balanced one
  once after its loop. Stage 3: each layer's weights gathered twice (forward, and backward or
  its recomputation) as :func:`~.cost_inputs.gather_bytes` and its gradients
  reduce-scattered: per microbatch in the uniform step (fp8jax.fsdp), once per step in the
  `balanced` (per-group, layer-major: fp8jax.parallel.layer_major) step.
  """
  params = kernels + others
  grads = params * grad_comm_bytes(level, grad_comm)
  once = 1 if balanced else loops  # per-group steps reduce once after (or per layer across)
  if stage <= 1:
    out = {"grad all-reduce": 2 * grads}
  else:
    out = {"grad reduce-scatter": once * grads}
  if stage in (1, 2):
    out["weight all-gather"] = params * master_bytes(level)
  if stage == 3:
    out["weight all-gather"] = 2 * once * gather_bytes(level, kernels, others, compute_bytes)
  return out


# ----------------------------------------------------------------------------- prediction

class Split(NamedTuple):
  """One way to run the step (uniform or balanced). Seconds per step; bytes per GPU."""

  feasible: bool
  reason: str                        # why not feasible ("" when it is)
  microbatch: int | None             # sequences per microbatch
  counts: tuple[int, ...] | None     # microbatches per GPU, mesh order
  microbatch_seconds: dict           # {kind: seconds of one microbatch}
  memory: dict                       # {kind: peak bytes per GPU}
  compute_s: float | None
  comm_s: float | None               # before overlap
  optimizer_s: float | None
  step_s: float | None
  tokens_per_s: float | None
  mfu: float | None                  # model FLOPs / sum of BF16 peaks
  idle: tuple[str, ...] = ()         # kinds none of whose GPUs gets a microbatch


class Prediction(NamedTuple):
  """Uniform vs balanced step of one cluster, level and ZeRO stage."""

  cluster: str
  kinds: tuple[str, ...]             # the kind of every GPU, mesh order
  level: str
  zero_stage: int
  seq_len: int
  global_batch: int
  params: int
  emulated: tuple[str, ...]          # kinds whose FP8 GEMMs are emulated at this level
  uniform: Split
  balanced: Split
  speedup: float | None              # uniform step / balanced step
  assumptions: Assumptions


def _kind_seconds(model, seq_len, m, level, kind, a, profiles) -> float | None:
  """Seconds of a microbatch of `m` on `kind`: measured (scaled linearly in m from the
  nearest measured size) when a profile is given, else the FLOP estimate; None: no fit."""
  prof = (profiles or {}).get(kind)
  if prof is None:
    return microbatch_seconds(model, seq_len, m, level, kind, a)
  if m in prof.seconds:
    return prof.seconds[m] if prof.admits(m) else None
  fitting = [s for s in prof.seconds if prof.admits(s)]
  if not fitting or m > max(fitting):
    return None
  near = min(fitting, key=lambda s: (abs(math.log(s / m)), -s))
  return prof.seconds[near] * m / near


def _infeasible(reason: str, seconds=None, memory=None, microbatch=None) -> Split:
  return Split(False, reason, microbatch, None, seconds or {}, memory or {}, None, None, None,
               None, None, None)


def _evaluate(ctx: dict, m: int, balanced: bool) -> Split:
  """The split for microbatch size `m`, or an infeasible Split saying why."""
  model, a, cluster, kinds = ctx["model"], ctx["a"], ctx["cluster"], ctx["kind_list"]
  seconds = {k: _kind_seconds(model, ctx["seq_len"], m, ctx["level"], k, a, ctx["profiles"])
             for k in ctx["kinds"]}
  unmeasured = [k for k in ctx["kinds"] if seconds[k] is None]
  total = ctx["batch"] // m
  counts = None
  if not unmeasured:
    per_gpu = [seconds[k] for k in kinds]
    counts = balance_counts(per_gpu, total) if balanced else uniform_counts(len(kinds), total)
  loops = 2 if total > cluster.gpus else 1  # (an accumulator from 2 on)
  usage = {k: device_memory(model, ctx["level"], ctx["stage"], ctx["seq_len"], m, loops,
                            Layout(data=cluster.gpus), a, k in ctx["emulated"], balanced,
                            slots=max((c for g, c in zip(kinds, counts or ()) if g == k),
                                      default=loops))
           for k in ctx["kinds"]}
  memory = {k: u.peak for k, u in usage.items()}
  too_big = [k for k in ctx["kinds"] if memory[k] > usable_bytes(k, a)]
  if too_big:
    need = ", ".join(f"{k} {memory[k] / GiB:.0f} > {usable_bytes(k, a) / GiB:.0f} GiB"
                     for k in too_big)
    return _infeasible(f"microbatch {m} does not fit: {need}", seconds, memory, m)
  if unmeasured:
    return _infeasible(f"profiles of {unmeasured} do not admit microbatch {m}", seconds,
                       memory, m)
  if counts is None:
    return _infeasible(uniform_reason(ctx["batch"], cluster.gpus, m), seconds, memory, m)
  busy = {k for k, c in zip(kinds, counts) if c > 0}
  idle = tuple(k for k in ctx["kinds"] if k not in busy)
  for k in idle:  # their ZeRO shards only: no microbatch, no activations
    memory[k] = usage[k].idle_peak
  compute = makespan(counts, per_gpu)
  payload = comm_bytes(ctx["level"], ctx["stage"], ctx["kernels"], ctx["others"], max(counts),
                       balanced, compute_bytes=model.compute_bytes)
  comm = sum(ring_seconds(b, cluster.gpus, ctx["bw"], a) for b in payload.values())
  step = compute + (1 - a.overlap) * comm + ctx["optimizer_s"]
  tokens = ctx["batch"] * ctx["seq_len"] / step
  mfu = ctx["flops_per_token"] * tokens / sum(gpu_spec(k).bf16_flops for k in kinds)
  return Split(True, "", m, tuple(counts), seconds, memory, compute, comm, ctx["optimizer_s"],
               step, tokens, mfu, idle)


def uniform_reason(global_batch: int, gpus: int, microbatch: int | None = None) -> str | None:
  """Why `global_batch` sequences have no uniform split over `gpus` GPUs (in microbatches of
  `microbatch`, default: any size), or None when they have one."""
  if global_batch % gpus:
    return (f"the global batch of {global_batch} sequences does not split equally over "
            f"{gpus} GPUs (the uniform split needs a multiple of {gpus} sequences)")
  if microbatch is not None and (global_batch // microbatch) % gpus:
    return (f"{global_batch // microbatch} microbatches of {microbatch} do not split equally "
            f"over {gpus} GPUs")
  return None


def optimizer_seconds(level: str, stage: int, params: int, cluster: ClusterSpec,
                      a: Assumptions) -> float:
  """Update seconds on the slowest-HBM kind; stage >= 1 updates 1/gpus of the params."""
  eff = a.fp8_optimizer_hbm_efficiency if _level(level).scaled_master else a.hbm_efficiency
  bw = min(gpu_spec(k).hbm_bw for k, _ in cluster.groups)
  shard = cluster.gpus if stage >= 1 else 1
  return optimizer_bytes_per_param(level) * params / shard / (bw * eff)


def _candidates(batch: int, microbatch: int | None) -> list[int]:
  """Microbatch sizes to try, largest first: `microbatch`, or powers of two dividing batch."""
  if microbatch is not None:
    if isinstance(microbatch, bool) or not isinstance(microbatch, int) or microbatch < 1 or \
        batch % microbatch:
      raise ValueError(f"microbatch={microbatch!r} is not allowed; use an integer >= 1 that "
                       f"divides the global batch of {batch} sequences")
    return [microbatch]
  return [2**i for i in range(int(math.log2(batch)), -1, -1) if batch % 2**i == 0]


def _best(ctx: dict, sizes: Sequence[int], balanced: bool) -> Split:
  """The largest feasible microbatch whose step is within the tolerance of the fastest."""
  splits = [_evaluate(ctx, m, balanced) for m in sizes]
  ok = [s for s in splits if s.feasible]
  if not ok:
    return splits[-1]  # the smallest size: its reason says what does not fit
  fastest = min(s.step_s for s in ok)
  near = [s for s in ok if s.step_s <= fastest * (1 + ctx["a"].microbatch_tolerance)]
  return max(near, key=lambda s: s.microbatch)


def _check_positive(**values) -> None:
  """ValueError naming the first of `values` that is not an integer >= 1."""
  for name, value in values.items():
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"{name}={value!r} is not allowed; use an integer >= 1")


def predict(cluster: ClusterSpec, model: ModelShape, seq_len: int, global_batch: int,
            level: str, zero_stage: int, assumptions: Assumptions = Assumptions(),
            profiles: Mapping[str, KindProfile] | None = None,
            microbatch: int | None = None) -> Prediction:
  """Predicted uniform and balanced step of `cluster` training `model`.

  Args:
    seq_len: tokens per sequence. global_batch: sequences per optimizer step.
    level: "O0".."O3". zero_stage: 0..3 (sharded over all GPUs).
    profiles: {kind: KindProfile} of measured seconds per microbatch; they replace the FLOP
      estimate for that kind (keys: :data:`fp8jax.hardware.GPU_SPECS` names or device
      kinds).
    microbatch: sequences per microbatch, common to all kinds; default: among the powers of
      two that divide the batch and fit every kind, the largest whose step is within
      `assumptions.microbatch_tolerance` of the fastest (chosen for each split).
  A kind that cannot hold the state gives infeasible splits (with the reason), not an error;
  so does the uniform split of a batch that does not divide by the GPU count
  (:func:`uniform_reason`). The prediction does not depend on the order of the cluster's groups.
  """
  level = _check_level(level)
  stage = _check_stage(level, zero_stage)
  a = assumptions.check()
  _check_positive(seq_len=seq_len, global_batch=global_batch)
  kernels, others = model.kernel_params, model.other_params
  profiles = {gpu_spec(k).name: p for k, p in (profiles or {}).items()}
  ctx = dict(model=model, a=a, cluster=cluster, kind_list=cluster.kinds(),
             kinds=[k for k, _ in cluster.groups], level=level, stage=stage, kernels=kernels,
             others=others, seq_len=seq_len, batch=global_batch, profiles=profiles,
             bw=link_bandwidth(cluster), flops_per_token=model.flops_per_token(seq_len),
             optimizer_s=optimizer_seconds(level, stage, kernels + others, cluster, a),
             emulated={k for k, _ in cluster.groups
                       if _level(level).fp8_gemms and not fp8_native(k)})
  sizes = _candidates(global_batch, microbatch)
  uneven = uniform_reason(global_batch, cluster.gpus)
  uniform = _infeasible(uneven) if uneven else _best(ctx, sizes, False)
  balanced = _best(ctx, sizes, True)
  speedup = uniform.step_s / balanced.step_s if uniform.feasible and balanced.feasible else None
  emulated = tuple(k for k in ctx["kinds"] if _level(level).fp8_gemms and not fp8_native(k))
  return Prediction(cluster.describe(), ctx["kind_list"], level, stage, seq_len, global_batch,
                    kernels + others, emulated, uniform, balanced, speedup, a)


# ----------------------------------------------------------------------------- pipeline

class PipelineSplit(NamedTuple):
  """One way to split the layers over the pipeline stages of a mixed cluster. Seconds per
  step; bytes per GPU."""

  layers: str                        # "auto" (by stage speed), "even" or "given"
  feasible: bool
  reason: str                        # why not feasible ("" when it is)
  stage_layers: tuple[int, ...]      # layers each stage runs
  stage_kinds: tuple[str, ...]       # each stage's slowest kind (sets its per-layer time)
  microbatch: int | None             # sequences per microbatch
  microbatches: int | None           # per pipeline replica and step (k)
  stage_seconds: tuple[float, ...]   # one microbatch through each stage, forward + backward
  memory: dict                       # {kind: peak bytes per GPU}
  compute_s: float | None            # k x the slowest stage's microbatch
  bubble_s: float | None
  comm_s: float | None               # pipeline sends + data-parallel collectives, before overlap
  optimizer_s: float | None
  step_s: float | None
  tokens_per_s: float | None
  mfu: float | None                  # model FLOPs / sum of BF16 peaks


class PipelinePrediction(NamedTuple):
  """A pipeline of `stages` stages over a mixed cluster: its layers split by stage speed
  (`auto`) and evenly (`even`), and `given` (a configured split) when there is one."""

  cluster: str
  level: str
  zero_stage: int
  stages: int
  schedule: str
  seq_len: int
  global_batch: int
  auto: PipelineSplit
  even: PipelineSplit
  given: PipelineSplit | None
  speedup: float | None              # even step / auto step
  assumptions: Assumptions


def stage_kinds(cluster: ClusterSpec, stages: int) -> list[tuple[str, ...]]:
  """The kinds of each pipeline stage's GPUs: the cluster's GPUs in mesh order cut into
  `stages` consecutive blocks of ``gpus / stages`` (the data-parallel ranks of a stage)."""
  if isinstance(stages, bool) or not isinstance(stages, int) or stages < 2 or \
      cluster.gpus % stages:
    raise ValueError(f"pipeline stages={stages!r} is not allowed on {cluster.gpus} GPUs; use "
                     f"an integer >= 2 that divides {cluster.gpus}")
  kinds, d = cluster.kinds(), cluster.gpus // stages
  return [tuple(dict.fromkeys(kinds[s * d:(s + 1) * d])) for s in range(stages)]


def pipeline_step_seconds(stage_layers: Sequence[int], layer_seconds: Sequence[float],
                          microbatches: int, schedule: str) -> tuple[float, float]:
  """(compute, bubble) seconds of a step of `microbatches` (k) microbatches through stages
  running `stage_layers` layers at `layer_seconds` (forward + backward of one microbatch
  through one layer) each. The schedule's ticks run in lockstep (each ends with a send
  between stages), so every tick lasts the slowest stage's microbatch, t = max_s L_s x
  layer_seconds[s]: compute k t, bubble the schedule's fill, (P - 1) t with GPipe and
  2 (P - 1) t with the lockstep 1F1B (:func:`fp8jax.parallel.pipeline.bubble_fraction`)."""
  pace = max(n * x for n, x in zip(stage_layers, layer_seconds))
  idle = bubble_fraction(len(stage_layers), microbatches, schedule)
  compute = microbatches * pace
  return compute, compute * idle / (1 - idle)


def _pipeline_split(ctx: dict, m: int, layers: str, given) -> PipelineSplit:
  """The pipeline step for microbatch size `m` with the layers split as `layers` says."""
  model, a, cluster, p = ctx["model"], ctx["a"], ctx["cluster"], ctx["stages"]
  kinds = ctx["stage_kinds"]
  d = cluster.gpus // p
  k = ctx["batch"] // (d * m)
  seconds = {kk: _kind_seconds(model, ctx["seq_len"], m, ctx["level"], kk, a, ctx["profiles"])
             for kk in ctx["kinds"]}
  unmeasured = [kk for kk in ctx["kinds"] if seconds[kk] is None]
  slowest = tuple(max(ks, key=lambda kk: (seconds[kk] or math.inf, kk)) for ks in kinds)
  per_layer = [seconds[kk] / model.n_layers if seconds[kk] else 1.0 for kk in slowest]
  even = split_layers(model.n_layers, [1.0] * p)
  split = {"auto": lambda: split_layers(model.n_layers, per_layer), "even": lambda: even,
           "given": lambda: given}[layers]()
  layout = Layout(data=d, pipeline=p, schedule=ctx["schedule"],
                  stage_layers=None if split == even else split)
  empty = PipelineSplit(layers, False, "", split, slowest, m, k, (), {}, None, None, None,
                        None, None, None, None)
  if k < p:
    return empty._replace(reason=f"{k} microbatches of {m} per replica do not fill {p} stages")
  usage = {kk: device_memory(model, ctx["level"], ctx["stage"], ctx["seq_len"], m, k, layout, a,
                             kk in ctx["emulated"]) for kk in ctx["kinds"]}
  memory = {kk: u.peak for kk, u in usage.items()}
  too_big = [kk for kk in ctx["kinds"] if memory[kk] > usable_bytes(kk, a)]
  if too_big:
    need = ", ".join(f"{kk} {memory[kk] / GiB:.0f} > {usable_bytes(kk, a) / GiB:.0f} GiB"
                     for kk in too_big)
    return empty._replace(reason=f"microbatch {m} does not fit: {need}", memory=memory)
  if unmeasured:
    return empty._replace(reason=f"profiles of {unmeasured} do not admit microbatch {m}",
                          memory=memory)
  stage_s = tuple(n * x for n, x in zip(split, per_layer))
  compute, bubble = pipeline_step_seconds(split, per_layer, k, ctx["schedule"])
  activation = m * ctx["seq_len"] * model.d_model * model.compute_bytes
  bw = link_bandwidth(cluster)
  pipe_comm = k * 2 * activation / (bw * a.comm_efficiency)
  stored = -(-model.n_layers // p)  # a stage's stored layers and the shared variables
  kernels = stored * model.layer_kernels + model.head_kernels
  others = stored * model.layer_others + model.embedding
  payload = comm_bytes(ctx["level"], ctx["stage"], kernels, others, k, False,
                       compute_bytes=model.compute_bytes)
  data_bw = min(gpu_spec(kk).nvlink_bw for kk in ctx["kinds"]) if d <= cluster.gpus_per_node \
      else cluster.inter_node_bw
  data_comm = sum(ring_seconds(b, d, data_bw, a) for b in payload.values())
  eff = a.fp8_optimizer_hbm_efficiency if _level(ctx["level"]).scaled_master else \
      a.hbm_efficiency
  hbm = min(gpu_spec(kk).hbm_bw for kk in ctx["kinds"])
  optimizer = optimizer_bytes_per_param(ctx["level"]) * (kernels + others) / (
      d if ctx["stage"] >= 1 else 1) / (hbm * eff)
  comm = pipe_comm + data_comm
  step = compute + bubble + (1 - a.overlap) * comm + optimizer
  tokens = ctx["batch"] * ctx["seq_len"] / step
  mfu = ctx["flops_per_token"] * tokens / sum(gpu_spec(kk).bf16_flops for kk in cluster.kinds())
  return PipelineSplit(layers, True, "", split, slowest, m, k, stage_s, memory, compute, bubble,
                       comm, optimizer, step, tokens, mfu)


def _best_pipeline(ctx: dict, sizes: Sequence[int], layers: str, given=None) -> PipelineSplit:
  """The largest feasible microbatch whose step is within the tolerance of the fastest."""
  splits = [_pipeline_split(ctx, m, layers, given) for m in sizes]
  ok = [s for s in splits if s.feasible]
  if not ok:
    return splits[-1]
  fastest = min(s.step_s for s in ok)
  return max((s for s in ok if s.step_s <= fastest * (1 + ctx["a"].microbatch_tolerance)),
             key=lambda s: s.microbatch)


def predict_pipeline(cluster: ClusterSpec, model: ModelShape, seq_len: int, global_batch: int,
                     level: str, zero_stage: int, stages: int, schedule: str = "1f1b",
                     stage_layers: Sequence[int] | None = None,
                     assumptions: Assumptions = Assumptions(),
                     profiles: Mapping[str, KindProfile] | None = None,
                     microbatch: int | None = None) -> PipelinePrediction:
  """Predicted step of `cluster` as `stages` pipeline stages (its GPUs in mesh order cut into
  consecutive blocks, :func:`stage_kinds`; each block's GPUs the data-parallel ranks of that
  stage, ZeRO `zero_stage` over them) training `model`, its layers split by stage speed
  ("auto": :func:`fp8jax.parallel.pipeline.split_layers` of each stage's slowest kind's
  seconds per layer, as ``parallel.pipeline_layers: auto`` splits them), evenly, and as
  `stage_layers` when given.

  Step = k x t + bubble + (1 - overlap) x (pipeline sends + data-parallel collectives) +
  update, k the microbatches per replica (global batch / (ranks per stage x microbatch)),
  t the slowest stage's microbatch (:func:`pipeline_step_seconds`; a kind's seconds per layer
  are its microbatch's (:func:`microbatch_seconds` or a profile's) / the model's layers).
  Pipeline sends: one activation forward and one gradient back per microbatch over
  :func:`link_bandwidth`; data collectives (:func:`comm_bytes`) of a stage's stored layers and
  the shared variables over its ranks (NVLink when they fit a node); the update over the
  same parameters on the slowest HBM. Memory per kind:
  :func:`fp8jax.parallel.step_memory.device_memory` with the split (every stage holds the
  deepest stage's layers during the step). Microbatch: as :func:`predict` chooses it, among
  the sizes that give every stage a microbatch (k >= stages). Args otherwise as
  :func:`predict`; `schedule` "1f1b" or "gpipe"."""
  level = _check_level(level)
  stage = _check_stage(level, zero_stage)
  a = assumptions.check()
  _check_positive(seq_len=seq_len, global_batch=global_batch)
  kinds = stage_kinds(cluster, stages)
  if model.n_layers < stages:
    raise ValueError(f"{model.n_layers} layers do not fill {stages} pipeline stages; use at "
                     "most one stage per layer")
  Layout(pipeline=stages, schedule=schedule).check()
  if stage_layers is not None:
    stage_layers = check_stage_layers(tuple(stage_layers), stages, model.n_layers)
  d = cluster.gpus // stages
  if global_batch % d:
    raise ValueError(f"global batch {global_batch} does not split over the {d} pipeline "
                     f"replicas; use a multiple of {d}")
  profiles = {gpu_spec(kk).name: pr for kk, pr in (profiles or {}).items()}
  ctx = dict(model=model, a=a, cluster=cluster, stages=stages, stage_kinds=kinds,
             kinds=[kk for kk, _ in cluster.groups], level=level, stage=stage, seq_len=seq_len,
             batch=global_batch, profiles=profiles, schedule=schedule,
             flops_per_token=model.flops_per_token(seq_len),
             emulated={kk for kk, _ in cluster.groups
                       if _level(level).fp8_gemms and not fp8_native(kk)})
  sizes = _candidates(global_batch // d, microbatch)
  auto = _best_pipeline(ctx, sizes, "auto")
  even = _best_pipeline(ctx, sizes, "even")
  given = None if stage_layers is None else _best_pipeline(ctx, sizes, "given", stage_layers)
  speedup = even.step_s / auto.step_s if auto.feasible and even.feasible else None
  return PipelinePrediction(cluster.describe(), level, stage, stages, schedule, seq_len,
                            global_batch, auto, even, given, speedup, a)


def format_pipeline_table(predictions: Sequence[PipelinePrediction]) -> str:
  """Markdown table of pipeline predictions: per level and ZeRO stage the split by stage
  speed (with its speed-up over the even split), the even split and a given one."""
  lines = ["| level | ZeRO | stages | split | layers/stage | stage kinds | mb x k | "
           "stage s/microbatch | compute s | bubble s | comm s | optim s | step s | tokens/s "
           "| MFU (BF16 peak) | GiB/GPU | speedup vs even |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in predictions:
    for s in (p.auto, p.even) + ((p.given,) if p.given is not None else ()):
      head = (f"| {p.level} | {p.zero_stage} | {p.stages} ({p.schedule}) | {s.layers} | "
              f"{'+'.join(map(str, s.stage_layers))} | {'/'.join(s.stage_kinds)} ")
      if not s.feasible:
        lines.append(head + "| - | - | - | - | - | - | - | - | - | - | infeasible: "
                     f"{s.reason} |")
        continue
      speed = f"{p.speedup:.2f}x" if s is p.auto and p.speedup else (
          f"{p.even.step_s / s.step_s:.2f}x" if s is p.given and p.even.feasible else "")
      lines.append(head + f"| {s.microbatch} x {s.microbatches} | "
                   f"{'/'.join(f'{x:.3f}' for x in s.stage_seconds)} | {s.compute_s:.2f} | "
                   f"{s.bubble_s:.2f} | {s.comm_s:.2f} | {s.optimizer_s:.3f} | {s.step_s:.2f} | "
                   f"{s.tokens_per_s:,.0f} | {s.mfu:.3f} | "
                   f"{_per_kind(s.memory, lambda b: f'{b / GiB:.0f}')} | {speed} |")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- profiles

def read_profile(path: str | os.PathLike) -> dict:
  """The JSON written by `fp8jax profile` (checked by :func:`fp8jax.parallel.profile.read`),
  whose device kind must be one of :data:`fp8jax.hardware.GPU_SPECS`."""
  data = profile_lib.read(os.fspath(path))
  gpu_spec(data["device_kind"])
  return data


def load_profile(path: str | os.PathLike) -> KindProfile:
  """KindProfile (kind: the :data:`fp8jax.hardware.GPU_SPECS` name) of a profile JSON;
  seconds per microbatch."""
  data = read_profile(path)
  prof = profile_lib.to_kind_profile(data)
  return KindProfile(gpu_spec(data["device_kind"]).name, dict(prof.seconds), dict(prof.fits))


# ----------------------------------------------------------------------------- table

def _per_kind(values: Mapping, fmt) -> str:
  return " ".join(f"{k}:{fmt(v)}" for k, v in values.items())


def _counts_by_kind(p: Prediction, split: Split) -> dict:
  out: dict = {}
  for k, c in zip(p.kinds, split.counts):
    lo, hi = out.get(k, (c, c))
    out[k] = (min(lo, c), max(hi, c))
  return {k: (str(lo) if lo == hi else f"{lo}-{hi}") + (" (idle)" if k in split.idle else "")
          for k, (lo, hi) in out.items()}


def _row(p: Prediction, name: str, split: Split) -> str:
  """One markdown row of the table."""
  head = f"| {p.level} | {p.zero_stage} | {name} "
  if not split.feasible:
    return head + f"| - | - | - | - | - | - | - | - | infeasible: {split.reason} |"
  gib = _per_kind(split.memory, lambda b: f"{b / GiB:.0f}")
  counts = _per_kind(_counts_by_kind(p, split), str)
  speed = f"{p.speedup:.2f}x" if name == "balanced" and p.speedup else ""
  return (head + f"| {split.microbatch} | {counts} | {split.compute_s:.2f} | {split.comm_s:.2f} "
          f"| {split.optimizer_s:.3f} | {split.step_s:.2f} | {split.tokens_per_s:,.0f} | "
          f"{split.mfu:.3f} | {gib} | {speed} |")


def format_table(predictions: Sequence[Prediction]) -> str:
  """Markdown table of one cluster's predictions (uniform and balanced rows), with the
  assumptions of the first listed above."""
  if not predictions:
    raise ValueError("format_table needs at least one Prediction")
  first = predictions[0]
  emulated = sorted({k for p in predictions for k in p.emulated})
  lines = [f"cluster {first.cluster}: {first.params / 1e9:.2f}B params, batch "
           f"{first.global_batch} x {first.seq_len} tokens; predictions, not measurements"]
  lines += [f"- {line}" for line in first.assumptions.describe()]
  if emulated:
    lines.append(f"- FP8 emulated on {', '.join(emulated)} (no FP8 tensor cores)")
  lines += ["", "| level | ZeRO | split | mb | microbatches/GPU | compute s | comm s | optim s "
            "| step s | tokens/s | MFU (BF16 peak) | GiB/GPU | speedup |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for p in predictions:
    lines += [_row(p, "uniform", p.uniform), _row(p, "balanced", p.balanced)]
  if any(s.idle for p in predictions for s in (p.uniform, p.balanced)):
    lines += ["", "(idle): GPUs of that kind get no microbatch (the others finish sooner); "
              "they hold their ZeRO shards and take part in the collectives (and the gathers of "
              "each layer), so their GiB/GPU has no activations"]
  return "\n".join(lines)
