"""Checkpoints of the whole train state with orbax, restored onto any mesh.

A checkpoint is one orbax step directory ``<dir>/<step>/`` with two items:

* ``state``: the :class:`fp8jax.train.state.TrainState` pytree (params or FP16
  ``MasterWeights``, FP8 scales and amax histories, optimizer state with its E4M3/FP16
  ``ScaledArray`` leaves in their native dtypes, step), each array saved from its shards;
* ``meta``: JSON: the data iterator's position, the config, guard counters and anything
  else the caller passes.

Saves are asynchronous (the device-to-host copy happens in :meth:`CheckpointManager.save`,
the write in the background), so the train step may donate the state right after. orbax
writes into a temporary directory and renames it when complete: a save torn by a crash is
never listed, so never restored. A checkpoint that fails to restore (a truncated or corrupted
file) is reported, moved aside to ``damaged-<step>`` and the previous one is used.

Restore takes target shardings (a pytree of ``jax.sharding.Sharding`` shaped like the
state; default: the given state's own), so a checkpoint saved on 8 devices under one
sharding restores onto 4 or 1 devices under another.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

logger = logging.getLogger("fp8jax")

DAMAGED_PREFIX = "damaged-"


class Restored(NamedTuple):
  """What :meth:`CheckpointManager.restore` returns.

  Attributes:
    step: the checkpoint's step.
    state: the state pytree, every array placed with its target sharding.
    meta: the JSON metadata saved with it.
  """
  step: int
  state: Any
  meta: dict


def _check_int(name: str, value, low: int, allow_none: bool = False) -> None:
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < low:
    extra = " or None" if allow_none else ""
    raise ValueError(f"{name}={value!r} is not allowed; use an integer >= {low}{extra}")


def abstract_state(state, shardings=None):
  """`state` as ``jax.ShapeDtypeStruct`` leaves carrying `shardings` (default: each leaf's own
  sharding); the restore target."""
  if shardings is None:
    shardings = jax.tree.map(lambda x: x.sharding, state)
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      state, shardings)


class CheckpointManager:
  """Saves every `save_every` steps, keeps the newest `keep` (plus every `keep_every`-th
  step when given), restores the newest good checkpoint.

  Args:
    directory: where step directories go (created).
    save_every: steps between periodic saves; 0: only saves forced by the caller.
    keep: newest checkpoints kept (>= 1).
    keep_every: also keep every checkpoint whose step is a multiple of it (None: no).
    async_save: write in the background (True) or block in :meth:`save`.
  """

  def __init__(self, directory: str | os.PathLike, *, save_every: int = 0, keep: int = 3,
               keep_every: int | None = None, async_save: bool = True):
    _check_int("save_every", save_every, 0)
    _check_int("keep", keep, 1)
    _check_int("keep_every", keep_every, 1, allow_none=True)
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = save_every
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every,
                                           enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def should_save(self, step: int) -> bool:
    """True when `step` (steps taken) is a periodic save point."""
    return self.save_every > 0 and step > 0 and step % self.save_every == 0

  def steps(self) -> list[int]:
    """Steps of the complete checkpoints on disk, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def save(self, step: int, state, meta: dict | None = None) -> bool:
    """Starts saving `state` and `meta` as step `step` (returns False if it exists)."""
    _check_int("step", step, 0)
    if step in self._manager.all_steps():
      return False
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              meta=ocp.args.JsonSave(dict(meta or {}, step=step)))
    return bool(self._manager.save(step, args=args, force=True))

  def wait(self) -> None:
    """Blocks until the background write (if any) is on disk."""
    self._manager.wait_until_finished()

  def restore(self, state, shardings=None, step: int | None = None) -> Restored | None:
    """The newest checkpoint that restores (or `step`), placed on `shardings`.

    Args:
      state: a pytree like the saved state (arrays or ``ShapeDtypeStruct``s): its structure,
        shapes and dtypes are the target's.
      shardings: a pytree of ``jax.sharding.Sharding`` shaped like `state` (default: the
        leaves' own shardings); the restored arrays are laid out this way.
      step: restore exactly this step (no fallback) instead of the newest good one.
    Returns None when there is no checkpoint. A checkpoint that fails to load is logged
    (warning), moved aside to ``damaged-<step>`` and the one before it is tried.
    """
    target = abstract_state(state, shardings)
    if step is not None:
      return self._restore(step, target)
    for candidate in reversed(self.steps()):
      try:
        return self._restore(candidate, target)
      except Exception as e:  # orbax raises many types for unreadable files
        logger.warning("checkpoint step %d in %s is damaged and was skipped (%s: %s); "
                       "trying the previous one", candidate, self.directory,
                       type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
        self._set_aside(candidate)
    return None

  def _restore(self, step: int, target) -> Restored:
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target),
                              meta=ocp.args.JsonRestore())
    out = self._manager.restore(step, args=args)
    return Restored(step, out["state"], dict(out["meta"]))

  def _set_aside(self, step: int) -> None:
    """Renames a damaged step directory so it is neither restored again nor overwritten."""
    src = os.path.join(self.directory, str(step))
    if jax.process_index() == 0 and os.path.isdir(src):
      os.rename(src, os.path.join(self.directory, f"{DAMAGED_PREFIX}{step}-{int(time.time())}"))
    self._manager.reload()

  def close(self) -> None:
    """Waits for pending writes and releases orbax's resources."""
    self._manager.wait_until_finished()
    self._manager.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


__all__ = ["CheckpointManager", "Restored", "abstract_state"]
