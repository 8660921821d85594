"""What a run compiles: JAX's persistent compilation cache (``runtime.compile_cache``) and a
record of every XLA compile request in the process (:class:`CompileLog`), the process's
running totals of tracing, lowering and compile seconds (:func:`totals`), and compiling a
run's first programs while the next one is traced (:func:`compile_ahead`).

With the cache on, XLA's executables are written to a folder and a later process that builds
the same program (same HLO, compile options, devices and jax version) loads it instead of
compiling it again. The cache is trusted: a folder others can write to lets them run code in
the process (JAX's warning). The folder grows with every new program (JAX's size bound,
JAX_COMPILATION_CACHE_MAX_SIZE, is left to the user: its eviction cannot share a folder with
processes that write without it); delete it to reclaim the space.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from typing import Callable, Iterable, NamedTuple

import jax
from jax.experimental.compilation_cache import compilation_cache

logger = logging.getLogger("fp8jax")
# The cache folder of runtime.compile_cache "auto" when JAX_COMPILATION_CACHE_DIR is unset.
DEFAULT_CACHE_DIR = os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
    "fp8jax", "jax_cache")
# Programs that compile faster than this are not written (the eager ops' small programs);
# every train step, evaluation step and probe of a model takes longer on GPUs. Kept when
# JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS is set. No minimum entry size (JAX's default):
# the compile time already leaves the small programs out.
MIN_COMPILE_SECONDS = 0.5
# JAX's compile event (one per compile request: compiled, or loaded from the cache).
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# JAX's events of the steps before a compile: tracing to a jaxpr, lowering it to MLIR.
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"


def _jax_cache_dir() -> str | None:
  """The folder jax's persistent cache uses now (``jax_compilation_cache_dir``)."""
  return getattr(jax.config, "jax_compilation_cache_dir", None)


def cache_dir(setting: str | bool) -> str | None:
  """The folder `setting` (``runtime.compile_cache``) names: False or "off" -> None; "auto"
  or True -> the folder jax was given (``JAX_COMPILATION_CACHE_DIR`` or
  ``jax_compilation_cache_dir``), else :data:`DEFAULT_CACHE_DIR`; any other string is a
  folder (``~`` expanded)."""
  if setting is False or setting == "off":
    return None
  if setting is True or setting == "auto":
    given = os.environ.get("JAX_COMPILATION_CACHE_DIR") or _jax_cache_dir()
    return given or DEFAULT_CACHE_DIR
  return os.path.expanduser(setting)


def use_compile_cache(setting: str | bool) -> str | None:
  """Points JAX's persistent compilation cache at :func:`cache_dir` of `setting` (None: off;
  also when the folder cannot be created, with a warning) for the rest of the process, with
  :data:`MIN_COMPILE_SECONDS` unless JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS sets it;
  returns the folder (created if missing). Compiles after the call read and write it (a
  change of folder drops the process's handle on the old one)."""
  path = cache_dir(setting)
  if path is not None:
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as error:  # a run does not fail for want of a cache
      logger.warning("fp8jax: compilation cache off: cannot create %s (%s)", path, error)
      path = None
  if path != _jax_cache_dir():
    jax.config.update("jax_compilation_cache_dir", path)
    compilation_cache.reset_cache()
  if path is not None:
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
  return path


class Compile(NamedTuple):
  """One XLA compile request: `name` as jax names the program (``"jit(train_step)"``),
  `seconds` it took, `cached`: loaded from the persistent cache instead of compiled, `thread`:
  the name of the thread that asked."""

  name: str
  seconds: float
  cached: bool
  thread: str = ""


class Totals(NamedTuple):
  """Running totals of a process (all threads) since :func:`totals` was first called: seconds
  tracing functions to jaxprs, lowering jaxprs to MLIR and in compile requests (compiled, or
  loaded from the persistent cache); the number of compile requests and of cache hits."""

  trace_s: float = 0.0
  lower_s: float = 0.0
  compile_s: float = 0.0
  compiles: int = 0
  cache_hits: int = 0

  def __sub__(self, earlier: "Totals") -> "Totals":
    return Totals(*(a - b for a, b in zip(self, earlier)))

  @property
  def work_s(self) -> float:
    """Seconds of tracing, lowering and compiling (what a program's first use costs)."""
    return self.trace_s + self.lower_s + self.compile_s


class _Counter:
  """The one process-wide listener behind :func:`totals` (registered once, never removed)."""

  def __init__(self):
    self.lock, self.now = threading.Lock(), Totals()
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)

  def _on_event(self, event: str, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:
      with self.lock:
        self.now = self.now._replace(cache_hits=self.now.cache_hits + 1)

  def _on_duration(self, event: str, seconds: float, **kwargs) -> None:
    with self.lock:
      n = self.now
      if event == TRACE_EVENT:
        self.now = n._replace(trace_s=n.trace_s + seconds)
      elif event == LOWER_EVENT:
        self.now = n._replace(lower_s=n.lower_s + seconds)
      elif event == COMPILE_EVENT:
        self.now = n._replace(compile_s=n.compile_s + seconds, compiles=n.compiles + 1)


_COUNTER: _Counter | None = None
_COUNTER_LOCK = threading.Lock()


def totals() -> Totals:
  """The process's :class:`Totals` now; the first call starts counting (zeros), so the
  difference of two calls is what happened between them."""
  global _COUNTER
  with _COUNTER_LOCK:
    if _COUNTER is None:
      _COUNTER = _Counter()
    return _COUNTER.now


class CompileLog:
  """A context manager recording every compile request of the process while it is open
  (``jax.monitoring`` events, all threads) in :attr:`compiles`, in order."""

  def __init__(self):
    self.compiles: list[Compile] = []
    self._hit = threading.local()

  def _on_event(self, event: str, **kwargs) -> None:
    if event == CACHE_HIT_EVENT:
      self._hit.value = True

  def _on_duration(self, event: str, seconds: float, **kwargs) -> None:
    if event == COMPILE_EVENT:
      cached = getattr(self._hit, "value", False)
      self._hit.value = False
      self.compiles.append(Compile(str(kwargs.get("fun_name", "?")), seconds, cached,
                                   threading.current_thread().name))

  def __enter__(self) -> "CompileLog":
    jax.monitoring.register_event_listener(self._on_event)
    jax.monitoring.register_event_duration_secs_listener(self._on_duration)
    return self

  def __exit__(self, *exc) -> None:
    jax.monitoring.unregister_event_listener(self._on_event)
    jax.monitoring.unregister_event_duration_listener(self._on_duration)

  def of(self, name: str) -> list[Compile]:
    """The compile requests of the program jax names ``jit(<name>)``."""
    return [c for c in self.compiles if c.name == f"jit({name})"]

  def seconds(self, name: str | None = None) -> float:
    """Seconds spent in compile requests (of ``jit(<name>)`` only, when given)."""
    return sum(c.seconds for c in (self.compiles if name is None else self.of(name)))


# The thread compile_ahead compiles in.
COMPILE_THREAD = "fp8jax-compile"


def compile_ahead(lowerings: Iterable[Callable[[], object]]) -> int:
  """Traces and lowers each program of `lowerings` in order in this thread (each a
  ``() -> jax.stages.Lowered``, e.g. ``lambda: jitted.lower(*args)``) and compiles it (or
  loads it from the persistent cache) in one worker thread while the next is traced; returns
  when all are done, with the number that compiled.

  A later call of the same jitted function with arguments of the same shapes, dtypes and
  shardings runs the compiled program without compiling again. Best effort: a program whose
  tracing, lowering or compile fails is skipped (logged at debug level), so its error comes
  from the call that runs it, as without this function. Compiles never overlap one another
  (XLA's GPU autotuning times kernels on the device)."""
  done = 0
  with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=COMPILE_THREAD) as pool:
    futures = []
    for lower in lowerings:
      try:
        lowered = lower()
      except Exception as error:  # noqa: BLE001 (raised again by the call that runs it)
        logger.debug("fp8jax: not compiled ahead: %s", error)
        continue
      futures.append(pool.submit(lowered.compile))
    for future in futures:
      try:
        future.result()
        done += 1
      except Exception as error:  # noqa: BLE001 (raised again by the call that runs it)
        logger.debug("fp8jax: not compiled ahead: %s", error)
  return done
