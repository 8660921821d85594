"""A run's folder and checkpoints: what a checkpoint holds besides the state, resuming.

:class:`RunCheckpoints` wraps ``fp8jax.checkpoint.CheckpointManager`` for the Trainer: every
checkpoint carries the data position, the data's fingerprint, the config and the guards'
records (skipped steps, the BF16 fallback reason); :meth:`RunCheckpoints.newest_meta` refuses
a checkpoint of another model or level before restoring, :func:`check_same_data` one written
on other data (the saved position would mean other batches). :func:`claim_run_dir` keeps a
new run from mixing its logs and checkpoints with an earlier run's in the same folder.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fp8jax import checkpoint as checkpoint_lib
from fp8jax.config import Config, config_to_dict

RUN_FILES = ("metrics.jsonl", "events.jsonl", "config.yaml")  # + TensorBoard event files


class RunDirInUse(ValueError):
  """The run folder holds an earlier run that a new (not resumed) run would mix with."""


def checkpoint_dir(config: Config, run_dir: str) -> str:
  """Where the run's checkpoints go: ``checkpoint.dir``, default `run_dir`/checkpoints."""
  return config.checkpoint.dir or os.path.join(run_dir, "checkpoints")


def _logged_steps(path: str) -> list[int]:
  steps = []
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        try:
          steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):  # a line cut short by a kill
          continue
  return steps


def _checkpoint_entries(directory: str) -> list[str]:
  """Step folders (complete, torn or damaged) in a checkpoint directory."""
  if not os.path.isdir(directory):
    return []
  return [n for n in os.listdir(directory) if n.split(".")[0].isdigit()
          or n.startswith(checkpoint_lib.DAMAGED_PREFIX)]


def earlier_run(config: Config, run_dir: str) -> str | None:
  """What an earlier run left in `run_dir` that a new run would mix with, in words (logged
  steps, checkpoints); None when there is nothing."""
  found = []
  steps = _logged_steps(os.path.join(run_dir, "metrics.jsonl"))
  if steps:
    found.append(f"metrics.jsonl logs steps {min(steps)}-{max(steps)}")
  saved = sorted(int(n) for n in _checkpoint_entries(checkpoint_dir(config, run_dir))
                 if n.isdigit())
  if saved:
    found.append(f"checkpoints of steps {', '.join(map(str, saved))}")
  return "; ".join(found) or None


def _free_name(config: Config) -> str:
  """runtime.name with the first suffix -2, -3, ... whose run folder does not exist."""
  r = config.runtime
  i = 2
  while os.path.exists(r.run_dir.format(name=f"{r.name}-{i}")):
    i += 1
  return f"{r.name}-{i}"


def _remove_run(config: Config, run_dir: str) -> None:
  """Removes the files and checkpoint step folders an earlier run wrote in `run_dir`."""
  for name in RUN_FILES:
    path = os.path.join(run_dir, name)
    if os.path.exists(path):
      os.remove(path)
  for path in glob.glob(os.path.join(glob.escape(run_dir), "events.out.tfevents.*")):
    os.remove(path)
  directory = checkpoint_dir(config, run_dir)
  for name in _checkpoint_entries(directory):
    shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def claim_run_dir(config: Config, run_dir: str, *, overwrite: bool = False,
                  checkpoints: "RunCheckpoints | None" = None) -> None:
  """Makes `run_dir` ready for a new run of `config` (call before anything is written).

  A resumed run (``checkpoint.auto_resume``) continues the earlier one: nothing changes.
  Otherwise an earlier run's logged steps or checkpoints (:func:`earlier_run`) raise
  :class:`RunDirInUse` naming them and the ways out (another name, resuming, overwriting).
  `overwrite` removes the earlier run instead (its logs, TensorBoard files and checkpoints;
  on the first process, then every process re-reads `checkpoints`, the run's open manager).
  """
  if overwrite:
    if jax.process_index() == 0:
      _remove_run(config, run_dir)
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices("fp8jax claim_run_dir")
    if checkpoints is not None:
      checkpoints.reload()
    return
  if config.checkpoint.auto_resume:
    return
  found = earlier_run(config, run_dir)
  if found is None:
    return
  rename = (f"--set runtime.name={_free_name(config)}" if "{name}" in config.runtime.run_dir
            else "--set runtime.run_dir=<another folder>")
  ways = [f"start another ({rename})", "replace it (--overwrite)"]
  if "checkpoints" in found:
    ways.insert(1, "continue it (--set checkpoint.auto_resume=true)")
  raise RunDirInUse(f"{run_dir} already holds a run ({found}); a new run would mix with it: "
                    f"{', '.join(ways[:-1])} or {ways[-1]}")


def stopped_line(step: int, signal_name: str | None, config: Config,
                 checkpoints: "RunCheckpoints | None") -> str:
  """What a run stopped by `signal_name` after `step` steps says: where its checkpoint is and
  how to resume ("interrupted" for SIGINT, "preempted" otherwise)."""
  how = "interrupted" if signal_name == "SIGINT" else "preempted"
  if checkpoints is None:
    return (f"{how}: stopped after step {step} (checkpointing is off: nothing saved; set "
            "checkpoint.checkpoint_every_n_steps to keep the work of a stopped run)")
  again = ("run the same command again to resume" if config.checkpoint.auto_resume else
           "resume with the same command and --set checkpoint.auto_resume=true")
  return f"{how}: stopped after step {step}, checkpoint saved in {checkpoints.directory}; {again}"


class RunRecords(NamedTuple):
  """What a checkpoint holds besides the state.

  Attributes:
    data: the train batch iterator's position (``BatchIterator.state()``).
    skipped_steps: non-finite steps skipped so far.
    bf16_fallback: why the run switched to BF16 GEMMs (None: it did not).
    corpus: what the data is (:func:`corpus_record`), None when unknown.
  """
  data: dict
  skipped_steps: int = 0
  bf16_fallback: str | None = None
  corpus: dict | None = None


def corpus_record(data) -> dict:
  """What a checkpoint records of the run's data, a ``fp8jax.data.TokenData``: its
  fingerprint, description and contents (plain strings)."""
  return {"fingerprint": data.fingerprint, "description": data.description,
          "contents": data.contents}


def check_same_data(meta: dict | None, corpus: dict, directory: str) -> None:
  """Refuses (ValueError, one line) to resume a checkpoint whose metadata `meta` records
  other data than `corpus` (:func:`corpus_record` of the data loaded now): the saved data
  position would select other batches. Metadata without a record (older checkpoints) and an
  empty fingerprint pass."""
  saved = (meta or {}).get("corpus")
  if not saved or not saved.get("fingerprint") or not corpus.get("fingerprint"):
    return
  if saved["fingerprint"] == corpus["fingerprint"]:
    return
  def said(c):
    return f"{c.get('description')} ({c.get('contents')}, fingerprint {c['fingerprint'][:12]})"
  raise ValueError(f"the checkpoints in {directory} were trained on other data: {said(saved)}; "
                   f"the data is now {said(corpus)}. Resume with the data the run started "
                   "with (same data.source, data.max_bytes, data.tokenizer and installed "
                   "files), or start a new run (another runtime.name or checkpoint.dir)")


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
        checkpoint_dir(config, run_dir), save_every=c.checkpoint_every_n_steps,
        keep=c.keep, keep_every=c.keep_every, async_save=c.async_save)

  @property
  def directory(self) -> str:
    return self.manager.directory

  def should_save(self, step: int) -> bool:
    return self.manager.should_save(step)

  def save(self, step: int, state, records: RunRecords) -> None:
    """Starts an asynchronous checkpoint of `state` after `step` steps with `records`."""
    meta = {"data": records.data, "config": config_to_dict(self.config),
            "skipped_steps": records.skipped_steps, "bf16_fallback": records.bf16_fallback,
            "corpus": records.corpus}
    self.manager.save(step, state, meta)

  def wait(self) -> None:
    self.manager.wait()

  def reload(self) -> None:
    """Re-reads the checkpoints on disk (after :func:`claim_run_dir` removed some)."""
    self.manager.reload()

  def newest_meta(self) -> dict | None:
    """The newest checkpoint's metadata, after checking it belongs to this run's model and
    level (ValueError naming the differing key otherwise); None when there is none."""
    meta = self.manager.metadata()
    if meta is not None:
      self._check_same_run(meta)
    return meta

  def reload_after_skips(self, state, step: int, limit: int):
    """`state` replaced by the newest checkpoint's model, FP8 and optimizer state, its step
    count set to `step` + 1 (the run continues after optimizer step `step` with the next
    batches; the bad ones are not replayed). Returns (state, the checkpoint's step);
    RuntimeError when there is no checkpoint to go back to."""
    restored = self.restore(state)
    if restored is None:
      raise RuntimeError(f"{limit} consecutive steps had non-finite loss or gradients (last: "
                         f"step {step}) and there is no checkpoint to reload; enable "
                         "checkpoint.checkpoint_every_n_steps or lower the learning rate")
    now = jax.device_put(jnp.asarray(step + 1, jnp.int32), restored.state.step.sharding)
    return restored.state._replace(step=now), restored.step

  def restore(self, state, shardings=None) -> checkpoint_lib.Restored | None:
    """The newest good checkpoint restored like `state` onto `shardings` (default: the
    state's own); None when there is none."""
    return self.manager.restore(state, shardings)

  def _check_same_run(self, meta: dict) -> None:
    """Refuses a checkpoint of another model or level (its state would not fit). How the
    model computes (:data:`COMPUTE_KEYS`: attention, remat, layer loop, compute dtype) may
    differ, e.g. "auto" settings resolved on another device kind."""
    saved = meta.get("config", {})
    mine = config_to_dict(self.config)
    ignored = COMPUTE_KEYS | ({"fp8_head"} if not _fp8_head_has_state(self.config) else set())
    for section, key in [("model", k) for k in mine["model"] if k not in ignored] + [
        ("train", "opt_level")]:
      old = saved.get(section, {}).get(key, BEFORE_THE_KEY.get(key, mine[section][key]))
      if old != mine[section][key]:
        raise ValueError(
            f"{section}.{key}={mine[section][key]!r} but the checkpoints in "
            f"{self.directory} were written with {section}.{key}={old!r}; use "
            f"the same value to resume, or another checkpoint.dir / auto_resume: false")


def _fp8_head_has_state(config) -> bool:
  """Whether ``model.fp8_head`` changes the state a run of `config` holds: a built-in family's
  untied LM head at a level with FP8 GEMMs (its FP8 meta)."""
  model = config.model.model_config()
  return model is not None and not model.tie_embeddings and config.level().fp8_gemms


# Model keys added after checkpoints were written without them: the value those runs had.
BEFORE_THE_KEY = {"fp8_head": True}  # the LM head ran in FP8 (it has FP8 state)
# Model keys that change how the step computes, not the state a checkpoint holds.
COMPUTE_KEYS = frozenset({"attention_impl", "remat", "remat_policy", "remat_save_fp8_weights",
                          "scan_layers", "fuse_gelu_into_fp8_cast", "dtype"})


def records_of(meta: dict) -> RunRecords:
  """The :class:`RunRecords` saved in checkpoint metadata `meta`."""
  return RunRecords(meta["data"], int(meta.get("skipped_steps", 0)), saved_fallback(meta),
                    meta.get("corpus"))


__all__ = ["RunCheckpoints", "RunDirInUse", "RunRecords", "check_same_data", "checkpoint_dir",
           "claim_run_dir", "corpus_record", "earlier_run", "records_of", "saved_fallback",
           "stopped_line"]
