"""A trained model for evaluation and generation: a run's checkpoint or a Hugging Face one, at
BF16 or an FP8 level (``fp8jax eval`` and ``fp8jax generate``).

:func:`load` opens ``RUN_DIR`` (a folder ``fp8jax train`` wrote: its ``config.yaml``, the
newest checkpoint or a chosen step, restored on one device without touching the folder, so a
run still training can be read) or ``hf:DIR`` (a Hugging Face LLaMA checkpoint,
``fp8jax.interop.hf``). :meth:`Loaded.at_level` builds the model at a level: O0 runs BF16
GEMMs; O1-O3 run FP8 GEMMs (the levels differ only in the optimizer) with the run's FP8 state
when its checkpoint has one, else with a fresh state (``fp8jax.linen.init_fp8_state``)
calibrated by forward passes over a few batches (``fp8jax.linen.calibrate_fp8``): no
gradient is computed. :func:`evaluate` gives the loss, perplexity and (byte-level models) bits
per byte over batches of a token source; :func:`generate_text` continues a prompt with the
KV-cache decoder (``fp8jax.models.decode``, gpt and llama families).

Text <-> ids (:class:`Codec`): a run's ``data.tokenizer`` (bytes when it has none), a Hugging
Face checkpoint's ``tokenizer.json``, or the one passed (``"bytes"``: byte-level ids). A
prompt is read as the start of a document: the separator the training data put between
documents (the NUL byte for bytes, the tokenizer's end- or beginning-of-sequence token) comes
first, and generation stops at the next one.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import data as data_lib
from fp8jax.checkpoint import CheckpointManager
from fp8jax.config import Config, load_config
from fp8jax.interop import hf
from fp8jax.linen import FP8_COLLECTION, calibrate_fp8, init_fp8_state
from fp8jax.models import decode
from fp8jax.models.family import family_of
from fp8jax.models.layers import Decoder
from fp8jax.recipe import Recipe, opt_level
from fp8jax.train import build
from fp8jax.train.loss import batch_loss
from fp8jax.train.resume import checkpoint_dir
from fp8jax.train.state import state_init_fn

HF_PREFIX = "hf:"
BYTES = "bytes"  # the tokenizer argument that means byte-level ids
DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class Codec:
  """Text <-> token ids of a model.

  Attributes:
    tokenizer: a ``tokenizers.Tokenizer``, or None for byte-level ids (UTF-8 bytes).
    path: where the tokenizer was read (None for bytes).
    separator: the id between documents (:data:`fp8jax.data.DOC_SEPARATOR` for bytes, the
      tokenizer's end- or beginning-of-sequence token), None when there is none.
  """

  tokenizer: Any = None
  path: str | None = None
  separator: int | None = data_lib.DOC_SEPARATOR

  @property
  def byte_level(self) -> bool:
    return self.tokenizer is None

  def encode(self, text: str) -> list[int]:
    """The ids of `text` (no special tokens added)."""
    if self.tokenizer is None:
      return list(text.encode("utf-8"))
    return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

  def decode(self, ids) -> str:
    """The text of `ids` (bytes that are not UTF-8, and byte-level ids >= 256, become U+FFFD)."""
    ids = [int(i) for i in ids]
    if self.tokenizer is None:
      return b"".join(bytes([i]) if i < 256 else b"\xff" for i in ids).decode(
          "utf-8", errors="replace")
    return self.tokenizer.decode(ids, skip_special_tokens=False)

  def describe(self) -> str:
    return "byte-level ids" if self.tokenizer is None else f"tokenizer {self.path}"


def codec_for(tokenizer: str | None) -> Codec:
  """The :class:`Codec` of `tokenizer`: None or "bytes" (byte-level), or a ``tokenizer.json``
  (or a folder holding one; FileNotFoundError naming it when missing)."""
  if tokenizer is None or tokenizer == BYTES:
    return Codec()
  tok = data_lib.load_tokenizer(tokenizer)
  sep = data_lib.document_separator(tok, tokenizer)
  return Codec(tok, os.fspath(tokenizer), sep.id)


@dataclasses.dataclass
class Loaded:
  """A trained model's weights and what they came with.

  Attributes:
    name: what was loaded, in words ("step 200 of runs/tiny", "hf:DIR").
    model_config: the family's config (None for a ``model.builder`` run).
    params: the model's parameters (f32 or the checkpoint's dtype), on one device.
    fp8: the checkpoint's FP8 collection, or None (O0 runs, Hugging Face checkpoints).
    run_level: the level the weights were trained at ("O0" for a Hugging Face checkpoint).
    recipe: the FP8 recipe of FP8 levels (the run's fp8 section, else fp8jax's default).
    config: the run's config (None for a Hugging Face checkpoint).
    tokenizer: the tokenizer the data was encoded with: a path, "bytes", or None when not
      known (a run on a ``.bin`` token file; a Hugging Face folder without tokenizer.json).
    tokenizer_source: where `tokenizer` comes from, in words (for messages).
    step: the checkpoint's step (None for a Hugging Face checkpoint).
    corpus: the data record of the checkpoint (``fp8jax.train.resume.corpus_record``: its
      fingerprint, description, contents), None when it has none.
  """

  name: str
  model_config: Any
  params: Any
  fp8: dict | None
  run_level: str
  recipe: Recipe
  config: Config | None
  tokenizer: str | None
  tokenizer_source: str
  step: int | None = None
  corpus: dict | None = None
  _run: Any = None

  def codec(self, tokenizer: str | None = None) -> Codec:
    """The :class:`Codec` of `tokenizer` when given (a path or "bytes"), else of the model's
    own tokenizer; ValueError (one line) when there is none, FileNotFoundError when its file
    is missing."""
    chosen = tokenizer if tokenizer is not None else self.tokenizer
    if chosen is None:
      raise ValueError(f"{self.name}: no tokenizer ({self.tokenizer_source}); pass "
                       f"--tokenizer PATH (a tokenizer.json), or --tokenizer {BYTES} for "
                       "byte-level ids")
    if chosen != BYTES and not os.path.exists(chosen):
      where = "" if tokenizer is not None else f" ({self.tokenizer_source})"
      raise FileNotFoundError(f"{self.name}: tokenizer {chosen!r}{where} does not exist; "
                              f"pass --tokenizer PATH, or --tokenizer {BYTES} for byte-level "
                              "ids")
    codec = codec_for(chosen)
    vocab = self.vocab_size
    if codec.byte_level and vocab is not None and vocab < data_lib.BYTE_VOCAB:
      raise ValueError(f"{self.name} has {vocab} token ids, too few for byte-level ids (256)")
    return codec

  @property
  def vocab_size(self) -> int | None:
    return getattr(self.model_config, "vocab_size", None)

  @property
  def max_seq_len(self) -> int | None:
    return getattr(self.model_config, "max_seq_len", None)

  def module(self, recipe: Recipe | None):
    """The model with FP8 GEMMs of `recipe` (None: BF16)."""
    if self._run is not None:
      return self._run.for_recipe(recipe)
    return family_of(self.model_config).model(self.model_config, recipe)

  def at_level(self, level: str | None = None, calibration: Iterable | None = None):
    """(model, variables, note) at `level` ("O0".."O3"; None: the run's). FP8 levels use the
    checkpoint's FP8 state when it has one, else a fresh one calibrated by forward passes over
    `calibration` (model inputs, e.g. int32[B, T] tokens; ValueError when None). `note` says
    where the FP8 state came from ("" at O0)."""
    name = self.run_level if level is None else opt_level(level).name
    if not opt_level(name).fp8_gemms:
      return self.module(None), {"params": self.params}, ""
    model = self.module(self.recipe)
    if self.fp8:
      return model, {"params": self.params, FP8_COLLECTION: self.fp8}, \
          f"FP8 scales of the {self.run_level} run's checkpoint"
    if calibration is None:
      raise ValueError(f"{self.name} has no FP8 state: {name} needs batches to calibrate on")
    if not isinstance(model, Decoder):
      raise ValueError(f"{self.name}: calibrating FP8 scales runs the gpt and llama families; "
                       f"evaluate this model at its run's level {self.run_level}")
    batches = iter(calibration)
    first = next(batches, None)
    if first is None:
      raise ValueError(f"{self.name}: no batch to calibrate FP8 scales on")
    fp8 = init_fp8_state(model, jax.ShapeDtypeStruct(np.shape(first), jnp.int32))
    count = [0]

    def counted():
      for batch in (first, *batches):
        count[0] += 1
        yield jnp.asarray(batch, jnp.int32)
    variables = calibrate_fp8(model, {"params": self.params, FP8_COLLECTION: fp8}, counted())
    passes = "1 forward pass" if count[0] == 1 else f"{count[0]} forward passes"
    return model, variables, f"FP8 scales calibrated on {passes}"


def _one_device(tree):
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda _: one, tree)


def load_run(run_dir: str, *, step: int | None = None, dtype: str | None = None) -> Loaded:
  """The newest checkpoint (or `step`) of the run in `run_dir`, restored on one device,
  read-only. `dtype`: the model's compute dtype instead of the run's. ValueError (one line):
  not a run folder, no checkpoint, no such step."""
  path = os.path.join(run_dir, "config.yaml")
  if not os.path.isfile(path):
    what = "does not exist" if not os.path.exists(run_dir) else "holds no config.yaml"
    raise ValueError(f"{run_dir} {what}: pass a run folder that fp8jax train wrote (it holds "
                     f"config.yaml and checkpoints/), or {HF_PREFIX}DIR for a Hugging Face "
                     "checkpoint")
  config = load_config(path)
  if dtype is not None:
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, dtype=dtype))
  t, d = config.train, config.data
  run = build.run_model(config)
  model, _, tx = build.model_and_optimizer(config, run)
  init = state_init_fn(model, tx, config.level(), t.microbatch_size, d.seq_len, t.seed,
                       comm_scaling=config.parallel.grad_comm_scaling == "auto")
  directory = checkpoint_dir(config, run_dir)
  steps = []
  if os.path.isdir(directory):
    manager = CheckpointManager(directory, read_only=True)
    steps = manager.steps()
  if not steps:
    raise ValueError(f"{run_dir} has no checkpoint in {directory}: train with "
                     "checkpoint.checkpoint_every_n_steps > 0 (a run saves at its end too)")
  if step is not None and step not in steps:
    raise ValueError(f"{run_dir} has no checkpoint of step {step}; its steps: "
                     f"{', '.join(map(str, steps))}")
  abstract = jax.eval_shape(init)
  fallback = (manager.metadata(step) or {}).get("bf16_fallback")
  if fallback:  # the run went on with BF16 GEMMs: its checkpoints hold no FP8 state
    abstract = abstract._replace(fp8={})
  restored = manager.restore(abstract, _one_device(abstract), step=step)
  if restored is None:
    raise ValueError(f"no checkpoint of {run_dir} could be read (all damaged)")
  state = restored.state
  level = config.level()
  if d.is_bin:
    tokenizer, source = None, f"it was trained on the token file {d.source}"
  else:
    tokenizer = d.tokenizer if d.tokenizer is not None else BYTES
    source = f"the run's data.tokenizer, {run_dir}/config.yaml"
  return Loaded(f"step {restored.step} of {run_dir}", run.model_config,
                state.model_params(), dict(state.fp8) or None, level.name,
                level.recipe if level.recipe is not None else config.fp8.recipe(), config,
                tokenizer, source, restored.step, restored.meta.get("corpus"), run)


def load_hf(path: str, *, dtype: str | None = None) -> Loaded:
  """The Hugging Face LLaMA checkpoint in folder `path` (its ``tokenizer.json`` when there is
  one); `dtype`: the compute dtype (default bfloat16). ValueError (one line) when `path` is
  not such a checkpoint."""
  if not os.path.isdir(path):
    raise ValueError(f"{HF_PREFIX}{path}: no such folder; pass a Hugging Face LLaMA "
                     "checkpoint folder (config.json and model.safetensors)")
  overrides = {} if dtype is None else {"dtype": dtype}
  config, params = hf.load_pretrained(path, **overrides)
  params = jax.device_put(params, jax.devices()[0])
  tokenizer = os.path.join(path, "tokenizer.json")
  has_tokenizer = os.path.isfile(tokenizer)
  return Loaded(f"{HF_PREFIX}{path}", config, params, None, "O0", Recipe(), None,
                tokenizer if has_tokenizer else None,
                f"{path} holds no tokenizer.json" if not has_tokenizer else
                f"{path}/tokenizer.json")


def load(spec: str, *, step: int | None = None, dtype: str | None = None) -> Loaded:
  """:func:`load_hf` of ``hf:DIR``, else :func:`load_run` of the run folder `spec`."""
  if dtype is not None and dtype not in DTYPES:
    raise ValueError(f"dtype={dtype!r} is not allowed; use one of {list(DTYPES)}")
  if spec.startswith(HF_PREFIX):
    if step is not None:
      raise ValueError(f"--step is for run folders; {spec} has one set of weights")
    return load_hf(spec[len(HF_PREFIX):], dtype=dtype)
  return load_run(spec, step=step, dtype=dtype)


# ----------------------------------------------------------------------------- evaluation

@dataclasses.dataclass(frozen=True)
class EvalResult:
  """Attributes:
    loss: mean cross entropy, nats per token, over every predicted token.
    tokens: tokens predicted.
    batches: batches evaluated.
    bits_per_byte: loss / ln 2 for byte-level tokens (one token is one byte), else None.
  """

  loss: float
  tokens: int
  batches: int
  bits_per_byte: float | None = None

  @property
  def perplexity(self) -> float:
    """exp(loss)."""
    return math.exp(self.loss)


@functools.lru_cache(maxsize=8)
def _loss_sum(model):
  """Jitted ``(variables, batch int32[B, T+1]) -> summed next-token loss`` of `model`."""
  @jax.jit
  def loss_sum(variables, batch):
    return batch_loss(model.apply, variables, batch) * batch[:, 1:].size
  return loss_sum


def evaluate(model, variables, batches: Iterable, *, byte_level: bool = False) -> EvalResult:
  """Next-token loss of `model` over `batches` (int32[B, T+1] each: inputs ``[:, :-1]``,
  targets ``[:, 1:]``), forward passes only, jitted once per model and batch shape.
  `byte_level`: report bits per byte (tokens are bytes). ValueError when there is no
  batch."""
  loss_sum = _loss_sum(model)
  total, tokens, count = 0.0, 0, 0
  for batch in batches:
    batch = jnp.asarray(batch, jnp.int32)
    total += float(loss_sum(variables, batch))
    tokens += int(batch[:, 1:].size)
    count += 1
  if count == 0:
    raise ValueError("evaluate: no batch to evaluate on")
  loss = total / tokens
  return EvalResult(loss, tokens, count, loss / math.log(2) if byte_level else None)


@dataclasses.dataclass
class EvalData:
  """Batches of a token source for :func:`evaluate` and FP8 calibration.

  Attributes:
    data: the loaded source (``fp8jax.data.TokenData``).
    batch_size, seq_len: the batches' shape, int32[batch_size, seq_len + 1].
    byte_level: whether the ids are bytes of text.
  """
  data: Any
  batch_size: int
  seq_len: int
  byte_level: bool

  def available(self, split: str) -> int:
    """Batches of `split` that fit without reading a window twice."""
    it = self.data.batches(split, self.batch_size, self.seq_len, shuffle=False)
    return it.windows_per_epoch // self.batch_size

  def batches(self, split: str, count: int) -> list[np.ndarray]:
    """The first `count` batches of `split`, in order (the same every time)."""
    it = self.data.batches(split, self.batch_size, self.seq_len, shuffle=False)
    return [it.next() for _ in range(count)]


def eval_data(loaded: Loaded, source: str | None, *, tokenizer: str | None = None,
              batch_size: int | None = None, seq_len: int | None = None,
              max_bytes: int | None = None, val_fraction: float | None = None,
              cache_dir: str | None = None) -> EvalData:
  """The token source `source` (None: the run's ``data.source``; a built-in corpus name, text
  files or a ``.bin``) as :class:`EvalData` for `loaded`: text encoded by `tokenizer` or the
  model's own (:meth:`Loaded.codec`); defaults from the run's config (its data.max_bytes,
  val_fraction, cache_dir and seq_len, train.microbatch_size), else 32 MiB, 0.05, 8
  sequences of min(max_seq_len, 1024) tokens. ValueError (one line) for what does not fit."""
  run = loaded.config
  if source is None:
    if run is None:
      raise ValueError(f"{loaded.name}: pass --data SOURCE (stdlib, site-packages, text "
                       "files or a .bin)")
    source = run.data.source
  d = run.data if run is not None else None
  seq_len = seq_len or (d.seq_len if d else min(loaded.max_seq_len or 1024, 1024))
  if loaded.max_seq_len is not None and seq_len > loaded.max_seq_len:
    raise ValueError(f"--seq-len {seq_len} is longer than {loaded.name}'s max_seq_len="
                     f"{loaded.max_seq_len}")
  batch_size = batch_size or (run.train.microbatch_size if run else 8)
  is_bin = str(source).endswith(".bin")
  codec = None if is_bin else loaded.codec(tokenizer)
  max_bytes = max_bytes or (d.max_bytes if d else data_lib.DEFAULT_MAX_BYTES)
  tokens = data_lib.load_data(
      source, val_fraction=val_fraction if val_fraction is not None else
      (d.val_fraction if d else 0.05), max_bytes=max_bytes, vocab_size=loaded.vocab_size,
      tokenizer=None if codec is None or codec.byte_level else codec.path,
      cache_dir=cache_dir or (d.cache_dir if d else None), progress=False)
  return EvalData(tokens, int(batch_size), int(seq_len), codec is not None and codec.byte_level)


# ----------------------------------------------------------------------------- generation

@dataclasses.dataclass(frozen=True)
class Generated:
  """Attributes:
    text: the continuation (decoded new tokens, up to the separator).
    tokens: the new token ids (up to the separator).
    stopped: True when generation met the document separator.
  """
  text: str
  tokens: list[int]
  stopped: bool


def prompt_ids(codec: Codec, prompt: str, vocab_size: int | None = None) -> np.ndarray:
  """int32[1, P]: the document separator (when `codec` has one), then `prompt`'s ids.
  ValueError (one line) for an empty result or an id the model (`vocab_size` ids) lacks."""
  ids = codec.encode(prompt)
  if codec.separator is not None:
    ids = [codec.separator] + ids
  if not ids:
    raise ValueError("the prompt is empty and the tokenizer has no document separator to "
                     "start from; pass some text")
  if vocab_size is not None and max(ids) >= vocab_size:
    raise ValueError(f"the prompt holds token id {max(ids)}, beyond the model's "
                     f"{vocab_size} ids: {codec.describe()} does not fit this model")
  return np.asarray([ids], np.int32)


def generate_text(model, variables, codec: Codec, prompt: str, *, max_new_tokens: int = 64,
                  temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> Generated:
  """Continues `prompt` (:func:`prompt_ids`) with :func:`fp8jax.models.decode.generate`
  (`seed`: the draws' ``jax.random`` key); the text ends before the first separator."""
  decode.check_decoder(model)
  ids = prompt_ids(codec, prompt, model.config.vocab_size)
  tokens, _ = decode.generate(model, variables, ids,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, key=jax.random.key(seed))
  new = [int(t) for t in np.asarray(tokens)[0]]
  stopped = codec.separator is not None and codec.separator in new
  if stopped:
    new = new[:new.index(codec.separator)]
  return Generated(codec.decode(new), new, stopped)


__all__ = ["BYTES", "Codec", "EvalData", "EvalResult", "Generated", "HF_PREFIX", "Loaded",
           "codec_for", "eval_data", "evaluate", "generate_text", "load", "load_hf",
           "load_run", "prompt_ids"]
