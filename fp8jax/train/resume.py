"""A run's checkpoints: what a checkpoint holds besides the state, resuming, reloading.

:class:`RunCheckpoints` wraps ``fp8jax.checkpoint.CheckpointManager`` for the Trainer: every
checkpoint carries the data position, the config and the guards' records (skipped steps, the
BF16 fallback reason); :meth:`RunCheckpoints.resume` refuses a checkpoint of another model or
level before restoring; :meth:`RunCheckpoints.reload` brings back the newest state after too
many non-finite steps.
"""
from __future__ import annotations

import os
from typing import NamedTuple

from fp8jax import checkpoint as checkpoint_lib
from fp8jax.config import Config, config_to_dict


class RunRecords(NamedTuple):
  """What a checkpoint holds besides the state.

  Attributes:
    data: the train batch iterator's position (``BatchIterator.state()``).
    skipped_steps: non-finite steps skipped so far.
    bf16_fallback: why the run switched to BF16 GEMMs (None: it did not).
  """
  data: dict
  skipped_steps: int = 0
  bf16_fallback: str | None = None


def saved_fallback(meta: dict | None) -> str | None:
  """The BF16 fallback reason recorded in checkpoint metadata `meta` (None: none)."""
  return (meta or {}).get("bf16_fallback")


class RunCheckpoints:
  """The checkpoints of the run configured by `config` (its checkpoint section), in
  `run_dir`/checkpoints unless ``checkpoint.dir`` says otherwise."""

  def __init__(self, config: Config, run_dir: str):
    c = config.checkpoint
    self.config = config
    self.manager = checkpoint_lib.CheckpointManager(
        c.dir or os.path.join(run_dir, "checkpoints"), save_every=c.checkpoint_every_n_steps,
        keep=c.keep, keep_every=c.keep_every, async_save=c.async_save)

  @property
  def directory(self) -> str:
    return self.manager.directory

  def should_save(self, step: int) -> bool:
    return self.manager.should_save(step)

  def save(self, step: int, state, records: RunRecords) -> None:
    """Starts an asynchronous checkpoint of `state` after `step` steps with `records`."""
    meta = {"data": records.data, "config": config_to_dict(self.config),
            "skipped_steps": records.skipped_steps, "bf16_fallback": records.bf16_fallback}
    self.manager.save(step, state, meta)

  def wait(self) -> None:
    self.manager.wait()

  def newest_meta(self) -> dict | None:
    """The newest checkpoint's metadata, after checking it belongs to this run's model and
    level (ValueError naming the differing key otherwise); None when there is none."""
    meta = self.manager.metadata()
    if meta is not None:
      self._check_same_run(meta)
    return meta

  def restore(self, state, shardings=None) -> checkpoint_lib.Restored | None:
    """The newest good checkpoint restored like `state` onto `shardings` (default: the
    state's own); None when there is none."""
    return self.manager.restore(state, shardings)

  def _check_same_run(self, meta: dict) -> None:
    """Refuses a checkpoint of another model or level (its state would not fit)."""
    saved = meta.get("config", {})
    mine = config_to_dict(self.config)
    for section, key in [("model", k) for k in mine["model"]] + [("train", "opt_level")]:
      old = saved.get(section, {}).get(key, mine[section][key])
      if old != mine[section][key]:
        raise ValueError(
            f"{section}.{key}={mine[section][key]!r} but the checkpoints in "
            f"{self.directory} were written with {section}.{key}={old!r}; use "
            f"the same value to resume, or another checkpoint.dir / auto_resume: false")


def records_of(meta: dict) -> RunRecords:
  """The :class:`RunRecords` saved in checkpoint metadata `meta`."""
  return RunRecords(meta["data"], int(meta.get("skipped_steps", 0)), saved_fallback(meta))


__all__ = ["RunCheckpoints", "RunRecords", "records_of", "saved_fallback"]
