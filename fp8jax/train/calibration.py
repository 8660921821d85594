"""Which model a step runs while FP8 scales are not yet calibrated (``fp8.calibrate``).

Delayed scaling casts a never-observed FP8 state with a just-in-time scale, which makes every
cast wait for its own tensor's amax. The calibrated model (``Recipe(calibrated=True)``) trusts
the stored scales instead. Before the first step a calibration pass (the FP8 probe,
``fp8jax.train.health.probe``: one microbatch forward+backward of the uncalibrated model, no
parameter gradients; with pipeline stages through the stages, each holding its own layers)
observes the step's first microbatch and :func:`calibrated_scales` gives every never-observed
state the scale it observed, so the calibrated step runs from the first step on: one compiled
train step per run. Where some state is still unobserved after the calibrated step (a GEMM
the first microbatch did not reach), :class:`Calibration` runs the uncalibrated model until
every FP8 state has observed a tensor (checked after each such step; a restored state is
checked afresh), then the calibrated one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np

from fp8jax.scaling import Fp8Meta


def any_unobserved(fp8_state) -> bool:
  """True when some FP8 state (an Fp8Meta of `fp8_state`, stacked or not) has never observed
  a tensor: its whole amax history is zero. Reads every shard (a stacked state split over
  pipeline stages holds other layers on other devices) and, with several processes, agrees
  across them (every process must call it). Waits for the device."""
  metas = jax.tree.leaves(fp8_state, is_leaf=lambda x: isinstance(x, Fp8Meta))
  found = any(_unobserved(part) for m in metas if isinstance(m, Fp8Meta)
              for part in _local_parts(m.amax_history))
  if jax.process_count() > 1:
    found = bool(np.any(multihost_utils.process_allgather(np.asarray(found))))
  return found


def _local_parts(x) -> list[np.ndarray]:
  """This process's shards of `x` (a jax.Array, or `x` itself as one part)."""
  if hasattr(x, "addressable_shards"):
    return [np.asarray(s.data) for s in x.addressable_shards]
  return [np.asarray(x)]


def _unobserved(history: np.ndarray) -> bool:
  return bool(history.size) and bool((history.max(axis=-1) <= 0).any())


def calibrated_scales(fp8_state, observed_state):
  """`fp8_state` whose never-observed metas (stacked or not) take their scale from
  `observed_state`, the same tree after observing a batch (``fp8jax.apply_fp8_updates`` of
  a probe); amax histories and observed metas are unchanged. A calibrated step of that batch
  then casts with each never-observed tensor's own amax, as the uncalibrated model's first
  step does, and records the same history. Jittable."""
  def one(old: Fp8Meta, new: Fp8Meta) -> Fp8Meta:
    unobserved = jnp.max(old.amax_history, axis=-1) <= 0
    return Fp8Meta(jnp.where(unobserved, new.scale, old.scale), old.amax_history)
  return jax.tree.map(one, fp8_state, observed_state, is_leaf=lambda x: isinstance(x, Fp8Meta))


def calibrated(model):
  """`model` (a module with a ``recipe`` field) whose casts trust their stored scales."""
  return model.clone(recipe=model.recipe.replace(calibrated=True))


class Calibration:
  """The model of the next step.

  Args:
    model: the run's model (its casts fall back to just-in-time scales when unobserved).
    calibrated_model: the same model with ``Recipe(calibrated=True)``, run once every FP8
      state has observed a tensor or been given a scale by a calibration pass; None: always
      `model`.
  Attributes:
    first: the model run while some state is unobserved; model: the steady model.
    passes: calibration passes run since the state was last replaced.
  """

  def __init__(self, model, calibrated_model=None):
    self.enabled, self.first = calibrated_model is not None, model
    self.model = model if calibrated_model is None else calibrated_model
    self._first: bool | None = None  # None: not checked yet for the current state
    self._check = False  # check the histories after the next step
    self.passes = 0

  def uses_first(self, fp8_state) -> bool:
    """Whether the next step needs scales that some state has not observed (reads the state
    once per new state): the step runs :attr:`first`, unless a calibration pass gives them
    (:meth:`wants_pass`)."""
    if self._first is None:
      self._first = self.enabled and any_unobserved(fp8_state)
    return self._first

  def wants_pass(self, fp8_state) -> bool:
    """Whether a calibration pass should precede the next step: :meth:`uses_first` and no
    pass has run on this state yet (a state still unobserved after one pass and its step
    stays so: it goes to :attr:`first`)."""
    return self.uses_first(fp8_state) and self.passes == 0

  def passed(self) -> None:
    """A calibration pass gave every unobserved state a scale: the next step runs the
    calibrated model; :meth:`observed` checks the state it leaves."""
    self.passes += 1
    self._first, self._check = False, True

  def observed(self, fp8_state) -> None:
    """After a step of :attr:`first` or the step after a pass: checks whether the new state
    has observed a tensor everywhere."""
    if self._first or self._check:
      self._first, self._check = self.enabled and any_unobserved(fp8_state), False

  def reset(self) -> None:
    """The state was replaced (restored, reloaded): check it again before the next step."""
    self._first, self._check, self.passes = None, False, 0

  @property
  def pending(self) -> bool | None:
    """True while steps run :attr:`first`; None before the first check."""
    return self._first
