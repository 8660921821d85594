"""Training configuration: YAML files <-> validated, frozen dataclasses.

A config file has up to seven sections (``model``, ``data``, ``train``, ``fp8``, ``parallel``,
``checkpoint``, ``runtime``); every key has a default, so a file only names what it changes.
``configs/base.yaml`` lists every key with its default and what it does (a test keeps it equal
to these dataclasses). The ``model`` and ``fp8`` sections are derived from the objects they
configure (``fp8jax.models.gpt.ModelConfig``, ``fp8jax.Recipe``): one key per field, same name,
type and default unless the config says otherwise, checked by building that object. What
depends on the optimization level is asked of its ``fp8jax.OptLevel``, never of its name.
Every value is checked when a section is built: unknown keys (with the closest known key
suggested), wrong types (a bool is not an int; an int is accepted for a float), out-of-range
values and impossible combinations raise ``ValueError`` naming the key path, the value and what
is allowed. Knobs whose feature is not built yet are refused by the :data:`NOT_BUILT_YET` table.

YAML is read with PyYAML's safe loader, extended in two ways: ``1e-4`` is a float (YAML 1.2; the
1.1 resolver would read a string) and a key given twice in one mapping is an error.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import re
import types
import typing
from typing import Any, Callable, Iterable

import numpy as np
import yaml

from fp8jax.data import BYTE_VOCAB
from fp8jax.interop import hf
from fp8jax.models.family import FAMILIES, family as model_family
from fp8jax.models.gpt import ModelConfig
from fp8jax.parallel import layout_rules
from fp8jax.parallel.combine import WITHOUT_XLA_MEANING
from fp8jax.parallel.layout_rules import Layout
from fp8jax.recipe import LEVELS, OptLevel, Recipe, format_name, opt_level

# Features that are not built yet: (key path, values that work now, what the other values need).
# A value outside the second column is refused. Remove the line when the feature lands.
NOT_BUILT_YET = (
    ("model.dropout_rate", (0.0, 0), "dropout RNG plumbing in the train step"),
)

GRAD_COMM_GROWTH_INTERVAL = 1000  # FP8-LM: clean steps before the comm pre-scale doubles


# ----------------------------------------------------------------------------- value rules

@dataclasses.dataclass(frozen=True)
class _Rule:
  """A range/choice check on one value and the words for what it allows."""
  ok: Callable[[Any], bool]
  allowed: str


def _ge(lo) -> _Rule:
  return _Rule(lambda v: v >= lo, f"a value >= {lo}")


def _gt(lo) -> _Rule:
  return _Rule(lambda v: v > lo, f"a value > {lo}")


def _between(lo, hi, *, hi_open=False, lo_open=False) -> _Rule:
  """lo <= v <= hi, either end open on request."""
  def ok(v):
    return (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
  return _Rule(ok, f"a number in {'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}")


def _one_of(*values) -> _Rule:
  return _Rule(lambda v: v in values, f"one of {list(values)}")


_NAME = _Rule(lambda v: re.fullmatch(r"[A-Za-z0-9._-]+", v) is not None,
              "a name of letters, digits, '.', '_' or '-'")
_NONEMPTY = _Rule(lambda v: v.strip() != "", "a non-empty string")


def _field(default=dataclasses.MISSING, rule: _Rule | None = None):
  """A dataclass field carrying its value rule (checked when not None)."""
  return dataclasses.field(default=default, metadata={"rule": rule})


# ----------------------------------------------------------------------------- checking

def _join(path: str, key: Any) -> str:
  return f"{path}.{key}" if path else str(key)


def _short(value: Any, limit: int = 80) -> str:
  """repr(value), cut to `limit` characters."""
  text = repr(value)
  return text if len(text) <= limit else text[:limit - 3] + "..."


_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               dict: "a mapping", type(None): "null"}


def _describe(tp) -> str:
  """Words for one allowed type (a section, or a key of _TYPE_WORDS)."""
  if dataclasses.is_dataclass(tp):
    return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
  return _TYPE_WORDS[tp]


def _options(tp) -> tuple:
  """The members of a union annotation, or (tp,)."""
  if typing.get_origin(tp) in (typing.Union, types.UnionType):
    return typing.get_args(tp)
  return (tp,)


def _coerce(path: str, value: Any, tp) -> tuple[bool, Any]:
  """(True, value as `tp`) when `value` is acceptable as `tp`, else (False, None)."""
  if tp is type(None):
    return value is None, None
  if tp is float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return False, None
    if not math.isfinite(value):
      raise ValueError(f"{path}={value!r} is not allowed; use a finite number")
    return True, float(value)
  if tp is int:
    return isinstance(value, int) and not isinstance(value, bool), value
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):
      return True, value
    return (True, _from_dict(tp, value)) if isinstance(value, dict) else (False, None)
  return isinstance(value, tp), value


def _check_type(path: str, value: Any, annotation) -> Any:
  """`value` converted to the annotated type, or a ValueError naming what is allowed."""
  options = _options(annotation)
  for tp in options:
    ok, converted = _coerce(path, value, tp)
    if ok:
      return converted
  expected = " or ".join(_describe(tp) for tp in options)
  raise ValueError(f"{path}={_short(value)} has type {type(value).__name__}; expected {expected}")


@functools.cache
def _hints(cls) -> dict:
  return typing.get_type_hints(cls)


def _check_fields(obj) -> None:
  """Type-checks (and converts) every field of `obj`, then applies its value rule."""
  for f in dataclasses.fields(obj):
    path = _join(obj._path, f.name)
    value = _check_type(path, getattr(obj, f.name), _hints(type(obj))[f.name])
    object.__setattr__(obj, f.name, value)
    rule = f.metadata.get("rule")
    if rule is not None and value is not None and not rule.ok(value):
      raise ValueError(f"{path}={_short(value)} is not allowed; use {rule.allowed}")


def _unknown_key(path: str, key: Any, value: Any, known: list[str]) -> ValueError:
  """The error for a key that `path` does not have, with the closest known key."""
  if path == "parallel" and key in WITHOUT_XLA_MEANING:
    return ValueError(f"parallel.{key}={_short(value)} is a DeepSpeed knob with no meaning "
                      f"here: {WITHOUT_XLA_MEANING[key]}; remove it")
  close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
  hint = f"; did you mean {close[0]!r}?" if close else ";"
  where = path or "the config"
  return ValueError(f"{_join(path, key)}={_short(value)} is not a known key{hint} "
                    f"keys of {where}: {', '.join(known)}")


def _from_dict(cls, data: Any):
  """Builds section `cls` from a mapping (None: all defaults), refusing unknown keys."""
  fields = dataclasses.fields(cls)
  known = [f.name for f in fields]
  data = {} if data is None else data
  if not isinstance(data, dict):
    raise ValueError(f"{cls._path or 'config'}={_short(data)} is not allowed; "
                     f"use a mapping with keys {', '.join(known)}")
  for key, value in data.items():
    if key not in known:
      raise _unknown_key(cls._path, key, value, known)
  required = [f.name for f in fields
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
  for name in required:
    if name not in data:
      raise ValueError(f"{_join(cls._path, name)} is missing; {cls._path} needs "
                       f"{', '.join(required)}")
  return cls(**data)


class _Section:
  """Validates on construction: field types and rules, then the section's own `_check`."""
  _path = ""

  def __post_init__(self):
    _check_fields(self)
    self._check()

  def _check(self) -> None:
    """Checks that involve several fields (none by default)."""


def _fail(message: str) -> None:
  raise ValueError(message)


def _levels(test: Callable[[OptLevel], bool]) -> str:
  """The names of the levels passing `test`, as words: "O2", "O1, O2 or O3"."""
  names = [name for name, level in LEVELS.items() if test(level)]
  return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


# ----------------------------------------------------------------------------- derived sections

class _Mirror(_Section):
  """A section made by :func:`_mirror`: the fields of `_target` (names in `_mirrored`), checked
  by building a `_target` from them, plus any keys of the section's own."""
  _target = None
  _mirrored = ()

  def _check(self):
    self._build()

  def _build(self):
    """The `_target` these fields describe; its ValueError reworded with key paths."""
    values = {name: getattr(self, name) for name in self._mirrored}
    try:
      return self._target(**values)
    except ValueError as e:
      raise ValueError(_reworded(str(e), self._target.__name__, self._path, values)) from None


def _reworded(message: str, target: str, path: str, values: dict) -> str:
  """`target`'s error message in config words: "ModelConfig.d_model=130 ... n_heads=4" becomes
  "model.d_model=130 ... model.n_heads=4"; a message about the whole object starts "model:",
  and keys it names without their value get it appended, e.g. "(model.d_model=132)"."""
  message = message.replace(f"{target}.", f"{path}.")
  names = "|".join(map(re.escape, values))
  message = re.sub(rf"(?<![\w./])({names})=", rf"{path}.\1=", message)
  message = re.sub(rf"^{re.escape(target)}\b:? ?", f"{path}: ", message)
  bare = [name for name in values
          if re.search(rf"\b{re.escape(name)}\b", message) and f"{path}.{name}=" not in message]
  if bare:
    message += f" ({', '.join(f'{path}.{name}={values[name]!r}' for name in bare)})"
  return message


def _mirror(target, path: str, *, skip=(), by_name=None, defaults=None, rules=None):
  """A frozen section base class with one key per field of dataclass `target` (same name,
  order, type and default), so that a field added to `target` is a config key with no edit
  here. The section checks its values by building a `target` (:class:`_Mirror`).

  Args:
    skip: fields of `target` that are not config keys.
    by_name: {field: function}: fields given by name in YAML (a string); the function names
      `target`'s default (e.g. an FP8 dtype -> "e4m3").
    defaults: {field: value}: config defaults that differ from `target`'s.
    rules: {field: _Rule}: value rules the config adds to `target`'s own checks.
  """
  by_name, defaults, rules = by_name or {}, defaults or {}, rules or {}
  hints = typing.get_type_hints(target)
  fields = []
  for f in dataclasses.fields(target):
    if f.name in skip:
      continue
    if f.default is dataclasses.MISSING:
      raise TypeError(f"{target.__name__}.{f.name} has no plain default; a config key needs one")
    tp, default = hints[f.name], f.default
    if f.name in by_name:
      tp, default = str, by_name[f.name](default)
    if any(option not in _TYPE_WORDS for option in _options(tp)):
      raise TypeError(f"{target.__name__}.{f.name}: {tp} is not a YAML type "
                      f"({', '.join(t.__name__ for t in _TYPE_WORDS)}); give it `by_name`")
    fields.append((f.name, tp, _field(defaults.get(f.name, default), rules.get(f.name))))
  unknown = (set(by_name) | set(defaults) | set(rules)) - {name for name, _, _ in fields}
  if unknown:
    raise TypeError(f"{target.__name__} has no config field {sorted(unknown)}")
  return dataclasses.make_dataclass(
      f"_{target.__name__}Keys", fields, bases=(_Mirror,), frozen=True,
      namespace={"__module__": __name__, "_path": path, "_target": target,
                 "_mirrored": tuple(name for name, _, _ in fields)})


# ----------------------------------------------------------------------------- sections

@dataclasses.dataclass(frozen=True)
class ModelSection(_mirror(
    ModelConfig, "model",
    # The config's default run is the tiny CPU one (configs/tiny.yaml): 128 wide, 128 tokens.
    defaults={"d_model": 128, "d_ff": 512, "max_seq_len": 128},
    # Training has no loss scaling, which float16 activations would need.
    rules={"dtype": _one_of("bfloat16", "float32")})):
  """The model: a built-in family (``family``: "gpt", ``fp8jax.models.gpt.ModelConfig``'s
  keys, or "llama", ``fp8jax.models.llama.LlamaConfig``'s: the shared keys plus n_kv_heads,
  norm_eps, rope_scaling), optionally initialised from a Hugging Face checkpoint
  (``init_from: hf:DIR``: the shape is the checkpoint's), or a user's module from ``builder``
  ("package.module:function", called with ``builder_args``; see ``fp8jax.train.model``).
  Checked by the family's config class itself."""
  family: str = _field("gpt", _one_of(*tuple(FAMILIES)))
  n_kv_heads: int | None = _field(None, _ge(1))
  norm_eps: float = _field(1e-5, _gt(0))
  rope_scaling: dict | None = None
  init_from: str | None = _field(None, _Rule(lambda v: v.startswith("hf:") and len(v) > 3,
                                             "'hf:' followed by a checkpoint directory"))
  builder: str | None = _field(None, _Rule(
      lambda v: re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", v) is not None,
      "'package.module:function'"))
  builder_args: dict | None = None

  def _check(self):
    if self.builder is not None:
      if self.init_from is not None:
        _fail(f"model.init_from={self.init_from!r} is not allowed with model.builder (a "
              "builder makes its own parameters); drop one of them")
      return
    self.model_config()

  def _set_keys(self, names) -> list[str]:
    """The keys among `names` set to something other than their default."""
    defaults = {f.name: f.default for f in dataclasses.fields(self)}
    return [n for n in names if getattr(self, n) != defaults[n]]

  def model_config(self):
    """The family's config these settings describe (``ModelConfig`` or ``LlamaConfig``);
    with ``init_from`` the checkpoint's, with the settings that may differ applied. None
    with ``builder``."""
    if self.builder is not None:
      return None
    if self.init_from is not None:
      return self._checkpoint_config()
    if self.family == "gpt":
      foreign = self._set_keys(_LLAMA_ONLY)
      if foreign:
        _fail(f"model.{foreign[0]}={getattr(self, foreign[0])!r} is a key of model.family "
              f"llama, not of {self.family!r}; remove it or set model.family=llama")
      return self._build()
    return self._llama_config()

  def _llama_config(self):
    foreign = [n for n in self._set_keys(_GPT_ONLY) if getattr(self, n) != _LLAMA_FIXED.get(n)]
    if foreign:
      _fail(f"model.{foreign[0]}={getattr(self, foreign[0])!r} is not a key of model.family "
            f"llama (LLaMA: {', '.join(f'{k} {v}' for k, v in _LLAMA_FIXED.items())}); "
            "remove it")
    cls = model_family("llama").config_cls
    names = [f.name for f in dataclasses.fields(cls)]
    values = {n: getattr(self, n) for n in names if hasattr(self, n)}
    if values["n_kv_heads"] is None:
      values["n_kv_heads"] = self.n_heads
    try:
      return cls(**values)
    except ValueError as e:
      raise ValueError(_reworded(str(e), cls.__name__, self._path, values)) from None

  def _checkpoint_config(self):
    """The config of ``init_from``'s checkpoint; the settings of ``hf.LOAD_OVERRIDES`` this
    section sets apply, any other shape key set here must equal the checkpoint's."""
    if self.family != "llama":
      _fail(f"model.init_from={self.init_from!r} reads a LLaMA checkpoint; set "
            f"model.family=llama (got {self.family!r})")
    path = self.init_from[len("hf:"):]
    overrides = {k: getattr(self, k) for k in self._set_keys(hf.LOAD_OVERRIDES)}
    try:
      loaded = hf.load_config(path, **overrides)
    except (OSError, ValueError) as e:
      _fail(f"model.init_from={self.init_from!r}: {e}")
    for name in self._set_keys(n for n in self._mirrored + _LLAMA_ONLY
                               if n not in hf.LOAD_OVERRIDES and hasattr(loaded, n)):
      if getattr(loaded, name) != getattr(self, name):
        _fail(f"model.{name}={getattr(self, name)!r} differs from the checkpoint's "
              f"{getattr(loaded, name)!r} (model.init_from={self.init_from!r}); remove it")
    return loaded


_LLAMA_ONLY = ("n_kv_heads", "norm_eps", "rope_scaling")
_GPT_ONLY = ("mlp", "norm", "fuse_gelu_into_fp8_cast")
_LLAMA_FIXED = {"mlp": "swiglu", "norm": "rmsnorm"}  # what LLaMA's blocks always are


@dataclasses.dataclass(frozen=True)
class DataSection(_Section):
  """Token source: "stdlib" (this Python's standard library source), "site-packages" (the
  installed packages' source) or a path or glob of text files, as bytes or encoded by
  `tokenizer` (once, cached under `cache_dir`), or a path to a pre-tokenized ``.bin`` token
  file (see ``fp8jax.data``)."""
  _path = "data"
  source: str = _field("stdlib", _NONEMPTY)
  tokenizer: str | None = _field(None, _NONEMPTY)
  cache_dir: str | None = _field(None, _NONEMPTY)
  seq_len: int = _field(128, _ge(1))
  val_fraction: float = _field(0.05, _between(0, 1, lo_open=True, hi_open=True))
  max_bytes: int = _field(32 * 2**20, _ge(1))
  seed: int = _field(0, _ge(0))

  @property
  def is_bin(self) -> bool:
    """True when the source is a pre-tokenized ``.bin`` token file."""
    return self.source.endswith(".bin")

  @property
  def byte_level(self) -> bool:
    """True when tokens are bytes of text (a text source without a tokenizer)."""
    return not self.is_bin and self.tokenizer is None

  def _check(self):
    if self.is_bin and self.tokenizer is not None:
      _fail(f"data.tokenizer={self.tokenizer!r} is not allowed with data.source={self.source!r}: "
            "a .bin holds token ids already; use data.tokenizer: null")


@dataclasses.dataclass(frozen=True)
class BatchRamp(_Section):
  """Batch-size warm-up in tokens per optimizer step (Megatron's ``--rampup-batch-size``):
  `start_tokens` at step 0 growing linearly to `end_tokens` (the configured batch) over
  `ramp_steps` steps or over `ramp_tokens` tokens seen (give one), rounded down to whole
  microbatches (:meth:`Config.microbatches_at`). `lr_follows`: the learning-rate schedule's
  clock, "steps" or "tokens" (tokens seen / tokens of a full step, so warmup and decay keep
  their token budgets while the batch grows)."""
  _path = "train.batch_ramp"
  start_tokens: int = _field(rule=_ge(1))
  end_tokens: int = _field(rule=_ge(1))
  ramp_steps: int | None = _field(None, _ge(1))
  ramp_tokens: int | None = _field(None, _ge(1))
  lr_follows: str = _field("steps", _one_of("steps", "tokens"))

  def _check(self):
    if self.start_tokens > self.end_tokens:
      _fail(f"train.batch_ramp.start_tokens={self.start_tokens} is larger than "
            f"train.batch_ramp.end_tokens={self.end_tokens}; use start_tokens <= end_tokens")
    if (self.ramp_steps is None) == (self.ramp_tokens is None):
      _fail(f"train.batch_ramp needs exactly one of ramp_steps (steps to reach end_tokens) and "
            f"ramp_tokens (tokens seen to reach it); got ramp_steps={self.ramp_steps}, "
            f"ramp_tokens={self.ramp_tokens}")

  def tokens_at(self, step: int, seen: int) -> int:
    """Tokens per step for 0-based `step` after `seen` tokens, before rounding."""
    if self.ramp_steps is not None:
      done, whole = min(max(step, 0), self.ramp_steps), self.ramp_steps
    else:
      done, whole = min(seen, self.ramp_tokens), self.ramp_tokens
    return self.start_tokens + (self.end_tokens - self.start_tokens) * done // whole


@functools.cache
def _ramp_microbatches(ramp: BatchRamp, quantum: int, steps: int) -> np.ndarray:
  """int64[steps]: microbatches of each step 0..steps-1 of `ramp`, rounded down to whole
  microbatches of `quantum` tokens."""
  counts, seen = np.empty(steps, np.int64), 0
  for step in range(steps):
    counts[step] = ramp.tokens_at(step, seen) // quantum
    seen += int(counts[step]) * quantum
  counts.setflags(write=False)
  return counts


@dataclasses.dataclass(frozen=True)
class TrainSection(_Section):
  """Optimization: level, steps, batch (sequences per optimizer step, split into
  `microbatches`), AdamW with linear warmup then cosine decay to `min_lr_ratio` x peak."""
  _path = "train"
  opt_level: str = _field("O1", _one_of(*LEVELS))  # fp8jax.LEVELS
  steps: int = _field(200, _ge(1))
  batch_size: int = _field(16, _ge(1))
  microbatches: int = _field(1, _ge(1))
  learning_rate: float = _field(1e-4, _gt(0))
  warmup_steps: int = _field(0, _ge(0))
  min_lr_ratio: float = _field(0.1, _between(0, 1))
  weight_decay: float = _field(0.1, _ge(0))
  b1: float = _field(0.9, _between(0, 1, hi_open=True))
  b2: float = _field(0.95, _between(0, 1, hi_open=True))
  eps: float = _field(1e-8, _gt(0))
  gradient_clipping: float = _field(1.0, _ge(0))  # global-norm bound; 0 disables
  batch_ramp: BatchRamp | None = None
  eval_every: int = _field(50, _ge(0))  # 0 disables validation
  eval_batches: int = _field(8, _ge(1))
  log_every: int = _field(10, _ge(1))
  fp8_health_every: int = _field(50, _ge(0))  # FP8 cast-health probe; 0 disables
  seed: int = _field(0, _ge(0))
  # The AdamW + FP16-master update as one kernel per tensor on one device, at the levels
  # whose OptLevel.fused_update is true (O2) (fp8jax.optim.fused; benchmarks/RESULTS.md
  # "Optimizer update"). auto: on for such runs on one GPU, off elsewhere; true refuses runs it
  # cannot serve.
  fused_optimizer: bool | str = _field("auto", _Rule(
      lambda v: isinstance(v, bool) or v == "auto", "true, false or 'auto'"))

  def _check(self):
    if self.fused_optimizer is True and not self.level.fused_update:
      fused = _levels(lambda level: level.fused_update)
      _fail(f"train.fused_optimizer=True needs FP16 master weights on one device, i.e. "
            f"train.opt_level {fused}, not {self.opt_level!r}; use {fused} or "
            f"fused_optimizer false")

  @property
  def level(self) -> OptLevel:
    """The ``fp8jax.OptLevel`` named by `opt_level` (with the library's recipe;
    :meth:`Config.level` has the configured one)."""
    return opt_level(self.opt_level)

  @property
  def microbatch_size(self) -> int:
    """Sequences per microbatch (fixed for the whole run, ramp or not)."""
    return self.batch_size // self.microbatches

  @property
  def warmup_in_run(self) -> int:
    """Warmup steps the schedule runs: `warmup_steps`, at most ``steps - 1`` (a warmup longer
    than the run is clamped to it, see :meth:`Config.notices`)."""
    return min(self.warmup_steps, self.steps - 1)


@dataclasses.dataclass(frozen=True)
class Fp8Section(_mirror(
    Recipe, "fp8", skip=("calibrated",),  # the Trainer's, from `calibrate` below
    by_name={"fwd_format": format_name, "bwd_format": format_name},
    # On in training (Recipe's default is off): the kernel runs where it can (one GPU, native
    # FP8), XLA casts elsewhere, same values.
    defaults={"fused_cast_transpose": True})):
  """FP8 recipe of the GEMMs (levels with FP8 GEMMs; O0 ignores it): one key per field of
  ``fp8jax.Recipe`` but `calibrated`, checked by ``Recipe`` itself, plus the Trainer's
  `calibrate` and `cast_weights_once`."""
  # The Trainer's first step casts never-observed FP8 states just in time; later steps use
  # Recipe(calibrated=True) (each amax fused into its cast). auto: when FP8 GEMMs are native.
  calibrate: str = _field("auto", _one_of("auto", "always", "never"))
  # With train.microbatches > 1: each FP8 GEMM's weight is cast (and amax-reduced) once per
  # optimizer step for all microbatches instead of once per microbatch (ZeRO stages 0-2,
  # not with device_map / FP8 gradient communication). Bit-identical either way.
  cast_weights_once: bool = True

  def recipe(self) -> Recipe:
    """The ``fp8jax.Recipe`` these settings describe (uncalibrated: see ``calibrate``)."""
    return self._build()


_MESH_SIZE = _Rule(lambda v: v == -1 or v >= 1, "an integer >= 1, or -1 (fill the devices)")


@dataclasses.dataclass(frozen=True)
class ParallelSection(_Section):
  """Sharding and parallelism (DeepSpeed's names; ``fp8jax.parallel``). Mesh axes pipe x
  data x fsdp x tensor (one of data, fsdp, tensor may be -1: the devices left;
  `pipeline_parallel_size` stages split the layers, ``fp8jax.parallel.pipeline``); ZeRO stage
  0..3 (a level may raise it: :meth:`Config.zero_stage`); `offload_optimizer` keeps the
  optimizer state in host memory (needs a stage)."""
  _path = "parallel"
  zero_stage: int = _field(0, _one_of(0, 1, 2, 3))
  offload_optimizer: bool = False
  data_parallel_size: int = _field(-1, _MESH_SIZE)
  fsdp_size: int = _field(1, _MESH_SIZE)
  reduce_bucket_size: int | None = _field(None, _ge(1))  # bytes: XLA combine thresholds
  allgather_bucket_size: int | None = _field(None, _ge(1))  # bytes (fp8jax.parallel.combine)
  tensor_parallel_size: int = _field(1, _ge(1))
  pipeline_parallel_size: int = _field(1, _ge(1))
  # GPipe (k inputs kept per stage) or lockstep 1F1B (2P-1 kept, larger bubble)
  pipeline_schedule: str = _field("gpipe", _one_of("gpipe", "1f1b"))
  device_map: dict | str | None = None  # kind -> throughput / profile: balanced microbatches
  # The kind of each device by index ("4xA100+4xH100" or a list): a mixed cluster rehearsed on
  # identical devices (e.g. 8 CPU devices); the balancer reads these kinds (needs device_map).
  device_kinds: str | list | None = None
  fp8_capability: str = _field("per_kind", _one_of("per_kind", "uniform"))
  # Gradient reduction between data-parallel ranks: "fp8" (FP8 reduce-scatter in a shard_map
  # step, fp8jax.train.balanced), "native" (XLA reduces in the gradients' dtype), "auto" (=
  # native for now; see Config.grad_comm).
  grad_comm: str = _field("auto", _one_of("auto", "fp8", "native"))
  # Scale of the FP8 gradient wire: "current" (this step's amax, nothing saturates) or "auto"
  # (FP8-LM automatic scaling: previous amax / pre-scale, the pre-scale halved above 0.001%
  # saturated values and doubled after `grad_comm_growth_interval` clean steps, default 1000;
  # the state is part of the train state and its checkpoints).
  grad_comm_scaling: str = _field("current", _one_of("current", "auto"))
  grad_comm_growth_interval: int | None = _field(None, _ge(1))

  def _check(self):
    from fp8jax.parallel import device_map
    try:
      device_map.check(self.device_map)
      if self.device_kinds is not None:
        device_map.parse_kinds(self.device_kinds)
    except ValueError as e:
      _fail(str(e))
    if self.device_kinds is not None and self.device_map is None:
      _fail("parallel.device_kinds only tells the balancer each device's kind; it needs "
            "parallel.device_map (kind -> throughput), e.g. {A100: 0.45, H100: 1.0}")
    fill = [n for n in ("data_parallel_size", "fsdp_size") if getattr(self, n) == -1]
    if len(fill) > 1:
      _fail(f"parallel.{fill[0]}=-1 and parallel.{fill[1]}=-1 are not allowed together; "
            f"at most one mesh size may be -1 (fill)")


@dataclasses.dataclass(frozen=True)
class CheckpointSection(_Section):
  """Checkpointing (``fp8jax.checkpoint``); `dir` None means ``<run dir>/checkpoints``.
  `keep` newest checkpoints are kept, plus every step that is a multiple of `keep_every`;
  `auto_resume` continues from the newest good checkpoint in `dir`."""
  _path = "checkpoint"
  dir: str | None = _field(None, _NONEMPTY)
  checkpoint_every_n_steps: int = _field(0, _ge(0))  # 0: no periodic checkpoints
  keep: int = _field(3, _ge(1))
  keep_every: int | None = _field(None, _ge(1))
  async_save: bool = True
  auto_resume: bool = False

  @property
  def enabled(self) -> bool:
    """True when the run saves or resumes checkpoints."""
    return self.checkpoint_every_n_steps > 0 or self.auto_resume


@dataclasses.dataclass(frozen=True)
class RuntimeSection(_Section):
  """Where a run writes (`run_dir` may use the placeholder ``{name}``) and its guards
  (``fp8jax.train.guards``): a step without progress for `heartbeat_interval` x
  `heartbeat_tolerance` seconds exits the process; `max_consecutive_skips` non-finite steps
  in a row reload the last checkpoint (0: never); every `divergence_check_every` steps (0:
  never) the FP8 loss is compared with BF16 GEMMs on the same batch and a relative gap above
  `divergence_threshold` switches the run to BF16 (O0) GEMMs. `compile_cache`: JAX's
  persistent compilation cache (``fp8jax.train.compiles``): "auto" (the folder
  ``JAX_COMPILATION_CACHE_DIR`` names, else ~/.cache/fp8jax/jax_cache), false (off), or a
  folder."""
  _path = "runtime"
  name: str = _field("run", _NAME)
  run_dir: str = _field("runs/{name}", _NONEMPTY)
  heartbeat_interval: float | None = _field(None, _gt(0))  # seconds
  heartbeat_tolerance: int = _field(3, _ge(1))
  max_consecutive_skips: int = _field(3, _ge(0))
  divergence_check_every: int = _field(0, _ge(0))
  divergence_threshold: float = _field(0.01, _gt(0))
  compile_cache: str | bool = _field("auto", _Rule(
      lambda v: isinstance(v, bool) or (isinstance(v, str) and v.strip() != ""),
      "'auto', false (off), true (auto) or a folder"))

  def _check(self):
    try:
      self.run_dir.format(name=self.name)
    except (KeyError, IndexError, ValueError):
      _fail(f"runtime.run_dir={self.run_dir!r} is not allowed; use a path whose only "
            f"placeholder is {{name}}")

  @property
  def run_path(self) -> str:
    """`run_dir` with ``{name}`` filled in."""
    return self.run_dir.format(name=self.name)


def _section(cls):
  return dataclasses.field(default_factory=cls)


@dataclasses.dataclass(frozen=True)
class Config(_Section):
  """A whole training config; built from YAML by :func:`load_config`."""
  _path = ""
  model: ModelSection = _section(ModelSection)
  data: DataSection = _section(DataSection)
  train: TrainSection = _section(TrainSection)
  fp8: Fp8Section = _section(Fp8Section)
  parallel: ParallelSection = _section(ParallelSection)
  checkpoint: CheckpointSection = _section(CheckpointSection)
  runtime: RuntimeSection = _section(RuntimeSection)

  def _check(self):
    self.check_layout()
    self._check_data_fits_model()
    self._check_offload()
    self._check_tensor_parallel()
    self._check_pipeline()
    self._check_grad_comm()
    self._check_fused_optimizer()
    self._check_rowwise()
    if self.train.batch_ramp is not None:
      self._check_ramp()
    _refuse_unbuilt(self)

  def _check_data_fits_model(self):
    model = self.model.model_config()
    if model is None:  # a builder's model: checked when it runs
      return
    if self.data.seq_len > model.max_seq_len:
      _fail(f"data.seq_len={self.data.seq_len} is larger than "
            f"model.max_seq_len={model.max_seq_len}; use seq_len <= max_seq_len")
    if self.data.byte_level and model.vocab_size < BYTE_VOCAB:
      _fail(f"model.vocab_size={model.vocab_size} is too small for byte-level text "
            f"(data.source={self.data.source!r}); use vocab_size >= {BYTE_VOCAB}")

  def zero_stage(self) -> int:
    """The ZeRO stage the run uses: parallel.zero_stage, at least the level's
    (``OptLevel.zero_stage_for``; O3: 1)."""
    return self.train.level.zero_stage_for(self.parallel.zero_stage)

  def layout(self, devices: int | None = None) -> Layout:
    """The run's layout numbers (``fp8jax.parallel.layout_rules``) on `devices` devices
    (None: not known yet)."""
    p, t = self.parallel, self.train
    model = self.model.model_config()
    return Layout(
        devices=devices, data=p.data_parallel_size, fsdp=p.fsdp_size,
        tensor=p.tensor_parallel_size, pipe=p.pipeline_parallel_size,
        batch_size=t.batch_size, microbatches=t.microbatches, zero_stage=self.zero_stage(),
        grad_comm=self.grad_comm(),
        balanced=p.device_map is not None,
        n_layers=None if model is None else model.n_layers,
        tensor_splits=() if model is None else model_family(self.model.family).tensor_splits(
            model))

  def check_layout(self, devices: int | None = None) -> None:
    """ValueError (one line naming the numbers) when the run's layout on `devices` devices
    breaks a rule of ``fp8jax.parallel.layout_rules``; with `devices` None only the rules
    the config decides by itself. Called when the config is built and again by the run
    once it knows its devices (``fp8jax.train.build.zero_plan``), before any compile."""
    message = layout_rules.check(self.layout(devices))
    if message is not None:
      _fail(message)

  def _check_tensor_parallel(self):
    tp = self.parallel.tensor_parallel_size
    if tp == 1:
      return
    if self.parallel.device_map is not None:
      _fail(f"parallel.tensor_parallel_size={tp} with parallel.device_map is not supported yet "
            "(the balanced step replicates the weights in each group); drop one of them")

  def _check_pipeline(self):
    """Pipeline stages (``fp8jax.parallel.pipeline``): the reference families only (layers
    and microbatches per stage: ``fp8jax.parallel.layout_rules``)."""
    pp = self.parallel.pipeline_parallel_size
    if pp == 1:
      return
    where = f"parallel.pipeline_parallel_size={pp}"
    if self.model.builder is not None:
      _fail(f"{where} with model.builder={self.model.builder!r} is not supported: the "
            f"pipeline cuts the model into embedding, layer stack and head, which only the "
            f"reference families ({', '.join(FAMILIES)}) expose; use pipeline_parallel_size 1")

  def grad_comm(self) -> str:
    """How the run reduces gradients: "fp8" or "native". "auto" resolves to "native" (the
    faster of the two where measured: benchmarks/README.md, ZeRO and FP8 gradient
    communication)."""
    return "fp8" if self.parallel.grad_comm == "fp8" else "native"

  def grad_comm_growth_interval(self) -> int:
    """Clean steps before automatic scaling doubles the pre-scale (default 1000, FP8-LM's)."""
    g = self.parallel.grad_comm_growth_interval
    return GRAD_COMM_GROWTH_INTERVAL if g is None else g

  def _check_grad_comm(self):
    p = self.parallel
    if p.grad_comm_scaling == "auto" and self.grad_comm() != "fp8":
      _fail(f"parallel.grad_comm_scaling='auto' needs FP8 gradient communication but "
            f"parallel.grad_comm={p.grad_comm!r} (= native); set parallel.grad_comm=fp8, or "
            f"parallel.grad_comm_scaling 'current'")
    if p.grad_comm_growth_interval is not None and p.grad_comm_scaling != "auto":
      _fail(f"parallel.grad_comm_growth_interval={p.grad_comm_growth_interval} only applies "
            f"to parallel.grad_comm_scaling='auto' (this config has "
            f"{p.grad_comm_scaling!r}); set grad_comm_scaling=auto or remove it")
    if p.grad_comm != "fp8":
      return
    if (p.grad_comm_scaling == "auto" and self.zero_stage() == 3
        and self.model.builder is None):
      _fail("parallel.grad_comm_scaling='auto' is not supported at ZeRO-3: the per-group "
            "loop runs layer-major there and reduces each layer's gradients inside the "
            "backward layer scan, where the automatic scaling state (one pre-scale per "
            "leaf, updated after the step) does not flow; use grad_comm_scaling 'current' "
            "(this step's amax: nothing saturates) or zero_stage <= 2")
    why = None
    if not self.train.level.fp8_gemms:
      why = (f"train.opt_level={self.train.opt_level} (BF16 GEMMs: the baseline communicates "
             f"in its own dtype); use level {_levels(lambda level: level.fp8_gemms)}")
    elif p.tensor_parallel_size != 1:
      why = (f"parallel.tensor_parallel_size={p.tensor_parallel_size} (the FP8 gradient step "
             f"replicates the weights in each data-parallel group); use 1")
    elif p.offload_optimizer:
      why = ("parallel.offload_optimizer=True (the FP8 gradient step keeps the optimizer "
             "state on the devices); use false")
    if why is not None:
      _fail(f"parallel.grad_comm='fp8' is not supported with {why}, or "
            f"parallel.grad_comm 'native' / 'auto'")

  def _check_fused_optimizer(self):
    p = self.parallel
    if self.train.fused_optimizer is not True:
      return
    for key, value, ok in (("zero_stage", p.zero_stage, 0), ("offload_optimizer",
                            p.offload_optimizer, False), ("device_map", p.device_map, None),
                           ("grad_comm", self.grad_comm(), "native"),
                           ("tensor_parallel_size", p.tensor_parallel_size, 1),
                           ("pipeline_parallel_size", p.pipeline_parallel_size, 1)):
      if value != ok:
        _fail(f"train.fused_optimizer=True runs on unsharded arrays (one device); "
              f"parallel.{key}={value!r} is not allowed with it; use {ok!r} or "
              f"train.fused_optimizer false")

  def _check_rowwise(self):
    """Row-wise scaling (fp8.granularity=rowwise) at a level with FP8 GEMMs: not with ZeRO-3
    (its weights are gathered as tensor-scaled FP8) nor with fp8.calibrate=always (row-wise
    scales are current: there is nothing to calibrate)."""
    if self.fp8.granularity != "rowwise" or not self.train.level.fp8_gemms:
      return
    if self.zero_stage() == 3:
      _fail("fp8.granularity='rowwise' is not supported with parallel.zero_stage=3 (ZeRO-3 "
            "gathers each weight as one tensor-scaled FP8 cast); use zero_stage <= 2 or "
            "fp8.granularity 'tensor'")
    if self.fp8.calibrate == "always":
      _fail("fp8.calibrate='always' does not apply to fp8.granularity='rowwise' (every row "
            "is scaled by its own current amax: nothing to calibrate); use calibrate auto or "
            "never")

  def _check_offload(self):
    if self.parallel.offload_optimizer and self.parallel.device_map is not None:
      _fail("parallel.offload_optimizer=True with parallel.device_map is not supported yet "
            "(the balanced step keeps the optimizer state on the devices); drop one of them")
    if self.parallel.offload_optimizer and self.zero_stage() == 0:
      _fail("parallel.offload_optimizer=True is not allowed with parallel.zero_stage=0 at "
            f"train.opt_level={self.train.opt_level}; use zero_stage 1, 2 or 3 (or level "
            f"{_levels(lambda level: level.zero_stage > 0)})")

  def _check_ramp(self):
    """Ramp rule: the microbatch shape is fixed (train.batch_size / train.microbatches
    sequences); the ramp changes how many microbatches a step has. So both ends are multiples
    of the microbatch's tokens, and the ramp ends at the configured batch."""
    ramp, end = self.train.batch_ramp, self.train.batch_size * self.data.seq_len
    if ramp.end_tokens != end:
      _fail(f"train.batch_ramp.end_tokens={ramp.end_tokens} is not allowed; the ramp ends at "
            f"the configured batch: train.batch_size={self.train.batch_size} x "
            f"data.seq_len={self.data.seq_len} = {end} tokens")
    quantum = self._microbatch_tokens
    if ramp.start_tokens % quantum:
      _fail(f"train.batch_ramp.start_tokens={ramp.start_tokens} is not a multiple of {quantum} "
            f"tokens, one microbatch (train.batch_size / train.microbatches = "
            f"{self.train.microbatch_size} sequences x data.seq_len={self.data.seq_len}); the "
            f"ramp adds whole microbatches")

  @property
  def _microbatch_tokens(self) -> int:
    return self.train.microbatch_size * self.data.seq_len

  def microbatches_at(self, step: int) -> int:
    """Microbatches in optimizer step `step` (0-based). Without a ramp: train.microbatches.
    With one: tokens grow linearly from start_tokens (step 0) to end_tokens (after
    ramp_steps steps or ramp_tokens tokens seen), rounded down to whole microbatches."""
    ramp, steps = self.train.batch_ramp, self.train.steps
    if ramp is None or step >= steps:
      return self.train.microbatches
    return int(_ramp_microbatches(ramp, self._microbatch_tokens, steps)[max(step, 0)])

  def batch_size_at(self, step: int) -> int:
    """Sequences in optimizer step `step` (0-based); see :meth:`microbatches_at`."""
    return self.microbatches_at(step) * self.train.microbatch_size

  def tokens_seen(self, step: int) -> int:
    """Training tokens in steps 0..step-1."""
    ramp, steps, full = self.train.batch_ramp, self.train.steps, self._microbatch_tokens
    if ramp is None:
      return max(step, 0) * self.train.microbatches * full
    counts = _ramp_microbatches(ramp, full, steps)
    past = max(step - steps, 0) * self.train.microbatches
    return (int(np.sum(counts[:min(max(step, 0), steps)])) + past) * full

  def notices(self) -> list[str]:
    """One line per value the run adjusts instead of refusing (for the start-of-run log):
    a train.warmup_steps longer than the run is clamped to it."""
    t = self.train
    out = []
    if t.warmup_steps > t.steps:
      out.append(f"train.warmup_steps={t.warmup_steps} is longer than the run "
                 f"(train.steps={t.steps}); warmup clamped to {t.warmup_in_run} steps")
    return out

  def level(self) -> OptLevel:
    """The ``fp8jax`` opt level of train.opt_level, its recipe taken from the fp8 section."""
    lvl = self.train.level
    return dataclasses.replace(lvl, recipe=self.fp8.recipe()) if lvl.fp8_gemms else lvl


def _get(cfg: Config, path: str) -> Any:
  value = cfg
  for key in path.split("."):
    value = getattr(value, key)
  return value


def _refuse_unbuilt(cfg: Config) -> None:
  """Raises for the first knob of NOT_BUILT_YET set to a value that does not work yet."""
  for path, works_now, needs in NOT_BUILT_YET:
    value = _get(cfg, path)
    if not any(value == ok and type(value) is type(ok) for ok in works_now):
      _fail(f"{path}={_short(value)} is not supported yet (it needs {needs}); remove it or "
            f"leave the default (works now: {', '.join(map(repr, works_now))})")


# ----------------------------------------------------------------------------- YAML

class _Loader(yaml.SafeLoader):
  """SafeLoader reading ``1e-4`` as a float and refusing duplicate keys."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


def _mapping_without_duplicates(loader, node):
  seen = set()
  for key_node, _ in node.value:
    if isinstance(key_node, yaml.ScalarNode):
      key = loader.construct_object(key_node)
      if key in seen:
        raise yaml.constructor.ConstructorError(None, None, f"key {key!r} appears twice",
                                                key_node.start_mark)
      seen.add(key)
  return loader.construct_mapping(node)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                        _mapping_without_duplicates)


def _parse_yaml(text: str, where: str) -> Any:
  try:
    return yaml.load(text, Loader=_Loader)
  except yaml.YAMLError as e:
    raise ValueError(f"{where}: not valid YAML: {e}") from None


OVERRIDE_FLAG = "--set"  # what messages call an override (the command line's flag)


def _override_key(item: str) -> list[str]:
  """The key path of override ``section.key=value`` as its parts."""
  return item.partition("=")[0].strip().split(".")


def _apply_override(data: dict, item: str) -> None:
  """Sets ``section.key[.key...]=value`` in `data`; the value is parsed as YAML."""
  _, sep, text = item.partition("=")
  parts = _override_key(item)
  if not sep or len(parts) < 2 or not all(parts):
    raise ValueError(f"{OVERRIDE_FLAG} {item!r} is not allowed; use section.key=value, "
                     f"e.g. train.steps=100")
  node = data
  for i, part in enumerate(parts[:-1]):
    if node.get(part) is None:
      node[part] = {}
    if not isinstance(node[part], dict):
      raise ValueError(f"{OVERRIDE_FLAG} {item}: {'.'.join(parts[:i + 1])}="
                       f"{_short(node[part])} is not a mapping")
    node = node[part]
  node[parts[-1]] = _parse_yaml(text, f"{OVERRIDE_FLAG} {item}")


def _blame(message: str, path, overrides: list[str]) -> str:
  """`message` (a validation error) prefixed with what gave the bad value: the override
  that set its key (or a section above it, or a key below it), else the file at `path` (with
  the overrides the message names, when it is about several keys)."""
  for item in reversed(overrides):  # the last override of a key is the one in effect
    parts = _override_key(item)
    for n in range(len(parts), 0, -1):
      key = ".".join(parts[:n])
      if message.startswith(f"{key}=") or (n == len(parts) and message.startswith(f"{key}.")):
        return f"{OVERRIDE_FLAG} {item}: {message}"
  named = [item for item in overrides if f"{'.'.join(_override_key(item))}=" in message]
  where = os.fspath(path) if path is not None else ""
  if named:
    flags = ", ".join(f"{OVERRIDE_FLAG} {item}" for item in named)
    where = f"{where} with {flags}" if where else flags
  return f"{where}: {message}" if where else message


# ----------------------------------------------------------------------------- public API

def config_from_dict(data: dict | None) -> Config:
  """Builds and validates a Config from nested plain data (as read from YAML)."""
  return _from_dict(Config, data)


def config_to_dict(cfg: Config) -> dict:
  """Nested plain data (dicts, lists, scalars) that `config_from_dict` turns back into `cfg`."""
  return dataclasses.asdict(cfg)


def load_config(path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> Config:
  """Reads the YAML file `path` (None: all defaults), applies `overrides` ("section.key=value",
  the value parsed as YAML) and validates. runtime.name defaults to the file's stem.

  A ValueError names who gave the bad value: ``--set <override>: ...`` when an override set
  the key, else ``<path>: ...`` (plus the overrides it names, for a combination of keys)."""
  data = _read(path) if path is not None else {}
  overrides = list(overrides)
  for item in overrides:
    _apply_override(data, item)
  if path is not None:
    _default_name(data, os.path.splitext(os.path.basename(path))[0])
  try:
    return config_from_dict(data)
  except ValueError as e:
    raise ValueError(_blame(str(e), path, overrides)) from None


def _default_name(data: dict, name: str) -> None:
  """Sets runtime.name to `name` unless the data gives one."""
  if data.get("runtime") is None:
    data["runtime"] = {}
  if isinstance(data["runtime"], dict):
    data["runtime"].setdefault("name", name)


def _read(path) -> dict:
  with open(path, encoding="utf-8") as f:
    data = _parse_yaml(f.read(), os.fspath(path))
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ValueError(f"{os.fspath(path)}: the top level is {_short(data)}; use a mapping of "
                     f"sections ({', '.join(f.name for f in dataclasses.fields(Config))})")
  return data


def save_config(cfg: Config, path: str | os.PathLike) -> None:
  """Writes every field of `cfg` as YAML; `load_config(path)` gives `cfg` back."""
  parent = os.path.dirname(os.fspath(path))
  if parent:
    os.makedirs(parent, exist_ok=True)
  with open(path, "w", encoding="utf-8") as f:
    yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, default_flow_style=False)


__all__ = [
    "BatchRamp", "CheckpointSection", "Config", "DataSection", "Fp8Section", "ModelSection",
    "NOT_BUILT_YET", "ParallelSection", "RuntimeSection", "TrainSection", "config_from_dict",
    "config_to_dict", "load_config", "save_config",
]
