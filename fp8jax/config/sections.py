"""The seven sections of a config (``model``, ``data``, ``train``, ``fp8``, ``parallel``,
``checkpoint``, ``runtime``) and the train section's ``batch_ramp``: one frozen dataclass each,
its keys with their defaults and value rules, and the checks that involve several keys of one
section. The ``model`` and ``fp8`` sections mirror the objects they configure
(``fp8jax.models.gpt.ModelConfig``, ``fp8jax.Recipe``; see
:func:`fp8jax.config.validation._mirror`). Rules across sections are
:class:`fp8jax.config.cross_section.Config`'s.
"""
from __future__ import annotations

import dataclasses
import re

from fp8jax.config.validation import (_NAME, _NONEMPTY, _Rule, _Section, _between, _fail,
                                      _field, _ge, _gt, _levels, _mirror, _one_of, _reworded)
from fp8jax.interop import hf
from fp8jax.models.family import FAMILIES, family as model_family
from fp8jax.models.gpt import ModelConfig
from fp8jax.recipe import LEVELS, OptLevel, Recipe, format_name, opt_level

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
  fp8_health_every: int = _field(50, _ge(0))  # FP8 cast-health probe, fp8/loss_gap; 0: none
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
  # Layers each stage runs: "auto" (in proportion to each stage's speed from device_map, its
  # slowest device's kind; even without device_map or when the stages are alike), "even", or
  # a list of one count >= 1 per stage summing to the layers (fp8jax.parallel.pipeline).
  pipeline_layers: str | list = "auto"
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
  # saturated values and doubled after `grad_comm_growth_interval` clean steps, default
  # fp8jax.parallel.collectives.GROWTH_INTERVAL; the state is part of the train state and its
  # checkpoints).
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
    layers = self.pipeline_layers
    if not (layers in ("auto", "even") or (
        isinstance(layers, (list, tuple)) and len(layers) == self.pipeline_parallel_size
        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in layers))):
      _fail(f"parallel.pipeline_layers={layers!r} is not allowed; use 'auto', 'even' or a list "
            f"of {self.pipeline_parallel_size} layer counts >= 1, one per pipeline stage")
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
  persistent compilation cache (``fp8jax.train.compiles``) and the run's traced programs
  beside it (``fp8jax.train.program_cache``): "auto" (the folder
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
