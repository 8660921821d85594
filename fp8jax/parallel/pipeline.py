"""Pipeline parallelism: GPipe and 1F1B schedules over the mesh's "pipe" axis, generic over the
stage function.

A model is cut into three functions (the reference decoder's cut:
``fp8jax.models.layers.DecoderParts``):

* ``first(shared, part) -> x``: stage 0's input from a microbatch (the embedding);
* ``stage(stacked, x) -> y``: one stage's slice of the stacked layers (leading layer axis
  [L/P, ...]), y shaped like x (the residual stream);
* ``last(shared, y, part) -> loss``: the last stage's output to the microbatch's mean loss
  (final norm, head, cross entropy).

`stacked` holds the variables of the stacked layers (parameters and FP8 state), split over
"pipe" along their layer axis (:func:`pipe_dim`: stage s holds layers [s L/P, (s+1) L/P));
`shared` the other variables, whole on every stage.

Stages may run unequal numbers of layers (``stage_layers`` (L_0, ..., L_{P-1}), e.g. in
proportion to each stage's speed on a cluster of mixed GPU kinds: :func:`split_layers`). The
layers stay stored L/P per stage; for the step they are laid out P x max(L_s) (stage s's
layers first in its slice, the rest padding: :func:`padded_layout`), stage s runs only its
first L_s (``lax.switch`` on the stage index: :func:`uneven`), and the gradients come back
in the stored order.

The schedule (:func:`gpipe`, inside ``jax.shard_map`` manual over "pipe", other mesh axes
``Auto``, so data/ZeRO/tensor sharding composes through XLA's partitioner as in the uniform
step): k >= P microbatches, P stages.

* Forward phase, k + P - 1 ticks: at tick t stage s runs microbatch m = t - s, keeps only its
  input x (one activation [mb, T, D] per microbatch) and sends its output to stage s + 1
  (``lax.ppermute``). The last stage only keeps its input.
* Backward phase, k + P - 1 ticks: at tick t stage s runs microbatch m = t - (P - 1 - s):
  ``jax.vjp`` of its stage function at the kept input (the stage's forward runs again: a
  stage-level rematerialization), the last stage starting from the gradient of `last`, and
  sends the input's gradient to stage s - 1; stage 0 takes it into `first`'s gradient.

:func:`one_f_one_b` runs the same slots interleaved (a forward and a backward per tick),
keeping at most 2P - 1 inputs per stage instead of k, for a larger bubble (all stages run in
lockstep, one program): 2(P - 1) / (k + 2(P - 1)).

A step may run only the first `count` <= k microbatches (``count``: an int32 scalar, possibly
traced: a batch-size ramp compiles one program for every count): microbatches from `count`
on are bubbles too, and the means divide by `count`.

A (stage, tick) slot outside 0 <= m < k is a bubble: it computes nothing (``lax.cond``) and
leaves every accumulator unchanged. Gradients are not differentiated through the schedule:
each slot's gradient is accumulated explicitly with ``fp8jax.accumulate_gradients``
(parameters summed in f32, FP8 state combined by max), so the FP8 state's update is the
max-combination over microbatches, as in the uniform loop. The bubble (idle) fraction of a
stage is (P - 1) / (k + P - 1) with GPipe (:func:`bubble_fraction`).
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from fp8jax.accumulate import accumulate_gradients, accumulator_zeros, mean_gradients
from fp8jax.parallel.mesh import PIPE, pipe_size
from fp8jax.scaling import Fp8Meta, combine_max

# The key-path piece of the stacked layers' variables (the reference decoder's ``nn.scan``
# over its blocks is named "layers"): every array below it has a leading layer axis.
STACK_PIECE = "['layers']"
SCHEDULES = ("gpipe", "1f1b")


class Stages(NamedTuple):
  """A model cut for the pipeline (see the module docstring for each function's contract).

  `lockstep`: the stage function is ``stage(stacked, x, ran) -> y`` and runs in every slot,
  bubbles included, computing only where `ran` (a bool scalar) holds and returning x
  elsewhere: it holds collectives over other mesh axes that must pair up across pipeline
  replicas running different microbatch counts (ZeRO-3 per-layer gathers:
  ``fp8jax.parallel.stage_gather``)."""

  first: Callable
  stage: Callable
  last: Callable
  lockstep: bool = False


def pipe_dim(path: str, shape, mesh: Mesh) -> int | None:
  """0 (the layer axis, split over "pipe") for an array of the stacked layers (`path`, a
  ``jax.tree_util.keystr``, contains :data:`STACK_PIECE`) on a mesh with pipeline stages;
  None otherwise. ValueError when the layer count does not split over the stages."""
  stages = pipe_size(mesh)
  if stages == 1 or STACK_PIECE not in path or len(shape) == 0:
    return None
  if shape[0] % stages:
    raise ValueError(f"{path} has {shape[0]} layers, which do not split over "
                     f"{stages} pipeline stages; use a pipeline size that divides the layer "
                     f"count")
  return 0


def check_stages(stages: int, microbatches: int) -> None:
  """Raises ValueError unless `microbatches` >= `stages` >= 1 (every stage needs a
  microbatch; the layers' split is checked where they are laid out: :func:`pipe_dim`)."""
  if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
    raise ValueError(f"pipeline stages={stages!r} is not allowed; use an integer >= 1")
  if microbatches < stages:
    raise ValueError(f"a pipeline of {stages} stages needs at least {stages} microbatches per "
                     f"step, got {microbatches}; use more microbatches (or fewer stages)")


def check_schedule(schedule: str) -> str:
  """`schedule` if it is one of :data:`SCHEDULES`, else ValueError."""
  if schedule not in SCHEDULES:
    raise ValueError(f"pipeline schedule {schedule!r} is not allowed; use one of "
                     f"{list(SCHEDULES)}")
  return schedule


def split_layers(n_layers: int, stage_seconds) -> tuple[int, ...]:
  """Layers per stage (each >= 1, summing to `n_layers`) that minimise the slowest stage's
  time, stage s taking `stage_seconds[s]` (any unit) per layer: one layer each, then every
  further layer to the stage that would finish it first (ties: the earlier stage)."""
  seconds = [float(x) for x in stage_seconds]
  if not seconds or any(not x > 0 for x in seconds):
    raise ValueError(f"stage_seconds={stage_seconds!r}: give one time > 0 per stage")
  if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < len(seconds):
    raise ValueError(f"{n_layers!r} layers do not fill {len(seconds)} pipeline stages")
  layers = [1] * len(seconds)
  for _ in range(n_layers - len(seconds)):
    s = min(range(len(seconds)), key=lambda i: ((layers[i] + 1) * seconds[i], i))
    layers[s] += 1
  return tuple(layers)


def speed_stage_layers(n_layers: int, stage_seconds) -> tuple[int, ...] | None:
  """The layers per stage ``parallel.pipeline_layers: auto`` runs for stages taking
  `stage_seconds` per layer: :func:`split_layers`, or None (the even layout, no padding) when
  it gives every stage the same count."""
  layers = split_layers(n_layers, stage_seconds)
  return None if len(set(layers)) == 1 else layers


def check_stage_layers(stage_layers, stages: int, n_layers: int) -> tuple[int, ...]:
  """`stage_layers` as a tuple if it gives each of `stages` stages >= 1 layer and sums to
  `n_layers`; else ValueError."""
  ok = (isinstance(stage_layers, (list, tuple)) and len(stage_layers) == stages
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                for n in stage_layers) and sum(stage_layers) == n_layers)
  if not ok:
    raise ValueError(f"layers per stage {stage_layers!r} do not split {n_layers} layers over "
                     f"{stages} stages; give {stages} integers >= 1 summing to {n_layers}")
  return tuple(stage_layers)


def padded_layout(stage_layers) -> tuple[np.ndarray, np.ndarray]:
  """(src, inv) for layers L = sum(`stage_layers`) run L_s by stage s: the padded stack
  ``stacked[src]`` is [P * max(L_s), ...] with stage s's layers first in its slice (padding
  slots repeat its last layer and never run), and ``padded[inv]`` is the stack again (the
  gradients' way back)."""
  width = max(stage_layers)
  src, inv, start = [], [], 0
  for s, n in enumerate(stage_layers):
    src += list(range(start, start + n)) + [start + n - 1] * (width - n)
    inv += [s * width + j for j in range(n)]
    start += n
  return np.asarray(src, np.int32), np.asarray(inv, np.int32)


def uneven(fns: Stages, stage_layers, axis: str = PIPE) -> Stages:
  """`fns` whose stage function runs stage s's first ``stage_layers[s]`` layers of its slice
  of the padded stack (:func:`padded_layout`; inside ``shard_map`` manual over `axis`)."""
  def first(n):
    return lambda stacked, *args: fns.stage(jax.tree.map(lambda a: a[:n], stacked), *args)
  branches = [first(n) for n in stage_layers]

  def stage(stacked, *args):
    return lax.switch(lax.axis_index(axis), branches, stacked, *args)
  return fns._replace(stage=stage)


def pad_stack(stacked, stage_layers):
  """`stacked` [L, ...] laid out for uneven stages (:func:`padded_layout`), or as it is
  (`stage_layers` None)."""
  if stage_layers is None:
    return stacked
  check_stage_layers(tuple(stage_layers), len(stage_layers),
                     int(jax.tree.leaves(stacked)[0].shape[0]))
  src = padded_layout(stage_layers)[0]
  return jax.tree.map(lambda a: a[src], stacked)


def unpad_stack(g_stacked, stage_layers):
  """:func:`pad_stack`'s inverse for gradients [P * max(L_s), ...] -> [L, ...] (padding
  slots dropped)."""
  if stage_layers is None:
    return g_stacked
  inv = padded_layout(stage_layers)[1]
  return jax.tree.map(lambda a: a[inv], g_stacked)


def bubble_fraction(stages: int, microbatches: int, schedule: str = "gpipe") -> float:
  """The fraction of a step each stage idles when k = `microbatches` >= 1 run (fewer than
  the stages only as a ramp's count): (P - 1) / (k + P - 1) with GPipe, 2(P - 1) /
  (k + 2(P - 1)) with the lockstep 1F1B of :func:`one_f_one_b`."""
  check_stages(stages, max(microbatches, stages) if microbatches >= 1 else microbatches)
  fill = (stages - 1) * (2 if check_schedule(schedule) == "1f1b" else 1)
  return fill / (microbatches + fill)


def _zeros(shapes):
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _select(pred, new, old):
  """`new` where `pred` (a scalar) holds, else `old`, leaf by leaf."""
  return jax.tree.map(lambda n, o: jnp.where(pred, n, o), new, old)


def _combine_over(tree, axis: str, stages: int):
  """Gradients summed over `axis`, FP8 state combined by max over it."""
  def one(x):
    if not isinstance(x, Fp8Meta):
      return lax.psum(x, axis)
    every = lax.all_gather(x, axis)
    return functools.reduce(combine_max, [jax.tree.map(lambda a, j=j: a[j], every)
                                          for j in range(stages)])
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, Fp8Meta))


class _Slots:
  """What one stage does in a (stage, tick) slot of a schedule: the pieces both schedules are
  made of (inside ``shard_map``; see :func:`gpipe`)."""

  def __init__(self, fns: Stages, stacked, shared, parts, stages: int, axis: str, count=None):
    self.fns, self.stacked, self.shared, self.parts = fns, stacked, shared, parts
    self.k, self.stages, self.axis = parts.shape[0], stages, axis
    self.count = self.k if count is None else count  # microbatches that run
    s = lax.axis_index(axis)
    self.s, self.first, self.last = s, s == 0, s == stages - 1
    x = jax.eval_shape(fns.first, shared, parts[0])
    self.x0 = jnp.zeros(x.shape, x.dtype)

  def slot(self, t, offset):
    """(ran, index, microbatch) of microbatch t - offset: ran is False in a bubble (the index
    is then clipped into range, and nothing may use the slot's results)."""
    m = t - offset
    i = jnp.clip(m, 0, self.k - 1)
    return (m >= 0) & (m < self.count), i, lax.dynamic_index_in_dim(self.parts, i,
                                                                       keepdims=False)

  def forward(self, recv, ran, part):
    """(x, y): the stage's input (stage 0: `first` of the microbatch, else `recv`) and its
    output (the last stage's is x: it runs its layers in its backward slot)."""
    x = lax.cond(self.first & ran, lambda: self.fns.first(self.shared, part), lambda: recv)
    if self.fns.lockstep:
      return x, self.fns.stage(self.stacked, x, ran & ~self.last)
    y = lax.cond(ran & ~self.last, lambda: self.fns.stage(self.stacked, x), lambda: x)
    return x, y

  def send(self, y, direction: int):
    """`y` to the next (+1) or previous (-1) stage; the end stages receive zeros."""
    pairs = [(j, j + 1) for j in range(self.stages - 1)]
    return lax.ppermute(y, self.axis, pairs if direction > 0 else [(b, a) for a, b in pairs])

  def _head(self, y, part):
    loss, (g_shared, dy) = jax.value_and_grad(self.fns.last, argnums=(0, 1))(self.shared, y,
                                                                             part)
    return loss, g_shared, dy

  def _backward(self, x, g_in, part, ran=True):
    stage = (lambda st, x: self.fns.stage(st, x, ran)) if self.fns.lockstep else self.fns.stage
    y, stage_vjp = jax.vjp(stage, self.stacked, x)
    shapes = jax.eval_shape(self._head, y, part)
    loss, g_shared, dy = lax.cond(self.last & ran, lambda: self._head(y, part),
                                  lambda: (*_zeros(shapes[:2]), g_in.astype(y.dtype)))
    g_stacked, dx = stage_vjp(dy)
    g_first = lax.cond(self.first & ran,
                       lambda: jax.vjp(lambda sh: self.fns.first(sh, part), self.shared)[1](
                           dx)[0],
                       lambda: jax.tree.map(jnp.zeros_like, self.shared))
    return loss, g_stacked, accumulate_gradients(g_shared, g_first), dx

  def backward(self, acc, x, g_in, ran, part):
    """The stage's backward of a microbatch from its kept input `x` (its layers' forward
    again under ``jax.vjp``; the last stage starts from `last`'s gradient, stage 0 ends in
    `first`'s), added into `acc` = (loss sum, stacked gradients, shared gradients) unless
    the slot is a bubble (lockstep stages: their parameter gradients, already summed over
    the replicas, are added in every slot). Returns (acc, the input's gradient)."""
    loss_sum, acc_stacked, acc_shared = acc
    if self.fns.lockstep:
      # Every slot runs the stage's collectives (it computes where ran), and every slot's
      # parameter gradients are sums over the replicas: added unmasked; FP8 state masked.
      loss, g_stacked, g_shared, dx = self._backward(x, g_in, part, ran)
      acc_stacked = jax.tree.map(
          lambda a, g: _select(ran, combine_max(a, g), a) if isinstance(a, Fp8Meta) else a + g,
          acc_stacked, g_stacked, is_leaf=lambda x: isinstance(x, Fp8Meta))
    else:
      shapes = jax.eval_shape(self._backward, x, g_in, part)
      loss, g_stacked, g_shared, dx = lax.cond(ran, lambda: self._backward(x, g_in, part),
                                               lambda: _zeros(shapes))
      acc_stacked = _select(ran, accumulate_gradients(acc_stacked, g_stacked), acc_stacked)
    return (loss_sum + jnp.where(ran, loss, 0.0), acc_stacked,
            _select(ran, accumulate_gradients(acc_shared, g_shared), acc_shared)), dx

  def zeros(self):
    """The accumulators (loss sum, stacked gradients, shared gradients) before any slot."""
    return (jnp.zeros((), jnp.float32), accumulator_zeros(self.stacked),
            accumulator_zeros(self.shared))

  def result(self, acc, sums: bool = False):
    """(mean loss, mean stacked gradients, mean shared gradients combined over the
    stages); with `sums`, sums over the microbatches that ran (none: zeros)."""
    loss_sum, acc_stacked, acc_shared = acc
    if sums:
      return (lax.psum(loss_sum, self.axis), acc_stacked,
              _combine_over(acc_shared, self.axis, self.stages))
    n = self.count
    return (lax.psum(loss_sum, self.axis) / n, mean_gradients(acc_stacked, n),
            mean_gradients(_combine_over(acc_shared, self.axis, self.stages), n))


def _keep(saved, j, x, ran):
  """`saved` with `x` at index `j` when `ran`."""
  old = lax.dynamic_index_in_dim(saved, j, keepdims=False)
  return lax.dynamic_update_index_in_dim(saved, jnp.where(ran, x, old), j, 0)


def gpipe(fns: Stages, stacked, shared, parts, count=None, *, stages: int, axis: str = PIPE,
          sums: bool = False):
  """One step's loss and gradients under the GPipe schedule (call inside ``jax.shard_map``
  manual over `axis`; see the module docstring): k + P - 1 forward ticks, then k + P - 1
  backward ticks; each stage keeps k inputs.

  Args:
    fns: the model's :class:`Stages`.
    stacked: this stage's slice of the stacked variables ([L/P, ...] leaves).
    shared: the other variables (whole).
    parts: int32[k, mb, T+1], the step's k microbatches (the same on every stage).
    count: None (all k run) or an int32 scalar in [1, k]: the first `count` run (with
      `sums`, also 0).
    stages: P, the size of `axis`.
    sums: return sums over the microbatches that ran instead of means (a per-group step
      adds them over the groups).
  Returns (mean loss over the microbatches, this stage's gradient of `stacked`, the gradient
  of `shared`): parameter gradients are means over the microbatches (summed in f32), FP8
  state the max-combined update; `shared`'s is the same on every stage.
  """
  check_stages(stages, parts.shape[0])
  p = _Slots(fns, stacked, shared, parts, stages, axis, count)
  ticks = jnp.arange(p.k + stages - 1)

  def forward(carry, t):
    recv, saved = carry
    ran, i, part = p.slot(t, p.s)
    x, y = p.forward(recv, ran, part)
    return (p.send(y, +1), _keep(saved, i, x, ran)), None

  saved = jnp.zeros((p.k, *p.x0.shape), p.x0.dtype)
  (_, saved), _ = lax.scan(forward, (p.x0, saved), ticks)

  def backward(carry, t):
    recv, acc = carry
    ran, i, part = p.slot(t, stages - 1 - p.s)
    x = lax.dynamic_index_in_dim(saved, i, keepdims=False)
    acc, dx = p.backward(acc, x, recv, ran, part)
    return (p.send(dx, -1), acc), None

  (_, acc), _ = lax.scan(backward, (p.x0, p.zeros()), ticks)
  return p.result(acc, sums)


def one_f_one_b(fns: Stages, stacked, shared, parts, count=None, *, stages: int,
                axis: str = PIPE, sums: bool = False):
  """:func:`gpipe`'s result under the 1F1B schedule: k + 2(P - 1) ticks, in each of which
  stage s runs the forward of microbatch t - s and the backward of microbatch
  t - 2(P - 1) + s (the last stage both of the same one), so a stage keeps at most 2P - 1
  inputs (a ring) instead of k. The stages run in lockstep (one program), so a tick lasts a
  forward plus a backward everywhere: the bubble is 2(P - 1) / (k + 2(P - 1)) of the step,
  against GPipe's (P - 1) / (k + P - 1)."""
  check_stages(stages, parts.shape[0])
  p = _Slots(fns, stacked, shared, parts, stages, axis, count)
  ring = 2 * stages - 1

  def tick(carry, t):
    recv_x, recv_g, saved, acc = carry
    ran, i, part = p.slot(t, p.s)
    x, y = p.forward(recv_x, ran, part)
    saved = _keep(saved, i % ring, x, ran)  # (read back below by the last stage)
    ran, i, part = p.slot(t, 2 * (stages - 1) - p.s)
    acc, dx = p.backward(acc, lax.dynamic_index_in_dim(saved, i % ring, keepdims=False),
                         recv_g, ran, part)
    return (p.send(y, +1), p.send(dx, -1), saved, acc), None

  saved = jnp.zeros((ring, *p.x0.shape), p.x0.dtype)
  start = (p.x0, p.x0, saved, p.zeros())
  (*_, acc), _ = lax.scan(tick, start, jnp.arange(p.k + 2 * (stages - 1)))
  return p.result(acc, sums)


SCHEDULE_FNS = {"gpipe": gpipe, "1f1b": one_f_one_b}


def gpipe_loss(fns: Stages, stacked, shared, parts, *, stages: int, axis: str = PIPE):
  """The mean loss of k >= 1 microbatches through the stages, forwards only (evaluation:
  nothing is kept; the last stage runs its layers and `last`); arguments as :func:`gpipe`."""
  k = parts.shape[0]
  s = lax.axis_index(axis)
  last_stage = s == stages - 1
  x_aval = jax.eval_shape(fns.first, shared, parts[0])

  def forward(carry, t):
    recv, loss_sum = carry
    m = t - s
    ran = (m >= 0) & (m < k)
    part = lax.dynamic_index_in_dim(parts, jnp.clip(m, 0, k - 1), keepdims=False)
    x = lax.cond((s == 0) & ran, lambda: fns.first(shared, part), lambda: recv)
    y = lax.cond(ran, lambda: fns.stage(stacked, x), lambda: x)
    loss = lax.cond(ran & last_stage, lambda: fns.last(shared, y, part).astype(jnp.float32),
                    lambda: jnp.zeros((), jnp.float32))
    recv = lax.ppermute(y, axis, [(j, j + 1) for j in range(stages - 1)])
    return (recv, loss_sum + loss), None

  start = (jnp.zeros(x_aval.shape, x_aval.dtype), jnp.zeros((), jnp.float32))
  (_, loss_sum), _ = lax.scan(forward, start, jnp.arange(k + stages - 1))
  return lax.psum(loss_sum, axis) / k


def _stages_of(mesh: Mesh, axis: str) -> int:
  return pipe_size(mesh) if axis == PIPE else int(mesh.shape[axis])


def pipeline_loss(fns: Stages, mesh: Mesh, stacked, shared, parts, *, axis: str = PIPE,
                  stage_layers=None):
  """:func:`gpipe_loss` over `mesh`'s `axis`, laid out as :func:`pipeline_grads` (with
  `stage_layers` as there)."""
  if stage_layers is not None:
    fns = uneven(fns, stage_layers, axis)
  body = functools.partial(gpipe_loss, fns, stages=_stages_of(mesh, axis), axis=axis)
  return jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(), P()), out_specs=P(),
                       axis_names={axis}, check_vma=False)(
                           pad_stack(stacked, stage_layers), shared, parts)


def pipeline_grads(fns: Stages, mesh: Mesh, stacked, shared, parts, count=None, *,
                   axis: str = PIPE, schedule: str = "gpipe", stage_layers=None):
  """:func:`gpipe` (or :func:`one_f_one_b`, `schedule` "1f1b") over `mesh`'s `axis`
  (``jax.shard_map`` manual over it only): `stacked` leaves [L, ...] split along their layer
  axis, `shared` and `parts` whole, `count` as :func:`gpipe`'s; returns (mean loss, gradient
  of `stacked` [L, ...] laid out like it, gradient of `shared`). `stage_layers`: None (L/P
  layers per stage) or the layers each stage runs (:func:`check_stage_layers`; the module
  docstring says how they are laid out).

  The FP8 GEMMs inside agree their amaxes over the ``Auto`` axes by themselves (a max over a
  sharded array is global); over "pipe" nothing is agreed: each layer lives on one stage.
  (Hence ``check_vma=False``: the check would ask for a max over "pipe", which would mix
  different layers' amaxes.)
  """
  stages = _stages_of(mesh, axis)
  if stage_layers is not None:
    stage_layers = check_stage_layers(stage_layers, stages,
                                      int(jax.tree.leaves(stacked)[0].shape[0]))
    fns = uneven(fns, stage_layers, axis)
  body = functools.partial(SCHEDULE_FNS[check_schedule(schedule)], fns, stages=stages,
                           axis=axis)
  args = (pad_stack(stacked, stage_layers), shared, parts)
  if count is None:
    loss, g_stacked, g_shared = jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis), P(), P()), out_specs=(P(), P(axis), P()),
        axis_names={axis}, check_vma=False)(*args)
  else:
    loss, g_stacked, g_shared = jax.shard_map(
        body, mesh=mesh, in_specs=(P(axis), P(), P(), P()), out_specs=(P(), P(axis), P()),
        axis_names={axis}, check_vma=False)(*args, jnp.asarray(count, jnp.int32))
  return loss, unpad_stack(g_stacked, stage_layers), g_shared
