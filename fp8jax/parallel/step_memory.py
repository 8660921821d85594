"""Bytes per GPU of a train step: the package's one memory model.

:func:`device_memory` splits the bytes one GPU holds into the state that lives between steps
and the step's two phases (the forward and backward of the microbatches, the optimizer
update); :func:`usable_bytes` is what one GPU of a kind can hold of them.
``fp8jax simulate`` (:mod:`fp8jax.parallel.cost_model`), :mod:`fp8jax.parallel.sizing` and
``fp8jax.train.memory`` (the "auto" remat policy) read it. The model's facts come from a
:class:`~fp8jax.parallel.cost_inputs.ModelShape`, the modelling constants from
:class:`~fp8jax.parallel.cost_inputs.Assumptions`, GPU facts from :mod:`fp8jax.hardware`.
Pure Python: no devices are needed.
"""
from __future__ import annotations

from typing import NamedTuple

from fp8jax.hardware import gpu_spec
from fp8jax.parallel.cost_inputs import Assumptions, ModelShape, _check_level, _check_stage, \
    _level, state_bytes_per_param, wire_bytes

SCHEDULES = ("1f1b", "gpipe")


class Layout(NamedTuple):
  """How the GPUs training one model split it: `data` data-parallel ranks (the ZeRO shards)
  x `tensor` tensor-parallel ranks x `pipeline` stages; `schedule` of the pipeline
  (:mod:`fp8jax.parallel.pipeline`): "1f1b" (lockstep: a stage keeps 2 x `pipeline`
  - 1 microbatches' inputs) or "gpipe" (all of them); `stage_layers`: None (the layers split
  evenly over the stages) or the layers each stage runs (``parallel.pipeline_layers``, one
  count >= 1 per stage summing to the model's layers)."""

  data: int = 1
  tensor: int = 1
  pipeline: int = 1
  schedule: str = "1f1b"
  stage_layers: tuple[int, ...] | None = None

  @property
  def gpus(self) -> int:
    return self.data * self.tensor * self.pipeline

  def check(self) -> "Layout":
    """Self, after checking the values (ValueError naming the bad one)."""
    for name in ("data", "tensor", "pipeline"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Layout.{name}={value!r} is not allowed; use an integer >= 1")
    if self.schedule not in SCHEDULES:
      raise ValueError(f"Layout.schedule={self.schedule!r} is not allowed; use one of "
                       f"{list(SCHEDULES)}")
    split = self.stage_layers
    if split is not None and not (
        isinstance(split, (list, tuple)) and len(split) == self.pipeline
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in split)):
      raise ValueError(f"Layout.stage_layers={split!r} is not allowed; use None or "
                       f"{self.pipeline} layer counts >= 1, one per pipeline stage")
    return self._replace(stage_layers=None if split is None else tuple(split))

  def widest_stage(self, n_layers: int) -> int:
    """Layers of the deepest stage's slice during the step: max(L_s) with
    :attr:`stage_layers` (the step lays the stack out P x max(L_s)), else ceil(n_layers / P).
    ValueError when :attr:`stage_layers` does not sum to `n_layers`."""
    if self.stage_layers is None:
      return -(-n_layers // self.pipeline)
    if sum(self.stage_layers) != n_layers:
      raise ValueError(f"Layout.stage_layers={list(self.stage_layers)} sums to "
                       f"{sum(self.stage_layers)}, but the model has {n_layers} layers")
    return max(self.stage_layers)


def activation_bytes(model: ModelShape, seq_len: int, microbatch: int, level: str = "O0",
                     tensor: int = 1, layers: int | None = None, in_flight: int = 1,
                     logits: bool = True) -> float:
  """Activation bytes on one GPU: `in_flight` microbatches of `microbatch` sequences x
  `seq_len` tokens saved for the backward of `layers` layers (default all), one layer's
  working set, and (`logits`) the f32 logits with their gradient, n V x 8.

  n tokens per microbatch, c compute bytes, F' the MLP's output width (2 d_ff when gated).
  With remat, per layer and token: the layer input d c; ``save_gemm_outputs`` adds the qkv,
  attention-out and MLP-in outputs (4 d + F') c and, with cuDNN attention, its residuals
  d c; ``save_gemm_io`` also (3 d + d_ff) FP8 input casts (c each at O0); all three split over
  `tensor` ranks. Working set (16 d + 3 F') c: one layer recomputed and differentiated, its
  part beyond 4 d split over `tensor` ranks. Without remat 34 d bytes per token per layer
  (Korthikanti et al. 2022), (10 + 24 / tensor) d with tensor parallelism. XLA attention
  (``model.attention_impl``) adds its f32 scores and probabilities, m (H / tensor) T^2 x 8
  bytes per layer: one layer's in the working set, and every layer's without remat; cuDNN's
  flash attention keeps none.
  """
  n = microbatch * seq_len
  d, c = model.d_model, model.compute_bytes
  wide = 2 * model.d_ff if model.gated_mlp else model.d_ff
  layers = model.n_layers if layers is None else layers
  xla = model.attention_impl == "xla"
  scores = microbatch * model.n_heads / tensor * seq_len * seq_len * 8 if xla else 0.0
  if model.remat:
    saved = n * d * c
    if model.remat_policy != "full":
      saved += n * (4 * d + wide + (0 if xla else d)) * c / tensor
    if model.remat_policy == "save_gemm_io":
      saved += n * (3 * d + model.d_ff) * (1 if _level(level).fp8_gemms else c) / tensor
    working = n * (4 * d + (12 * d + 3 * wide) / tensor) * c + scores
  else:
    saved, working = n * (10 + 24 / tensor) * d + scores, 0.0
  head = n * model.vocab_size * 8 if logits else 0
  return in_flight * layers * saved + working + head


class DeviceMemory(NamedTuple):
  """Bytes on one GPU by term: `state` lives between steps; `backward` (the forward and
  backward of the microbatches) and `update` (the optimizer) are the step's two phases,
  which do not overlap. :attr:`peak` is what the GPU must hold."""

  state: dict
  backward: dict
  update: dict

  @property
  def peak(self) -> float:
    """State + the larger phase."""
    return sum(self.state.values()) + max(sum(self.backward.values()),
                                          sum(self.update.values()))

  @property
  def idle_peak(self) -> float:
    """The peak of a GPU that runs no microbatch: state and update, and the backward's terms
    that do not scale with its microbatches (gradients, decoded and gathered weights: a
    layer-major step gathers each layer on every group)."""
    held = sum(v for k, v in self.backward.items() if k != "activations")
    return sum(self.state.values()) + max(sum(self.update.values()), held)


def fp8_meta_bytes(level: str, gemms: int) -> int:
  """Bytes of the FP8 state of `gemms` GEMMs: per operand role (input, weight, gradient) an
  f32 scale and the amax history of the default recipe."""
  recipe = _level(level).recipe
  return 0 if recipe is None else gemms * 3 * (recipe.amax_history_len + 1) * 4


def device_memory(model: ModelShape, level: str, stage: int, seq_len: int, microbatch: int,
                  microbatches: int = 1, layout: Layout = Layout(),
                  a: Assumptions = Assumptions(), emulated: bool = False,
                  local_grads: bool = False, fused_update: bool | None = None,
                  slots: int | None = None) -> DeviceMemory:
  """Bytes on the fullest GPU of `layout` training `model` at `level` and ZeRO `stage`
  (sharded over ``layout.data``), `microbatches` microbatches of `microbatch` sequences x
  `seq_len` tokens per step. The one memory model of a train step: ``fp8jax simulate``,
  :mod:`fp8jax.parallel.sizing` and ``fp8jax.train.memory`` (the "auto" remat policy) read it.

  Without pipeline stages, per GPU: the whole model, its kernels split over ``tensor``.
  With stages (``layout.pipeline`` > 1): :func:`_pipeline_memory` (every stage holds the
  shared variables and the deepest stage's layers during the step).
  State: master weights (/N at stage 3), Adam moments (/N from stage 1), FP8 meta. Backward:
  f32 gradients (/N at stage 3: each layer's are reduce-scattered as its backward makes
  them), an f32 accumulator with several microbatches (/N from stage 2), the master decoded
  to the compute dtype (O2/O3; /N at stage 3), FP8 weight casts (below stage 3), at stage 3
  `a.layers_in_flight` layers' gathered kernels (:func:`~.cost_inputs.wire_bytes`) and the f32
  gradient of the largest kernel (:attr:`~.cost_inputs.ModelShape.largest_kernel`) before its
  reduce-scatter, that kernel widened where FP8 is `emulated`, and :func:`activation_bytes`.
  Update: the f32 gradients (/N from stage 2), the update's temporaries (/N from stage 1)
  and, where an all-reduce reduces them (stages 0/1 over several GPUs), its output.

  Args:
    local_grads: the per-group step (``fp8jax.train.step.GroupLoop``: a balanced split or
      FP8 gradient communication). Below stage 3 its loop keeps an f32 accumulator of whole
      gradients, reduced once after the loop. At stage 3 it runs layer-major
      (``fp8jax.parallel.layer_major``): the parameters enter as shards (the FP16 master
      decoded to f32 shards), each layer's kernels are gathered
      (:func:`~.cost_inputs.wire_bytes`) once forward and once backward, its f32 gradients summed over the GPU's microbatches
      (one layer's in flight) and reduce-scattered once into the f32 gradient shards; the
      activations are every microbatch's input to every layer plus the last layer's output
      and its gradient (``slots x (layers + 2)`` of n d c), one layer's working set and
      one microbatch's logits. Leaves ZeRO cannot split stay whole (norm scales of widths
      not divisible by N; not counted).
    slots: microbatches the busiest GPU runs in a layer-major step (default `microbatches`).
    fused_update: whether the step takes the fused O2 update (no update temporaries; with
      one microbatch of the uniform step it reads the BF16 kernel gradients as they come;
      ``fp8jax.train.build.fused_update_fn``); None: where it does by default, one GPU at a
      level with a fused update, stage 0.
  """
  level = _check_level(level)
  stage = _check_stage(level, stage)
  layout = layout.check()
  if layout.pipeline > 1:
    return _pipeline_memory(model, level, stage, seq_len, microbatch, microbatches, layout, a,
                            emulated)
  lv = _level(level)
  per, c = state_bytes_per_param(level), model.compute_bytes
  n, t = layout.data, layout.tensor
  layers = model.n_layers
  layer_kernels, largest = model.layer_kernels / t, model.largest_kernel / t
  layer_major = local_grads and stage == 3
  slots = microbatches if slots is None else slots
  shard3 = n if stage == 3 else 1
  if fused_update is None:  # as fp8jax.train.build.fused_update_fn takes it on GPUs
    fused_update = lv.fused_update and layout.gpus == 1 and stage == 0
  # the fused update reads one microbatch's BF16 kernel gradients as they come (uniform step)
  narrow = fused_update and microbatches == 1 and not local_grads
  kernels = layers * layer_kernels + model.head_kernels
  others = layers * model.layer_others + model.embedding
  params = kernels + others
  gemms = layers * (5 if model.gated_mlp else 4) + 1
  state = {"master weights": per["master"] * params / (n if stage == 3 else 1),
           "Adam moments": (per["m"] + per["v"]) * params / (n if stage >= 1 else 1),
           "FP8 meta": float(fp8_meta_bytes(level, gemms))}
  grads = c * kernels + per["grads"] * others if narrow else per["grads"] * params
  backward = {"gradients": grads / shard3}
  if (microbatches > 1 or local_grads) and not layer_major:
    backward["accumulator"] = per["grads"] * params / (
        shard3 if local_grads else n if stage >= 2 else 1)
  if lv.scaled_master:
    decoded = per["grads"] if local_grads else a.fp8_working_copy_bytes  # f32 / BF16
    backward["decoded weights"] = decoded * params / shard3
  if lv.fp8_gemms and stage < 3:
    backward["FP8 weight casts"] = 1.0 * kernels
  if stage == 3:
    backward["gathered weights"] = a.layers_in_flight * layer_kernels * wire_bytes(level, c)
    backward["weight gradient in flight"] = per["grads"] * (
        layer_kernels if local_grads else largest)
  if emulated and lv.fp8_gemms:
    backward["widened FP8 weight"] = a.emulated_weight_bytes * largest
  if layer_major:  # layer boundaries of every slot, then one layer and head at a time
    backward["activations"] = slots * (layers + 2) * microbatch * seq_len * model.d_model * c \
        + activation_bytes(model, seq_len, microbatch, level, t, 0, 1, True)
  else:
    backward["activations"] = activation_bytes(
        model, seq_len, microbatch, level, t, layers, 1, True)
  temp = a.update_temp_bytes if lv.scaled_master else a.update_temp_bytes_f32
  update = {"gradients": grads / (n if stage >= 2 else 1),
            "update temporaries": 0.0 if fused_update else temp * params / (
                n if stage >= 1 else 1)}
  if stage <= 1 and n > 1:
    update["all-reduce output"] = a.all_reduce_copy_bytes * params
  return DeviceMemory(state, backward, update)


def _pipeline_memory(model: ModelShape, level: str, stage: int, seq_len: int, microbatch: int,
                     microbatches: int, layout: Layout, a: Assumptions,
                     emulated: bool) -> DeviceMemory:
  """:func:`device_memory` of a pipeline step (``layout.pipeline`` > 1; the pipeline loop of
  ``fp8jax.train.pipeline_loop``, or pipeline replicas of the per-group step).

  One program runs on every stage, so every device holds what the busiest stage needs: the
  shared variables (embedding, final norm, LM head) whole on every stage, the stored layers
  S = ceil(L / P) of its slice, and during the step the deepest stage's W =
  :meth:`Layout.widest_stage` layers (the stack laid out P x max(L_s) when the stages are
  uneven, ``fp8jax.parallel.pipeline.padded_layout``). State: master weights (/N at stage 3)
  and Adam moments (/N from stage 1) of S layers and the shared variables. Backward: the f32
  gradients in the stored order (S layers), the schedule's f32 accumulator and one slot's
  gradients (in the weights' step dtype) over W layers, the master decoded to the compute dtype
  (O2/O3, S layers) and, with uneven stages, its padded copy (W layers), below stage 3 the
  FP8 casts of W layers' and the head's kernels (FP8 levels); at stage 3 the
  gathered layers and one kernel's f32 gradient as in :func:`device_memory` (all step terms
  /N at stage 3). Activations: the schedule keeps one input per microbatch in flight (GPipe:
  k, the lockstep 1F1B's ring: 2P - 1), plus one backward slot's: W layers saved under remat
  (:func:`activation_bytes`), one layer's working set and the logits. Update: as in
  :func:`device_memory`, over the stored S layers and the shared variables."""
  lv = _level(level)
  per, c = state_bytes_per_param(level), model.compute_bytes
  n, t, pp = layout.data, layout.tensor, layout.pipeline
  stored, wide = -(-model.n_layers // pp), layout.widest_stage(model.n_layers)
  shard3 = n if stage == 3 else 1
  layer = model.layer_kernels / t + model.layer_others

  def params(layers):
    return layers * layer + model.head_kernels + model.embedding

  held, padded = params(stored), params(wide)
  gemms = stored * (5 if model.gated_mlp else 4) + 1
  state = {"master weights": per["master"] * held / shard3,
           "Adam moments": (per["m"] + per["v"]) * held / (n if stage >= 1 else 1),
           "FP8 meta": float(fp8_meta_bytes(level, gemms))}
  step_dtype = a.fp8_working_copy_bytes if lv.scaled_master else per["master"]
  backward = {"gradients": per["grads"] * held / shard3,
              "accumulator": per["grads"] * padded / shard3,
              "slot gradients": step_dtype * padded / shard3}
  if lv.scaled_master:
    backward["decoded weights"] = a.fp8_working_copy_bytes * held / shard3
  if layout.stage_layers is not None and len(set(layout.stage_layers)) > 1:
    backward["padded layers"] = step_dtype * wide * layer / shard3
  if lv.fp8_gemms and stage < 3:  # the weights' casts, made once: they do not change in a step
    backward["FP8 weight casts"] = 1.0 * (wide * model.layer_kernels / t + model.head_kernels)
  largest = model.largest_kernel / t
  if stage == 3:
    backward["gathered weights"] = a.layers_in_flight * model.layer_kernels / t * wire_bytes(
        level, c)
    backward["weight gradient in flight"] = per["grads"] * largest
  if emulated and lv.fp8_gemms:
    backward["widened FP8 weight"] = a.emulated_weight_bytes * largest
  kept = microbatches if layout.schedule == "gpipe" else 2 * pp - 1
  backward["activations"] = kept * microbatch * seq_len * model.d_model * c + activation_bytes(
      model, seq_len, microbatch, level, t, wide, 1, True)
  temp = a.update_temp_bytes if lv.scaled_master else a.update_temp_bytes_f32
  update = {"gradients": per["grads"] * held / (n if stage >= 2 else 1),
            "update temporaries": temp * held / (n if stage >= 1 else 1)}
  if stage <= 1 and n > 1:
    update["all-reduce output"] = a.all_reduce_copy_bytes * held
  return DeviceMemory(state, backward, update)


def usable_bytes(kind: str, a: Assumptions) -> float:
  """HBM bytes left after the workspace reserve."""
  return gpu_spec(kind).hbm_bytes * (1 - a.workspace_reserve)
