"""Config files and ``--set`` overrides: :func:`load_config` (YAML file + overrides ->
validated :class:`fp8jax.config.Config`, an error naming who gave the bad value),
:func:`config_from_dict` / :func:`config_to_dict` (plain nested data <-> Config) and
:func:`save_config`.

YAML is read with PyYAML's safe loader, extended in two ways: ``1e-4`` is a float (YAML 1.2; the
1.1 resolver would read a string) and a key given twice in one mapping is an error.
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterable

import yaml

from fp8jax.config.cross_section import Config
from fp8jax.config.validation import _from_dict, _short


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
