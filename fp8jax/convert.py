"""One call that turns a Flax model's GEMM layers into fp8jax's FP8 layers at a level.

Usage::

  model, report = fp8jax.convert(model, "O1", tokens)   # linen: example inputs (or shapes)
  model, report = fp8jax.convert(nnx_model, "O1")       # NNX: converted in place
  print(report)                                         # path, kind, format, why kept

What is converted. Linen: ``nn.Dense`` and ``nn.DenseGeneral`` (their GEMM becomes
:class:`fp8jax.linen.Fp8DotGeneral`, as ``dot_general_cls=`` would make it) and ``nn.Einsum``
(computed as :class:`fp8jax.linen.Einsum`), also inside ``nn.scan`` and ``nn.remat``. NNX:
``nnx.Linear`` and ``nnx.Einsum`` are replaced by :class:`fp8jax.nnx.Linear` /
:class:`fp8jax.nnx.Einsum` holding the very same parameter Variables, also when their
Variables are stacked for ``nnx.scan`` (``nnx.vmap``-created layers). Layers with a custom
``dot_general`` / ``einsum_op``, subclasses that override ``__call__``, layers already in FP8,
``nn.Embed.attend`` / ``nnx.Embed`` (embedding-as-GEMM) and ``nnx.LinearGeneral`` keep their
own computation; the report lists them.

The result is, GEMM for GEMM, the hand-wired model: same programs, same FP8 state (in the
collection :data:`fp8jax.FP8_COLLECTION`, or :class:`fp8jax.nnx.Fp8State` Variables), and
the parameters' tree (paths, shapes, dtypes) is exactly the unconverted model's, so a
converted model loads the unconverted model's checkpoints. Train it as docs/models.md's
"Use it in your own model" shows (``fp8jax.apply_fp8_updates``).

Paths name modules by their names joined with "/": linen scope names ("Block_0/Dense_1",
"layers/attn/qkv" under an ``nn.scan`` named "layers"), NNX attribute paths
("blocks/0/attn/q"). :class:`ConvertRules` keeps GEMMs in high precision by path (regular
expressions), by position (first / last N blocks) and, by default, the LM head.

Linen specifics: linen modules are created while the model runs, so `convert` traces
``model.init`` abstractly on the example inputs (arrays or ``jax.ShapeDtypeStruct``), once to
find the GEMMs and once to check the converted model. The converted model is a new module of
a subclass of the model's class whose ``__call__`` runs the FP8 GEMMs (other methods passed
as ``apply(..., method=...)`` are not converted). A GEMM the example inputs did not reach
raises when it runs, and so does one in a submodule the model runs through its own
``.apply`` (its paths start anew). Under ``nn.scan`` the scan's ``variable_axes`` must
include ``fp8jax.FP8_COLLECTION`` (stacked on the layer axis like ``params``; it changes
nothing in the unconverted model): `convert` says so when it is missing.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import math
import re
from collections.abc import MutableMapping, MutableSequence
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import nnx
from rich.table import Table

from fp8jax import linen as flinen
from fp8jax import nnx as fnnx
from fp8jax.dot import init_dot_meta
from fp8jax.recipe import OptLevel, Recipe, format_name, opt_level

__all__ = ["convert", "ConvertRules", "ConvertReport", "ReportEntry", "Gemm", "decide",
           "BLOCK_PATTERN", "HEAD_PATTERN"]

BLOCK_PATTERN = r"(?:^|/)(?:[A-Za-z]\w*?_)?(\d+)(?=/)"
"""Default block pattern: the first path segment "<name>_<index>" (linen: "Block_3",
"layers_3") or "<index>" (NNX lists: "layers/3") that has submodules; group 1 is the index."""

HEAD_PATTERN = r"(?:.*/)?(?:lm_head|head|logits|logits_dense|unembed|output_layer)"
"""Paths (full match) that ``ConvertRules(keep_head=True)`` keeps: the LM head's usual names."""

CANDIDATE = "candidate"   # Gemm.status of a layer convert can turn into FP8
ALREADY_FP8 = "already FP8"
_PLAN_ATTR = "_fp8jax_convert_plan"


# ------------------------------------------------------------------------------------- rules

@dataclasses.dataclass(frozen=True)
class ConvertRules:
  """Which GEMMs stay in high precision (their own compute dtype, e.g. BF16).

  Attributes:
    keep: regular expressions; a GEMM whose path matches one in full (``re.fullmatch``) is
      kept. Each must match at least one GEMM, else `convert` raises naming it.
    keep_head: keep GEMMs whose path matches :data:`HEAD_PATTERN` (the LM head); matching
      nothing is allowed. Embedding-as-GEMM (``nn.Embed.attend``, ``nnx.Embed``) always stays.
    keep_first_blocks, keep_last_blocks: keep every GEMM of the first / last N blocks of each
      stack of blocks (Megatron's ``--first-last-layers-bf16``). A block is what
      `block_pattern` finds in a path; its stack is the path up to the index ("Block_",
      "layers/"). Refused when no block is found, when N exceeds a stack's length, and when
      GEMMs are stacked under a scan (one program runs every layer, so no layer can differ).
    block_pattern: regular expression (``re.search``) with one group, the block index.
  """

  keep: Sequence[str] = ()
  keep_head: bool = True
  keep_first_blocks: int = 0
  keep_last_blocks: int = 0
  block_pattern: str = BLOCK_PATTERN

  def __post_init__(self):
    keep = (self.keep,) if isinstance(self.keep, str) else tuple(self.keep)
    object.__setattr__(self, "keep", keep)
    for rule in keep:
      _compile(f"ConvertRules.keep entry {rule!r}", rule)
    if _compile("ConvertRules.block_pattern", self.block_pattern).groups != 1:
      raise ValueError(f"ConvertRules.block_pattern='{self.block_pattern}' is not allowed; use "
                       "a regular expression with exactly one group (the block index)")
    for name in ("keep_first_blocks", "keep_last_blocks"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"ConvertRules.{name}={value!r} is not allowed; use an integer >= 0")
    if not isinstance(self.keep_head, (bool, np.bool_)):
      raise ValueError(f"ConvertRules.keep_head={self.keep_head!r} is not allowed; use True or "
                       "False")


def _compile(what: str, pattern) -> re.Pattern:
  if not isinstance(pattern, str):
    raise ValueError(f"{what} is not allowed; use a regular expression string")
  try:
    return re.compile(pattern)
  except re.error as e:
    raise ValueError(f"{what} is not a valid regular expression: {e}") from None


class Gemm(NamedTuple):
  """One GEMM layer of a model, as `convert` found it.

  Attributes:
    path: module names joined by "/".
    kind: the layer's type ("Dense", "DenseGeneral", "Einsum", "Linear", "Embed.attend", ...).
    dtype: name of its compute dtype ("bfloat16"), or "unchanged" (it computes in its operands'
      promoted dtype).
    stacked: leading axes of its parameters stacked by a scan / vmap (layer counts), else ().
    status: :data:`CANDIDATE` (convertible), "already FP8", or why it cannot be converted.
  """

  path: str
  kind: str
  dtype: str
  stacked: tuple[int, ...]
  status: str


def block_of(path: str, pattern: str = BLOCK_PATTERN) -> tuple[str, int] | None:
  """(stack, index) of the block `path` lies in, or None: the first `pattern` match (group 1
  the index); stack is the path before the index."""
  m = re.search(pattern, path)
  return None if m is None else (path[:m.start(1)], int(m.group(1)))


def decide(gemms: Sequence[Gemm], rules: ConvertRules, fp8: bool = True) -> dict[str, str | None]:
  """Why each GEMM stays in high precision (None: converted to FP8), by path.

  Args:
    gemms: the model's GEMMs (unique paths).
    rules: the keep rules.
    fp8: False for level O0 (nothing is converted; the rules are still checked). Layers
      that are not candidates keep their status ("already FP8", "embedding", ...).
  Raises:
    ValueError: a `keep` rule or a position rule matches nothing, a position rule asks for
      more blocks than a stack has, or position rules meet GEMMs stacked under a scan.
  """
  paths = [g.path for g in gemms]
  kept: dict[str, str | None] = {}
  for rule in rules.keep:
    if not any(re.fullmatch(rule, p) for p in paths):
      raise ValueError(f"ConvertRules.keep rule '{rule}' matches no GEMM path (re.fullmatch); "
                       f"the model's GEMMs: {_listing(paths)}")
  positions = _position_keeps(gemms, rules)
  for g in gemms:
    if g.status != CANDIDATE:
      why = g.status
    elif not fp8:
      why = "level O0"
    elif rules.keep_head and re.fullmatch(HEAD_PATTERN, g.path):
      why = "head"
    else:
      why = next((f"keep rule '{r}'" for r in rules.keep if re.fullmatch(r, g.path)), None)
      why = why or positions.get(g.path)
    kept[g.path] = why
  return kept


def _position_keeps(gemms: Sequence[Gemm], rules: ConvertRules) -> dict[str, str]:
  """Paths kept by keep_first_blocks / keep_last_blocks, with the reason."""
  asked = [(n, v) for n, v in (("keep_first_blocks", rules.keep_first_blocks),
                               ("keep_last_blocks", rules.keep_last_blocks)) if v]
  if not asked:
    return {}
  what = " and ".join(f"ConvertRules.{n}={v}" for n, v in asked)
  stacked = [g.path for g in gemms if g.stacked]
  if stacked:
    raise ValueError(f"{what} cannot apply: GEMMs {_listing(stacked)} are stacked under a scan "
                     "(one program runs every layer, so no layer can differ); unroll those "
                     "layers or keep them by path (ConvertRules.keep)")
  blocks = {g.path: block_of(g.path, rules.block_pattern) for g in gemms}
  stacks: dict[str, set[int]] = {}
  for b in blocks.values():
    if b is not None:
      stacks.setdefault(b[0], set()).add(b[1])
  if not stacks:
    raise ValueError(f"{what} matches no block: block_pattern='{rules.block_pattern}' finds no "
                     f"block index in the GEMM paths {_listing(list(blocks))}")
  keep: dict[str, str] = {}
  for stack, indices in stacks.items():
    order = sorted(indices)
    for name, n in asked:
      if n > len(order):
        raise ValueError(f"ConvertRules.{name}={n} exceeds the {len(order)} blocks of stack "
                         f"{stack!r} (indices {order})")
    chosen = {i: "first" for i in order[:rules.keep_first_blocks]}
    chosen.update({i: "last" for i in order[len(order) - rules.keep_last_blocks:]
                   if rules.keep_last_blocks})
    for path, b in blocks.items():
      if b is not None and b[0] == stack and b[1] in chosen:
        n = rules.keep_first_blocks if chosen[b[1]] == "first" else rules.keep_last_blocks
        keep[path] = f"{chosen[b[1]]} {n} block{'s' if n > 1 else ''}"
  return keep


def _listing(paths: Sequence[str], limit: int = 12) -> str:
  shown = ", ".join(repr(p) for p in paths[:limit])
  return f"[{shown}{', ...' if len(paths) > limit else ''}] ({len(paths)})"


# ------------------------------------------------------------------------------------ report

class ReportEntry(NamedTuple):
  """One row of a :class:`ConvertReport`.

  Attributes:
    path, kind: as in :class:`Gemm`.
    format: "E4M3/E5M2" (FP8: forward operands / output gradients; "E4M3/E5M2 row-wise"
      with ``Recipe(granularity="rowwise")``) or the high-precision
      compute dtype the GEMM keeps ("bfloat16"; "unchanged": its operands' promoted dtype).
    layers: layers the row stands for (stacked under a scan), 1 when not stacked.
    reason: why it stays in high precision; "" when converted.
  """

  path: str
  kind: str
  format: str
  layers: int
  reason: str

  @property
  def fp8(self) -> bool:
    """True when this GEMM runs in FP8."""
    return not self.reason or self.reason == ALREADY_FP8


@dataclasses.dataclass(frozen=True)
class ConvertReport:
  """What :func:`convert` did: one :class:`ReportEntry` per GEMM layer, in path order.

  ``str(report)`` is a plain-text table; ``rich.print(report)`` renders a rich table.
  """

  level: str
  entries: tuple[ReportEntry, ...]

  @property
  def converted(self) -> tuple[str, ...]:
    """Paths of the GEMMs `convert` turned into FP8."""
    return tuple(e.path for e in self.entries if not e.reason)

  @property
  def kept(self) -> tuple[str, ...]:
    """Paths of the GEMMs that stay in high precision."""
    return tuple(e.path for e in self.entries if not e.fp8)

  def __getitem__(self, path: str) -> ReportEntry:
    """The entry of `path`."""
    for e in self.entries:
      if e.path == path:
        return e
    raise KeyError(f"no GEMM at path {path!r}; paths: {_listing([e.path for e in self.entries])}")

  def _title(self) -> str:
    n = sum(e.layers for e in self.entries if not e.reason)
    total = sum(e.layers for e in self.entries)
    return f"fp8jax.convert at {self.level}: {n} of {total} GEMMs converted to FP8"

  def _rows(self) -> list[tuple[str, ...]]:
    return [(e.path, e.kind, e.format, str(e.layers), e.reason or "-") for e in self.entries]

  def __str__(self) -> str:
    head = ("path", "kind", "format", "layers", "kept because")
    rows = [head] + self._rows()
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [self._title()] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                               for r in rows]
    return "\n".join(lines)

  def __rich__(self) -> Table:
    table = Table(title=self._title())
    for col in ("path", "kind", "format", "layers", "kept because"):
      table.add_column(col, justify="right" if col == "layers" else "left")
    for row in self._rows():
      table.add_row(*row)
    return table


def _report(level: str, gemms: Sequence[Gemm], kept: Mapping[str, str | None],
            recipe: Recipe | None) -> ConvertReport:
  fp8 = None if recipe is None else \
      f"{format_name(recipe.fwd_format).upper()}/{format_name(recipe.bwd_format).upper()}" + (
          " row-wise" if recipe.rowwise else "")
  entries = []
  for g in sorted(gemms, key=lambda g: g.path):
    why = kept[g.path]
    fmt = fp8 if (why is None and fp8) else g.dtype
    if why == ALREADY_FP8:
      fmt = "FP8"
    entries.append(ReportEntry(g.path, g.kind, fmt, math.prod(g.stacked), why or ""))
  return ConvertReport(level, tuple(entries))


# ----------------------------------------------------------------------------------- convert

def convert(model, level: OptLevel | str | Recipe, *example_args, rules: ConvertRules | None = None,
            amax_axes: Sequence[str] = (), **example_kwargs):
  """`model` with its GEMM layers in FP8 at `level`, and a report of what was converted.

  Args:
    model: a Flax linen ``nn.Module`` or an NNX ``nnx.Module``.
    level: an :class:`fp8jax.OptLevel` or its name ("O0".."O3"): its recipe is used (O0:
      nothing converted, the model is returned as is); or a :class:`fp8jax.Recipe`.
    *example_args, **example_kwargs: linen only (required there): inputs of one
      ``model.init(rngs, *example_args, **example_kwargs)``, arrays or
      ``jax.ShapeDtypeStruct``s, traced abstractly (nothing is computed). A keyword ``rngs``
      replaces the default ``{"params": key, "dropout": key}``. NNX takes none.
    rules: which GEMMs stay in high precision (default ``ConvertRules()``: the LM head).
    amax_axes: mesh axes FP8 GEMMs agree their amaxes over (inside ``shard_map`` only).
  Returns:
    ``(converted, report)``. Linen: `converted` is a new module (a subclass of the model's
    class, same fields and names) to ``init`` / ``apply``. NNX: `model` itself, changed in
    place (the root object is new only when the root is itself a converted layer).
    `report` is a :class:`ConvertReport`.
  Raises:
    ValueError: a rule matches nothing (see :func:`decide`), the level is unknown, example
      inputs are missing (linen) or given (NNX), a linen ``nn.scan`` does not scan the FP8
      collection, or `model` was converted already.
    TypeError: `model` is neither a linen nor an NNX module.
  """
  recipe, level_name = _level(level)
  rules = ConvertRules() if rules is None else rules
  if not isinstance(rules, ConvertRules):
    raise TypeError(f"rules must be an fp8jax.ConvertRules, got {type(rules).__name__}")
  amax_axes = (amax_axes,) if isinstance(amax_axes, str) else tuple(amax_axes)
  if isinstance(model, nn.Module):
    return _convert_linen(model, recipe, level_name, rules, amax_axes, example_args,
                          example_kwargs)
  if isinstance(model, nnx.Module):
    if example_args or example_kwargs:
      raise ValueError("convert: NNX models are converted from their module graph; pass no "
                       f"example inputs (got {len(example_args)} positional, keywords "
                       f"{sorted(example_kwargs)})")
    return _convert_nnx(model, recipe, level_name, rules, amax_axes)
  raise TypeError(f"convert: model must be a flax.linen or flax.nnx Module, got "
                  f"{type(model).__name__}")


def _level(level) -> tuple[Recipe | None, str]:
  if isinstance(level, Recipe):
    return level, "custom recipe"
  if isinstance(level, OptLevel):
    return level.recipe, level.name
  if isinstance(level, str):
    lvl = opt_level(level)
    return lvl.recipe, lvl.name
  raise ValueError(f"convert: level={level!r} is not allowed; use an fp8jax.OptLevel, its name "
                   "('O0'..'O3') or an fp8jax.Recipe")


def _dtype_name(dtype) -> str:
  """The compute dtype's name; "unchanged" for layers computing in their operands' dtype."""
  return "unchanged" if dtype is None else jnp.dtype(dtype).name


# ------------------------------------------------------------------------------------- linen

_LINEN_KINDS = ((nn.DenseGeneral, "DenseGeneral"), (nn.Dense, "Dense"), (nn.Einsum, "Einsum"))


def _is_fp8_dot_cls(cls) -> bool:
  func = cls.func if isinstance(cls, functools.partial) else cls
  return isinstance(func, type) and issubclass(func, flinen.Fp8DotGeneral)


def _is_plain_dot_cls(cls) -> bool:
  """fp8jax.linen.DotGeneral: lax.dot_general (gathering a ZeRO-3 weight), convertible."""
  return isinstance(cls, type) and issubclass(cls, flinen.DotGeneral)


def _linen_kind(module: nn.Module) -> tuple[str, str] | None:
  """(kind, status) of a linen GEMM layer, None for other modules."""
  for cls, kind in _LINEN_KINDS:
    if isinstance(module, cls):
      if isinstance(module, flinen.Einsum):
        return kind, ALREADY_FP8
      if type(module).__call__ is not cls.__call__:
        return type(module).__name__, f"{type(module).__name__} overrides __call__"
      if kind != "Einsum" and not _is_plain_dot_cls(module.dot_general_cls) and (
          module.dot_general_cls is not None or module.dot_general is not None):
        return kind, ALREADY_FP8 if _is_fp8_dot_cls(module.dot_general_cls) \
            else "custom dot_general"
      return kind, CANDIDATE
  return None


def _linen_path(module: nn.Module) -> str:
  return "/".join(module.path)


def _example_init(model: nn.Module, args, kwargs):
  """jax.eval_shape of ``model.init`` on the example inputs (arrays / ShapeDtypeStructs
  traced, everything else static)."""
  kwargs = dict(kwargs)
  rngs = kwargs.pop("rngs", None)
  if rngs is None:
    key = jax.random.key(0)
    rngs = {"params": key, "dropout": key}
  leaves, treedef = jax.tree.flatten((args, kwargs))
  traced = [isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)) for x in leaves]
  dynamic = [x for x, t in zip(leaves, traced) if t]

  def init(rngs, dynamic):
    it = iter(dynamic)
    a, kw = jax.tree.unflatten(treedef, [next(it) if t else x for x, t in zip(leaves, traced)])
    return model.init(rngs, *a, **kw)

  return jax.eval_shape(init, rngs, dynamic)


def _discover_linen(model: nn.Module, args, kwargs) -> tuple[list[Gemm], Any]:
  """The GEMM layers one ``model.init`` on the example inputs reaches, and its variables'
  shapes."""
  found: dict[str, tuple[str, str, str, int]] = {}

  def record(next_fun, a, kw, context):
    m, name = context.module, "kernel"
    kind = _linen_kind(m) if context.method_name == "__call__" else None
    if context.method_name == "attend" and isinstance(m, nn.Embed):
      kind, name = ("Embed.attend", "embedding"), "embedding"
    y = next_fun(*a, **kw)
    if kind is None:
      return y
    path = _linen_path(m)
    inner = m.get_variable("params", name)  # the layer's own (unstacked) parameter
    entry = (kind[0], _dtype_name(m.dtype), kind[1], name, None if inner is None else inner.ndim)
    # a lifted wrapper (nn.remat(nn.Dense)) and the layer it runs share one path: keep the layer
    if path not in found or found[path][2] not in (CANDIDATE, ALREADY_FP8):
      found[path] = entry
    return y

  with nn.intercept_methods(record):
    shapes = _example_init(model, args, kwargs)
  params = shapes.get("params", {})
  gemms = []
  for path, (kind, dtype, status, name, ndim) in found.items():
    leaf = _lookup(params, path.split("/") + [name])
    stacked = () if leaf is None or ndim is None else tuple(leaf.shape[:leaf.ndim - ndim])
    gemms.append(Gemm(path, kind, dtype, stacked, status))
  return gemms, shapes


def _lookup(tree, keys):
  for k in keys:
    if not isinstance(tree, Mapping) or k not in tree:
      return None
    tree = tree[k]
  return tree


@contextlib.contextmanager
def _overriding(module: nn.Module, name: str, value):
  """`module`'s field `name` set to `value` for the duration (a bound module of this call)."""
  old = getattr(module, name)
  object.__setattr__(module, name, value)
  try:
    yield
  finally:
    object.__setattr__(module, name, old)


def _linen_interceptor(plan: Mapping[str, Recipe | None], amax_axes: tuple[str, ...],
                       root: int = 0):
  """Method interceptor running each planned linen GEMM with its recipe (None: as is).
  `root`: length of the converted module's own path (paths in `plan` are relative to it)."""

  def intercept(next_fun, args, kwargs, context):
    m = context.module
    kind = _linen_kind(m) if context.method_name == "__call__" else None
    if kind is None or kind[1] != CANDIDATE:
      return next_fun(*args, **kwargs)
    path = "/".join(m.path[root:])
    if path not in plan:
      raise ValueError(f"fp8jax.convert: the GEMM at {path!r} did not run when the model was "
                       "converted; convert with example inputs that reach it (a submodule run "
                       "through its own .apply names its layers from itself: not supported)")
    recipe = plan[path]
    if recipe is None:
      return next_fun(*args, **kwargs)
    if kind[0] == "Einsum":
      return flinen.einsum_forward(m, *args, recipe=recipe, amax_axes=amax_axes, **kwargs)
    fp8 = functools.partial(flinen.Fp8DotGeneral, recipe=recipe, amax_axes=amax_axes)
    with _overriding(m, "dot_general_cls", fp8):
      return next_fun(*args, **kwargs)

  return intercept


def _user_methods(base: type) -> list[str]:
  """Names of the public methods `base` and its bases below ``nn.Module`` define (the ones a
  caller may ``apply`` by name), and ``__call__``."""
  names = {"__call__"}
  for klass in base.__mro__:
    if not issubclass(klass, nn.Module) or klass is nn.Module:
      continue
    names.update(n for n, attr in vars(klass).items()
                 if not n.startswith("_") and n != "setup" and inspect.isfunction(attr))
  return sorted(names)


_INTERCEPTING = contextvars.ContextVar("fp8jax_convert_intercepting", default=False)


def _intercepted(method: Callable, plan, amax_axes) -> Callable:
  """`method` run under the FP8 interceptor (once: a converted method called from another
  runs inside the outer one's interceptor)."""
  @functools.wraps(method)  # keeps flax's method wrapper markers: not wrapped again
  def run(self, *args, **kwargs):
    if _INTERCEPTING.get():
      return method(self, *args, **kwargs)
    root = len(self.path) if self.scope is not None else 0  # also as a submodule
    token = _INTERCEPTING.set(True)
    try:
      with nn.intercept_methods(_linen_interceptor(plan, amax_axes, root)):
        return method(self, *args, **kwargs)
    finally:
      _INTERCEPTING.reset(token)
  return run


def _converted_linen_module(model: nn.Module, plan: Mapping[str, Recipe | None],
                            amax_axes: tuple[str, ...]) -> nn.Module:
  """A copy of `model` whose class runs ``__call__`` and its other public methods (``apply(...,
  method=name)``) under the FP8 interceptor."""
  base = type(model)
  methods = {name: _intercepted(getattr(base, name), plan, amax_axes)
             for name in _user_methods(base)}
  cls = type(base.__name__, (base,), {**methods, "__module__": base.__module__,
                                       "__qualname__": base.__qualname__, _PLAN_ATTR: plan})
  fields = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)
            if f.init and f.name != "parent"}
  return cls(parent=None, **fields)


def _convert_linen(model, recipe, level_name, rules, amax_axes, args, kwargs):
  if hasattr(type(model), _PLAN_ATTR):
    raise ValueError("convert: this linen model was converted already; convert the original")
  if not args and not kwargs:
    raise ValueError("convert: linen models need example inputs, e.g. convert(model, 'O1', x) "
                     "(arrays or jax.ShapeDtypeStruct; linen creates its layers while it runs)")
  gemms, shapes = _discover_linen(model, args, kwargs)
  kept = decide(gemms, rules, fp8=recipe is not None)
  report = _report(level_name, gemms, kept, recipe)
  if recipe is None or not report.converted:
    return model, report
  plan = {g.path: (recipe if kept[g.path] is None else None) for g in gemms}
  converted = _converted_linen_module(model, plan, amax_axes)
  try:
    new_shapes = _example_init(converted, args, kwargs)
  except flax_errors.ScopeCollectionNotFound as e:
    raise ValueError(
        f"convert: an FP8 GEMM runs where the collection {flinen.FP8_COLLECTION!r} cannot be "
        "created, usually under an nn.scan whose variable_axes do not list it; add "
        f"fp8jax.FP8_COLLECTION: 0 to that scan's variable_axes (the FP8 state is then stacked "
        f"on the layer axis like params; the unconverted model is unchanged by it). "
        f"flax said: {e}") from e
  _check_same_params(shapes.get("params", {}), new_shapes.get("params", {}))
  return converted, report


def _check_same_params(before, after) -> None:
  """Raises unless both params trees have the same paths, shapes and dtypes."""
  spec = lambda t: {jax.tree_util.keystr(p): (tuple(x.shape), jnp.dtype(x.dtype))
                    for p, x in jax.tree_util.tree_leaves_with_path(t)}
  if spec(before) != spec(after):
    a, b = spec(before), spec(after)
    diff = sorted(set(a.items()) ^ set(b.items()), key=str)[:6]
    raise ValueError(f"convert: the converted model's params differ from the model's: {diff}")


# --------------------------------------------------------------------------------------- NNX

def _nnx_kind(module: nnx.Module) -> tuple[str, str] | None:
  """(kind, status) of an NNX GEMM layer, None for other modules."""
  if isinstance(module, (fnnx.Linear, fnnx.Einsum)):
    return type(module).__name__, ALREADY_FP8
  for cls, custom, default in ((nnx.Linear, "dot_general", jax.lax.dot_general),
                               (nnx.Einsum, "einsum_op", jnp.einsum)):
    if isinstance(module, cls):
      if type(module) is not cls:
        return type(module).__name__, f"subclass {type(module).__name__}"
      if getattr(module, custom) is not default:
        return cls.__name__, f"custom {custom}"
      return cls.__name__, CANDIDATE
  if isinstance(module, nnx.LinearGeneral):
    return "LinearGeneral", "no FP8 LinearGeneral"
  if isinstance(module, nnx.Embed):
    return "Embed.attend", "embedding"
  return None


def _nnx_stacked(module: nnx.Module) -> tuple[int, ...]:
  """Leading axes of the module's parameters beyond the layer's own (nnx.vmap stacking)."""
  if isinstance(module, nnx.Embed):
    return tuple(module.embedding.shape[:-2])
  if isinstance(module, nnx.Einsum):
    return tuple(module.kernel.shape[:module.kernel.ndim - len(module.kernel_shape)])
  if isinstance(module, (nnx.Linear, nnx.LinearGeneral)):
    own = 2 if isinstance(module, nnx.Linear) else \
        len(module.in_features) + len(module.out_features)
    return tuple(module.kernel.shape[:module.kernel.ndim - own])
  return ()


def _discover_nnx(model: nnx.Module) -> tuple[list[Gemm], dict[str, nnx.Module]]:
  gemms, modules = [], {}
  for path, m in nnx.iter_modules(model):
    kind = _nnx_kind(m)
    if kind is None:
      continue
    p = "/".join(str(k) for k in path)
    gemms.append(Gemm(p, kind[0], _dtype_name(m.dtype), _nnx_stacked(m), kind[1]))
    modules[p] = m
  return gemms, modules


def _fp8_nnx_layer(old: nnx.Module, recipe: Recipe, amax_axes: tuple[str, ...]) -> nnx.Module:
  """The fp8jax.nnx layer for `old` holding `old`'s own Variables (nothing is allocated)."""
  common = dict(dtype=old.dtype, param_dtype=old.param_dtype, precision=old.precision,
                promote_dtype=old.promote_dtype,
                preferred_element_type=old.preferred_element_type,
                recipe=recipe, amax_axes=amax_axes)
  if isinstance(old, nnx.Linear):
    make = lambda: fnnx.Linear(old.in_features, old.out_features, use_bias=old.use_bias,
                               rngs=nnx.Rngs(0), **common)
  else:
    make = lambda: fnnx.Einsum(old.einsum_str, old.kernel_shape, old.bias_shape,
                               rngs=nnx.Rngs(0), **common)
  new = nnx.eval_shape(make)  # the structure only; every Variable is replaced below
  for name, value in vars(old).items():
    if not name.startswith("_pytree__") and name in vars(new):
      setattr(new, name, value)
  lead = _nnx_stacked(old)
  meta = jax.tree.map(lambda a: jnp.broadcast_to(a, lead + a.shape), init_dot_meta(recipe))
  new.fp8_meta = fnnx.Fp8State(meta)
  return new


def _replace_children(node, new_of: Mapping[int, nnx.Module], seen: set[int]) -> None:
  """Points every reference under `node` to an old layer at its replacement."""
  if id(node) in seen:
    return
  seen.add(id(node))
  for key, child in list(nnx.iter_children(node)):
    if id(child) in new_of:
      if isinstance(node, (MutableSequence, MutableMapping)):  # nnx.List / nnx.Dict / list
        node[key] = new_of[id(child)]
      else:
        setattr(node, key, new_of[id(child)])
    elif isinstance(child, (nnx.Module, MutableSequence, MutableMapping)):
      _replace_children(child, new_of, seen)


def _convert_nnx(model, recipe, level_name, rules, amax_axes):
  gemms, modules = _discover_nnx(model)
  kept = decide(gemms, rules, fp8=recipe is not None)
  report = _report(level_name, gemms, kept, recipe)
  if recipe is None:
    return model, report
  new_of = {id(modules[p]): _fp8_nnx_layer(modules[p], recipe, amax_axes)
            for p in report.converted}
  if id(model) in new_of:
    return new_of[id(model)], report
  _replace_children(model, new_of, set())
  left = ["/".join(map(str, p)) for p, m in nnx.iter_modules(model) if id(m) in new_of]
  if left:
    raise ValueError(f"convert: the layers at {left} are held where they cannot be replaced "
                     "(e.g. in a tuple); hold them in module attributes, nnx.List or nnx.Dict")
  return model, report
