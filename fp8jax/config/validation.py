"""The checking machinery of the config sections: value rules (:class:`_Rule` and its makers),
fields carrying them (:func:`_field`), type checks and conversions (an int is accepted for a
float, a bool is not an int), unknown keys with the closest known key suggested, and the base
classes every section derives from: :class:`_Section` (checks on construction) and
:func:`_mirror` (a section with one key per field of the object it configures).

Every error is a one-line ``ValueError`` naming the key path, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import re
import types
import typing
from typing import Any, Callable

from fp8jax.parallel.combine import WITHOUT_XLA_MEANING
from fp8jax.recipe import LEVELS, OptLevel


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
