"""ZeRO-3 inside pipeline replicas: a stage's layers gathered one at a time where they run
(call inside ``jax.shard_map`` manual over "pipe" and the ZeRO axes).

With balanced counts (or FP8 gradient communication) each data-parallel group is a pipeline
replica running its own number of microbatches through the stages
(``fp8jax.train.group_loop.GroupLoop(schedule=...)``). At ZeRO-3 the stage's variables enter
as this device's shards. Per-layer collectives over the ZeRO axes pair a device with the same
stage of every other replica, so they must run the same number of times on every replica,
whatever its count: the stage function here runs in every schedule slot, bubbles included
(``fp8jax.parallel.pipeline.Stages.lockstep``), and

* forward, for each of the stage's layers: the layer is gathered (``fp8jax.parallel.
  layer_major.Gathering``: FP8 kernels cast to E4M3 as shards with the tensor's one scale
  and all-gathered as bytes, other leaves in their payload dtype), then run where the slot
  holds a microbatch (``lax.cond``); only the layer's input is kept;
* backward, for each layer in reverse: gathered again, the layer's ``jax.vjp`` at its kept
  input where the slot holds a microbatch (zeros elsewhere), and the layer's parameter
  gradient summed over the ZeRO axes into this device's shard at once (f32
  ``psum_scatter``, or the gathering's reduce, e.g. FP8).

A stage therefore never holds more than one gathered layer and one layer's full gradient.
The cost against the whole-stage gather: each layer is gathered three times per slot pair
(the forward slot; the backward slot's forward again, the stage's remat; its backward) and
reduce-scattered once, in every one of the k + P - 1 forward and backward slots of a step,
bubbles included.
"""
from __future__ import annotations

from typing import Callable

import jax
from jax import lax

from fp8jax.accumulate import widen
from fp8jax.parallel.layer_major import Gathering, layer_dims, one_layer, zeros_of
from fp8jax.parallel.pipeline import Stages


def gathered_stage(stage: Callable, gathering: Gathering, dims) -> Callable:
  """``stage(stacked, x) -> y`` (a model's stage function on whole layers) as a lockstep
  stage function ``(stacked, x, ran) -> y`` on the layers' shards (module docstring).

  Args:
    stage: runs a stack of layers (leaves [n, ...]) on x.
    gathering: how the ZeRO axes' shards are gathered and gradients reduced.
    dims: a tree like the stacked parameters of the dimension each leaf is split along over
      the ZeRO axes, counting the layer axis (None: held whole).
  Returns the lockstep stage: `stacked` ({collection: leaves [n, ...]}, parameters as this
  device's shards), x [m, T, D], ran a bool scalar. Its gradient with respect to `stacked`
  is each split parameter's gradient summed over the ZeRO axes into this device's shard
  (f32 sums, cast to the parameter's dtype), the others' as they are (e.g. FP8 state).
  """
  one_dims = layer_dims(dims)

  def run(layer, x, ran):
    w, const = gathering.gather(layer, one_dims)
    return lax.cond(ran, lambda: stage({**one_layer(w), **one_layer(const)}, x), lambda: x)

  @jax.custom_vjp
  def layer_fn(layer, x, ran):
    return run(layer, x, ran)

  def fwd(layer, x, ran):
    return run(layer, x, ran), (layer, x, ran)

  def bwd(res, dy):
    layer, x, ran = res
    w, const = gathering.gather(layer, one_dims)
    apply = lambda w, x: stage({**one_layer(w), **one_layer(const)}, x)
    vjp = lambda: jax.vjp(apply, w, x)[1](dy)
    g, dx = lax.cond(ran, vjp, lambda: zeros_of(jax.eval_shape(vjp)))
    g = gathering.reduce_grads(jax.tree.map(widen, g), one_dims)  # every slot: pairs up
    g = jax.tree.map(lambda gi, p: gi.astype(p.dtype), g, layer)
    return g, dx, None

  layer_fn.defvjp(fwd, bwd)

  def lockstep(stacked, x, ran):
    return lax.scan(lambda x, layer: (layer_fn(layer, x, ran), None), x, stacked)[0]
  return lockstep


def lockstep_stages(fns: Stages, gathering: Gathering, stacked_dims, shared, shared_dims):
  """(stages, diff_shared): `fns` with its stage gathering each layer where it runs
  (:func:`gathered_stage`) and its first / last reading the shared variables gathered once
  (`shared`: this device's shards; the casts of FP8 kernels ride along as constants).
  diff_shared: the gathered shared variables to differentiate (their gradients are whole:
  reduce them with ``gathering.reduce_grads(g, shared_dims)``)."""
  sh, const = gathering.gather(shared, shared_dims)
  return Stages(first=lambda s, part: fns.first({**s, **const}, part),
                stage=gathered_stage(fns.stage, gathering, stacked_dims),
                last=lambda s, y, part: fns.last({**s, **const}, y, part),
                lockstep=True), sh
