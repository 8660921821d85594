"""Checkpoints of the whole train state with orbax, restored onto any mesh.

A checkpoint is one orbax step directory ``<dir>/<step>/`` with two items:

* ``state``: the :class:`fp8jax.train.state.TrainState` pytree (params or FP16
  ``MasterWeights``, FP8 scales and amax histories, optimizer state with its E4M3/FP16
  ``ScaledArray`` leaves in their native dtypes, step), each array saved from its shards;
* ``meta``: JSON: the data iterator's position, the config, guard counters and anything
  else the caller passes.

Saves are asynchronous (the device-to-host copy happens in :meth:`CheckpointManager.save`,
the write in the background), so the train step may donate the state right after; a new save
first waits for the previous one. orbax writes into a temporary directory
(``<step>.orbax-checkpoint-tmp-*``) and renames it when complete: a save torn by a crash is
never listed, so never restored, and a new manager removes such folders (with a warning).
So a process killed while a save is in flight resumes from the save before it: with saves
every N steps, at most 2N steps are lost (N with synchronous saves). A checkpoint
that fails to restore (a truncated or corrupted file) is reported, moved aside to
``damaged-<step>`` and the previous one is used; one that is intact but holds arrays of other
shapes than the state to restore (another model) raises :class:`ShapeMismatch` and stays.

Restore takes target shardings (a pytree of ``jax.sharding.Sharding`` shaped like the
state; default: the given state's own), so a checkpoint saved on 8 devices under one
sharding restores onto 4 or 1 devices under another.

A state that is a NamedTuple may gain or lose fields between the run that saved and the one
that restores (e.g. ``TrainState.comm``, the FP8 grad-comm scaling state, absent from
checkpoints written before it existed or by runs with ``grad_comm_scaling=current``): a field
with arrays in the target but none on disk keeps the given state's value (placed on its
target sharding), and saved arrays of a field that is empty in the target are dropped.
"""
from __future__ import annotations

import logging
import os
import pathlib
import shutil
import time
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp

logger = logging.getLogger("fp8jax")

DAMAGED_PREFIX = "damaged-"
TORN_MARK = ".orbax-checkpoint-tmp"  # orbax's suffix of a save still being written


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


class MissingField(ValueError):
  """A checkpoint lacks a state field and the given state has no value to start it from."""


class ShapeMismatch(ValueError):
  """A checkpoint's arrays have other shapes than the state to restore (another model shape
  or layout): the checkpoint is intact and is left in place."""


# orbax's words for a requested shape that differs from the stored one (not a damaged file)
_SHAPE_MISMATCH = "is not compatible with the stored shape"


def _fit_fields(target, saved) -> tuple[dict, list[str]] | None:
  """How NamedTuple `target` restores from a checkpoint whose saved tree is `saved`: (the
  restore item by field, the fields to take from the given state); None when it fits as is."""
  if not (isinstance(target, tuple) and hasattr(target, "_fields") and isinstance(saved, dict)):
    return None
  has = lambda tree: bool(jax.tree.leaves(tree))
  leaf = next((x for x in jax.tree.leaves(target)
               if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding)), None)
  replicated = (jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec())
                if leaf is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  skip = lambda tree: jax.tree.map(  # read (orbax restores whole trees only), then dropped
      lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated), tree)
  read, fill = {}, []
  for f in target._fields:
    want = getattr(target, f)
    if f in saved and has(want) == has(saved[f]):
      read[f] = want
    elif has(want):
      fill.append(f)
      if f in saved:
        read[f] = saved[f]  # an empty tree
    elif f in saved:
      read[f] = skip(saved[f])
  for f in saved:
    if f not in target._fields:
      read[f] = skip(saved[f])
  if not fill and set(read) == set(target._fields) and \
      all(read[f] is getattr(target, f) for f in read):
    return None
  return read, fill


class CheckpointManager:
  """Saves every `save_every` steps, keeps the newest `keep` (plus every `keep_every`-th
  step when given), restores the newest good checkpoint.

  Args:
    directory: where step directories go (created).
    save_every: steps between periodic saves; 0: only saves forced by the caller.
    keep: newest checkpoints kept (>= 1).
    keep_every: also keep every checkpoint whose step is a multiple of it (None: no).
    async_save: write in the background (True) or block in :meth:`save`.
    read_only: only read (e.g. the checkpoints of a run still training): nothing on disk is
      removed, renamed or written (torn saves are left alone, a damaged checkpoint is
      skipped where it is); :meth:`save` raises ValueError.
  """

  def __init__(self, directory: str | os.PathLike, *, save_every: int = 0, keep: int = 3,
               keep_every: int | None = None, async_save: bool = True,
               read_only: bool = False):
    _check_int("save_every", save_every, 0)
    _check_int("keep", keep, 1)
    _check_int("keep_every", keep_every, 1, allow_none=True)
    self.directory = os.path.abspath(os.fspath(directory))
    self.save_every = save_every
    self.read_only = bool(read_only)
    self.torn = [] if self.read_only else self._remove_torn_saves()
    if self.read_only:
      absl = logging.getLogger("absl")
      level = absl.level
      absl.setLevel(logging.ERROR)  # orbax warns that a read-only manager saves nothing
      try:
        options = ocp.CheckpointManagerOptions(create=False, read_only=True)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
      finally:
        absl.setLevel(level)
      return
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, keep_period=keep_every,
                                           enable_async_checkpointing=async_save, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def _remove_torn_saves(self) -> list[str]:
    """Removes the folders of saves that never finished (a process stopped while orbax wrote
    them; the first process removes them) and returns their names, oldest step first."""
    if not os.path.isdir(self.directory):
      return []
    torn = sorted((n for n in os.listdir(self.directory) if TORN_MARK in n),
                  key=lambda n: (len(n.split(".")[0]), n))
    if torn:
      logger.warning("checkpoint saves %s in %s did not finish (the process stopped while "
                     "writing them); removed: the newest complete checkpoint is used",
                     ", ".join(torn), self.directory)
      if jax.process_index() == 0:
        for name in torn:
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    return torn

  def should_save(self, step: int) -> bool:
    """True when `step` (steps taken) is a periodic save point."""
    return self.save_every > 0 and step > 0 and step % self.save_every == 0

  def steps(self) -> list[int]:
    """Steps of the complete checkpoints on disk, oldest first."""
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    steps = self.steps()
    return steps[-1] if steps else None

  def metadata(self, step: int | None = None) -> dict | None:
    """The JSON metadata saved with checkpoint `step` (default: the newest), without reading
    the state; None when there is none or it is unreadable."""
    step = self.latest_step() if step is None else step
    if step is None:
      return None
    try:
      out = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    except Exception:  # the state's restore reports unreadable checkpoints
      return None
    return dict(out["meta"])

  def save(self, step: int, state, meta: dict | None = None) -> bool:
    """Starts saving `state` and `meta` as step `step` (returns False if it exists)."""
    if self.read_only:
      raise ValueError(f"the checkpoint manager of {self.directory} is read-only")
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
    (warning), moved aside to ``damaged-<step>`` and the one before it is tried; one whose
    arrays have other shapes than `state`'s raises :class:`ShapeMismatch` and stays in place.
    """
    target = abstract_state(state, shardings)
    if step is not None:
      return self._restore(step, target, state)
    for candidate in reversed(self.steps()):
      try:
        return self._restore(candidate, target, state)
      except (MissingField, ShapeMismatch):
        raise
      except Exception as e:  # orbax raises many types for unreadable files
        logger.warning("checkpoint step %d in %s is damaged and was skipped (%s: %s); "
                       "trying the previous one", candidate, self.directory,
                       type(e).__name__, str(e).splitlines()[0][:300] if str(e) else "")
        self._set_aside(candidate)
    return None

  def _restore(self, step: int, target, state=None) -> Restored:
    fit = _fit_fields(target, self._saved_tree(step))
    item = target if fit is None else fit[0]
    args = ocp.args.Composite(state=ocp.args.StandardRestore(item),
                              meta=ocp.args.JsonRestore())
    try:
      out = self._manager.restore(step, args=args)
    except Exception as e:
      if _SHAPE_MISMATCH not in str(e):
        raise
      raise ShapeMismatch(
          f"checkpoint step {step} in {self.directory} does not fit the state to restore "
          f"({str(e).splitlines()[0][:300]}): it was written for another model shape or "
          "layout; restore it with that model, or use another checkpoint directory") from e
    restored = out["state"]
    if fit is not None:
      fields = {}
      for f in target._fields:
        want = getattr(target, f)
        if f in fit[1]:
          fields[f] = self._fresh(step, f, getattr(state, f), want)
        else:
          fields[f] = restored[f] if item.get(f) is want else want
      restored = type(target)(**fields)
    return Restored(step, restored, dict(out["meta"]))

  def _fresh(self, step: int, name: str, given, target):
    """Field `name` that checkpoint `step` lacks: the given state's value on its sharding."""
    if given is None or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(given)):
      raise MissingField(f"checkpoint step {step} in {self.directory} has no {name!r}; pass "
                         f"a state with arrays for {name!r} to start it fresh")
    logger.warning("checkpoint step %d has no %r: it starts from the given state's value",
                   step, name)
    return jax.device_put(given, jax.tree.map(lambda t: t.sharding, target))

  def _saved_tree(self, step: int):
    """The saved state's metadata tree of `step` (None when unreadable)."""
    try:
      md = ocp.StandardCheckpointHandler().metadata(
          pathlib.Path(self.directory, str(step), "state"))
    except Exception:  # the restore itself reports unreadable checkpoints
      return None
    tree = getattr(md, "item_metadata", md)
    return getattr(tree, "tree", tree)

  def reload(self) -> None:
    """Re-reads the step folders on disk (after another writer changed them)."""
    self._manager.reload()

  def _set_aside(self, step: int) -> None:
    """Renames a damaged step directory so it is neither restored again nor overwritten
    (read-only: leaves it where it is)."""
    src = os.path.join(self.directory, str(step))
    if jax.process_index() == 0 and os.path.isdir(src) and not self.read_only:
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


__all__ = ["CheckpointManager", "MissingField", "Restored", "ShapeMismatch", "abstract_state"]
