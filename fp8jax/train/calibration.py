"""Which model a step runs while FP8 scales are not yet calibrated (``fp8.calibrate``).

Delayed scaling casts a never-observed FP8 state with a just-in-time scale, which makes every
cast wait for its own tensor's amax. The calibrated model (``Recipe(calibrated=True)``) trusts
the stored scales instead. :class:`Calibration` runs the first model until every FP8 state has
observed a tensor (checked after each such step; a restored state is checked afresh), then the
calibrated one.
"""
from __future__ import annotations

import jax
import numpy as np

from fp8jax.scaling import Fp8Meta


def any_unobserved(fp8_state) -> bool:
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


def calibrated(model):
  """`model` (a module with a ``recipe`` field) whose casts trust their stored scales."""
  return model.clone(recipe=model.recipe.replace(calibrated=True))


class Calibration:
  """The model of the next step.

  Args:
    model: the run's model (its casts fall back to just-in-time scales when unobserved).
    calibrated_model: the same model with ``Recipe(calibrated=True)``, run once every FP8
      state has observed a tensor; None: always `model`.
  Attributes:
    first: the model run while some state is unobserved; model: the steady model.
  """

  def __init__(self, model, calibrated_model=None):
    self.enabled, self.first = calibrated_model is not None, model
    self.model = model if calibrated_model is None else calibrated_model
    self._first: bool | None = None  # None: not checked yet for the current state

  def uses_first(self, fp8_state) -> bool:
    """Whether the next step runs :attr:`first` (reads the state once per new state)."""
    if self._first is None:
      self._first = self.enabled and any_unobserved(fp8_state)
    return self._first

  def observed(self, fp8_state) -> None:
    """After a step of :attr:`first`: checks whether the new state is calibrated."""
    if self._first:
      self._first = any_unobserved(fp8_state)

  def reset(self) -> None:
    """The state was replaced (restored, reloaded): check it again before the next step."""
    self._first = None

  @property
  def pending(self) -> bool | None:
    """True while steps run :attr:`first`; None before the first check."""
    return self._first
