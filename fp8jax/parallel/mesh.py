"""The global device mesh: named axes for pipeline, data, ZeRO/FSDP and tensor parallelism.

Axis sizes come from the config (``parallel.pipeline_parallel_size``,
``parallel.data_parallel_size``, ``parallel.fsdp_size``, ``parallel.tensor_parallel_size``); one
of data, fsdp and tensor may be -1, meaning "whatever the devices leave". The mesh holds every
process's devices (``jax.devices()``), so all processes build the same mesh. Axes are ``Auto``:
the step is written for ``jax.jit`` with shardings and XLA's partitioner places the
collectives (the pipeline schedule alone is manual over "pipe": ``fp8jax.parallel.pipeline``).

Axes: ("data", "fsdp", "tensor"), led by "pipe" when there are 2 or more pipeline stages (a
mesh without a "pipe" axis has one stage: :func:`pipe_size`). "pipe" is the outermost axis,
so a stage's devices are neighbours and stages talk only to the next and previous stage.
"""
from __future__ import annotations

import collections
import math
from typing import Sequence

import jax
from jax.sharding import AxisType, Mesh

PIPE, DATA, FSDP, TENSOR = "pipe", "data", "fsdp", "tensor"
AXES = (DATA, FSDP, TENSOR)  # every mesh's; PIPE leads them with pipeline stages
BATCH_AXES = (DATA, FSDP)  # split the batch; every data-parallel rank (ZeRO shards over them)
FILL = -1


def _check_size(name: str, value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != FILL):
    raise ValueError(f"mesh axis {name!r} size {value!r} is not allowed; use an integer >= 1 "
                     f"or -1 (fill with the remaining devices)")


def _check_pipe(value) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"mesh axis {PIPE!r} size {value!r} is not allowed; use an integer >= 1 "
                     f"(pipeline stages)")


def mesh_shape(num_devices: int, data: int = FILL, fsdp: int = 1,
               tensor: int = 1, pipe: int = 1) -> tuple[int, int, int]:
  """(data, fsdp, tensor) sizes for `num_devices` devices of which each of `pipe` pipeline
  stages gets 1/pipe; one size may be -1 (fill).

  Raises ValueError naming the sizes and the device count when they do not fit.
  """
  _check_pipe(pipe)
  sizes = {DATA: data, FSDP: fsdp, TENSOR: tensor}
  for name, value in sizes.items():
    _check_size(name, value)
  if pipe > 1:
    if num_devices % pipe:
      raise ValueError(f"{num_devices} devices do not split into {PIPE}={pipe} pipeline "
                       f"stages; use a stage count that divides {num_devices}")
    try:
      return mesh_shape(num_devices // pipe, data, fsdp, tensor)
    except ValueError as e:
      raise ValueError(f"{e} (per pipeline stage: {num_devices} devices / {PIPE}={pipe})") \
          from None
  fill = [name for name, v in sizes.items() if v == FILL]
  if len(fill) > 1:
    raise ValueError(f"mesh axes {fill} are all -1; at most one axis may be -1 (fill), "
                     f"got sizes {sizes}")
  fixed = math.prod(v for v in sizes.values() if v != FILL)
  if fill:
    if num_devices % fixed:
      raise ValueError(f"mesh sizes {sizes} cannot fill {num_devices} devices: "
                       f"{num_devices} is not a multiple of {fixed} (the product of the fixed "
                       f"sizes); use sizes whose product divides {num_devices}")
    sizes[fill[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(f"mesh sizes {sizes} use {fixed} devices but there are {num_devices}; "
                     f"use sizes whose product is {num_devices}, or -1 for one axis")
  return sizes[DATA], sizes[FSDP], sizes[TENSOR]


def make_mesh(data: int = FILL, fsdp: int = 1, tensor: int = 1,
              devices: Sequence | None = None, pipe: int = 1) -> Mesh:
  """A Mesh with axes ("data", "fsdp", "tensor"), led by "pipe" when `pipe` > 1, over
  `devices` (default: all processes')."""
  devices = list(jax.devices() if devices is None else devices)
  shape = mesh_shape(len(devices), data, fsdp, tensor, pipe)
  names = AXES
  if pipe > 1:
    shape, names = (pipe, *shape), (PIPE, *AXES)
  return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=devices)


def mesh_from_config(parallel, devices: Sequence | None = None) -> Mesh:
  """The mesh a config's ``parallel`` section asks for."""
  return make_mesh(parallel.data_parallel_size, parallel.fsdp_size,
                   parallel.tensor_parallel_size, devices, parallel.pipeline_parallel_size)


def pipe_size(mesh: Mesh) -> int:
  """Pipeline stages of `mesh`: its "pipe" axis size (1 without one)."""
  return int(mesh.shape.get(PIPE, 1))


def device_kinds(mesh: Mesh) -> dict[int, dict[str, int]]:
  """{process index: {device kind: number of its devices in `mesh`}}."""
  out: dict[int, collections.Counter] = {}
  for d in mesh.devices.flat:
    out.setdefault(d.process_index, collections.Counter())[d.device_kind] += 1
  return {p: dict(c) for p, c in sorted(out.items())}


def describe(mesh: Mesh) -> str:
  """One line: axis sizes ("pipe" first when present) and device kinds per process, e.g.
  ``mesh data=4 fsdp=2 tensor=1; process 0: 8 x cpu``."""
  axes = " ".join(f"{n}={s}" for n, s in mesh.shape.items())
  procs = "; ".join(f"process {p}: " + ", ".join(f"{n} x {k}" for k, n in kinds.items())
                    for p, kinds in device_kinds(mesh).items())
  return f"mesh {axes}; {procs}"
