"""Traced programs kept on disk (``jax.export``), so that a later run of the same config skips
tracing and lowering its programs in Python.

JAX's persistent compilation cache (``fp8jax.train.compiles``) keys an executable by its
lowered program, so every run still traces and lowers each program before it can look one up:
seconds of Python per program for a model of a few hundred GEMMs. A :class:`ProgramCache`
keeps each traced program, serialized by ``jax.export``, in a folder beside that cache; a run
whose program key and argument signature match loads it instead of tracing it, and the
compile that follows is a cache hit as before.

A program is identified by everything its trace depends on: the caller's key (the run's
resolved config, its model, the program's name and static arguments), this fp8jax's source
files, the versions of Python, jax, jaxlib, flax, optax and numpy, the JAX and XLA settings of
the environment, the devices, and the arguments' tree structure, shapes, dtypes and shardings.
Only the caller can vouch for its key: the trainer uses the cache for the models it builds
from a config, never for a user's module (whose code is not part of the key).

Best effort: a program that cannot be exported (a host callback, an unsupported construct) or
written runs as an ordinary ``jax.jit`` program (logged at debug level); a file that cannot be
read is traced and written again. The folder is trusted as the compilation cache is: its
files are loaded as code. The trainer keeps programs in single-process runs only.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import platform
import sys
import tempfile
import threading
from typing import Any, Callable, Sequence

import jax

logger = logging.getLogger("fp8jax")

# The folder under the compilation cache's folder where the programs are kept.
FOLDER = "fp8jax_programs"
# File suffixes: the serialized jax.export program, and its output tree (pickled PyTreeDef).
PROGRAM_SUFFIX, TREE_SUFFIX = ".jaxexport", ".outtree"
# JAX settings that change what tracing produces (jax.config names).
_TRACE_SETTINGS = ("jax_enable_x64", "jax_default_matmul_precision", "jax_default_prng_impl",
                   "jax_threefry_partitionable", "jax_use_shardy_partitioner",
                   "jax_numpy_rank_promotion", "jax_numpy_dtype_promotion", "jax_debug_nans",
                   "jax_debug_infs", "jax_enable_checks", "jax_disable_jit")
_PACKAGES = ("jax", "jaxlib", "flax", "optax", "numpy", "ml_dtypes", "chex")


def _source_hash() -> str:
  """sha256 of every .py file of the fp8jax package (paths and contents)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  digest = hashlib.sha256()
  for folder, dirs, files in sorted(os.walk(root)):
    dirs.sort()
    for name in sorted(f for f in files if f.endswith(".py")):
      path = os.path.join(folder, name)
      digest.update(os.path.relpath(path, root).encode())
      with open(path, "rb") as f:
        digest.update(f.read())
  return digest.hexdigest()


def _versions() -> dict:
  from importlib import metadata
  out = {"python": sys.version, "platform": platform.platform()}
  for name in _PACKAGES:
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      out[name] = None
  return out


def environment_key() -> dict:
  """What, besides a program's own key and arguments, decides what tracing it produces: the
  fp8jax sources, package versions, JAX settings, JAX/XLA/fp8jax environment variables and
  the process's devices (JSON-serializable)."""
  settings = {name: str(getattr(jax.config, name, None)) for name in _TRACE_SETTINGS}
  env = {k: v for k, v in sorted(os.environ.items())
         if k.startswith(("JAX_", "XLA_", "FP8JAX_")) and "CACHE" not in k}
  devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
  return {"source": _source_hash(), "versions": _versions(), "settings": settings,
          "env": env, "devices": devices}


def _sharding_text(sharding) -> str:
  """`sharding` as text that is the same for shardings that place an array alike (a
  NamedSharding's spec without mesh axes of size 1 and without trailing Nones: P('x', None),
  P('x') and P(('x', 'y')) with a 'y' of size 1 are one placement)."""
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh, spec = sharding.mesh, []
    for entry in sharding.spec:
      names = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
      names = tuple(n for n in names if mesh.shape[n] > 1)
      spec.append(names or None)
    while spec and spec[-1] is None:
      spec.pop()
    return (f"{mesh!r}|{[d.id for d in mesh.devices.flat]}|{tuple(spec)}|"
            f"{sharding.memory_kind}")
  return repr(sharding)


def signature(args: Sequence[Any]) -> str:
  """The arguments' tree structure, shapes, dtypes, weak types and shardings, as text."""
  leaves, tree = jax.tree.flatten(tuple(args))
  parts = [str(tree)]
  for leaf in leaves:
    aval = jax.typeof(leaf)
    sharding = _sharding_text(getattr(leaf, "sharding", None))
    parts.append(f"{aval.str_short()}|{getattr(aval, 'weak_type', False)}|{sharding}")
  return "\n".join(parts)


class _Loaded:
  """An exported program run through ``jax.jit`` on the flattened arguments: callable and
  lowerable like the ``jax.jit`` function it was exported from."""

  def __init__(self, exported, out_tree, name: str, donate: tuple[int, ...],
               compiler_options):
    self.out_tree = out_tree

    def program(*leaves):
      return exported.call(*leaves)
    program.__name__ = program.__qualname__ = name  # jax names the program jit(<name>)
    self.jitted = jax.jit(program, donate_argnums=donate,
                          compiler_options=compiler_options or None)

  def __call__(self, *args):
    return jax.tree.unflatten(self.out_tree, self.jitted(*jax.tree.leaves(tuple(args))))

  def lower(self, *args):
    return self.jitted.lower(*jax.tree.leaves(tuple(args)))


class SavedJit:
  """A ``jax.jit`` function (`jitted`) whose traced programs are kept in a :class:`ProgramCache`
  under `key` plus each call's argument signature. Call and ``lower`` it like `jitted`.

  Args:
    jitted: the ``jax.jit``-wrapped function (its shardings are part of the program).
    cache: where programs are kept; key: text naming the program and every static input its
      trace depends on (with the cache's environment key).
    donate_argnums: the positional arguments `jitted` donates.
    compiler_options: the XLA options `jitted` compiles with.
  """

  def __init__(self, jitted: Callable, cache: "ProgramCache", key: str,
               donate_argnums: Sequence[int] = (), compiler_options: dict | None = None):
    self.jitted, self.cache, self.key = jitted, cache, key
    self.donate_argnums, self.compiler_options = tuple(donate_argnums), compiler_options
    self._programs: dict[str, Any] = {}  # signature -> program
    self._seen: dict = {}  # the arguments' types and shardings -> program
    self._lock = threading.Lock()

  @property
  def _name(self) -> str:
    return getattr(self.jitted, "__name__", "program")

  def _program(self, args) -> Callable:
    leaves, tree = jax.tree.flatten(tuple(args))
    fast = (tree, tuple((getattr(x, "shape", None), getattr(x, "dtype", None),
                         getattr(x, "weak_type", None), getattr(x, "sharding", None))
                        for x in leaves))  # hashable, cheaper than `signature` per call
    program = self._seen.get(fast)
    if program is None:
      sig = signature(args)
      with self._lock:
        if sig not in self._programs:
          self._programs[sig] = self._load_or_export(args, sig)
        program = self._seen[fast] = self._programs[sig]
    return program

  def __call__(self, *args):
    return self._program(args)(*args)

  def lower(self, *args):
    return self._program(args).lower(*args)

  def _donated_leaves(self, args) -> tuple[int, ...]:
    out, start = [], 0
    for i, arg in enumerate(args):
      n = len(jax.tree.leaves(arg))
      if i in self.donate_argnums:
        out.extend(range(start, start + n))
      start += n
    return tuple(out)

  def _load_or_export(self, args, sig: str):
    path = self.cache.path(self.key, sig)
    donate = self._donated_leaves(args)
    try:
      loaded = self.cache.read(path)
    except Exception as error:  # noqa: BLE001 (a damaged file: traced and written again)
      logger.debug("fp8jax: program %s unreadable (%s: %s)", os.path.basename(path),
                   type(error).__name__, error)
      loaded = None
    try:
      if loaded is None:
        loaded = self._export(args, path)
      exported, out_tree = loaded
      return _Loaded(exported, out_tree, self._name, donate, self.compiler_options)
    except Exception as error:  # noqa: BLE001 (best effort: the plain program runs)
      logger.debug("fp8jax: program %s not kept (%s: %s)", os.path.basename(path),
                   type(error).__name__, error)
      return self.jitted

  def _export(self, args, path: str):
    from jax import export
    leaves, in_tree = jax.tree.flatten(tuple(args))
    out_trees = []

    def flat(*flat_args):
      out = self.jitted(*jax.tree.unflatten(in_tree, flat_args))
      out_leaves, out_tree = jax.tree.flatten(out)
      out_trees.append(out_tree)
      return out_leaves

    # (a name of its own: lowering it for export is not a compile of the program)
    flat.__name__ = flat.__qualname__ = "traced_for_export"
    exported = export.export(jax.jit(flat), disabled_checks=[
        export.DisabledSafetyCheck.custom_call("ALL")])(*leaves)
    blob = exported.serialize()
    self.cache.write(path, bytes(blob), out_trees[-1])
    return export.deserialize(blob), out_trees[-1]  # the same program as a later run loads


class ProgramCache:
  """The traced programs of a run, in `folder` (created when first written).

  Args:
    folder: where the programs are kept (``<compilation cache>/fp8jax_programs``).
    key: what every program of the run shares (e.g. the resolved config as JSON); the
      environment (:func:`environment_key`) is added.
  """

  def __init__(self, folder: str, key: str):
    self.folder = folder
    self.key = json.dumps({"run": key, "environment": environment_key()}, sort_keys=True,
                          default=str)

  def path(self, key: str, sig: str) -> str:
    """The file of the program `key` with arguments of signature `sig`."""
    digest = hashlib.sha256("\0".join((self.key, key, sig)).encode()).hexdigest()[:32]
    return os.path.join(self.folder, digest)

  def wrap(self, jitted: Callable, key: str, donate_argnums: Sequence[int] = (),
           compiler_options: dict | None = None) -> SavedJit:
    """`jitted` with its programs kept here under `key` (:class:`SavedJit`)."""
    return SavedJit(jitted, self, key, donate_argnums, compiler_options)

  @staticmethod
  def read(path: str):
    """(the exported program, its output tree) saved at `path`; None when there is none."""
    from jax import export
    try:
      with open(path + PROGRAM_SUFFIX, "rb") as f:
        blob = f.read()
      with open(path + TREE_SUFFIX, "rb") as f:
        out_tree = pickle.load(f)
    except FileNotFoundError:
      return None
    return export.deserialize(bytearray(blob)), out_tree

  def write(self, path: str, blob: bytes, out_tree) -> None:
    """Writes the program and its output tree, each atomically (a reader never sees part)."""
    os.makedirs(self.folder, exist_ok=True)
    for suffix, data in ((TREE_SUFFIX, pickle.dumps(out_tree)), (PROGRAM_SUFFIX, blob)):
      fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
      try:
        with os.fdopen(fd, "wb") as f:
          f.write(data)
        os.replace(tmp, path + suffix)
      except BaseException:
        os.unlink(tmp)
        raise


def available() -> bool:
  """Whether ``jax.export`` can serialize programs here (it needs the flatbuffers package)."""
  try:
    import flatbuffers  # noqa: F401
  except ImportError:
    return False
  return True
