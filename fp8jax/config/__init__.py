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

The modules, each importing only those above it:

* :mod:`~fp8jax.config.validation`: value rules, type checks, unknown keys, the section base
  classes;
* :mod:`~fp8jax.config.sections`: the sections and their own checks;
* :mod:`~fp8jax.config.cross_section`: :class:`Config`, the rules across sections and the
  batch-ramp arithmetic;
* :mod:`~fp8jax.config.loader`: YAML files and ``--set`` overrides (:func:`load_config`).
"""
from fp8jax.config.cross_section import NOT_BUILT_YET, Config
from fp8jax.config.loader import config_from_dict, config_to_dict, load_config, save_config
from fp8jax.config.sections import (BatchRamp, CheckpointSection, DataSection, Fp8Section,
                                    ModelSection, ParallelSection, RuntimeSection, TrainSection)

__all__ = [
    "BatchRamp", "CheckpointSection", "Config", "DataSection", "Fp8Section", "ModelSection",
    "NOT_BUILT_YET", "ParallelSection", "RuntimeSection", "TrainSection", "config_from_dict",
    "config_to_dict", "load_config", "save_config",
]
