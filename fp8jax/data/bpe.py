"""Training a byte-level BPE tokenizer (GPT-2's scheme) with Hugging Face ``tokenizers``.

The tokenizer splits text into words GPT-2's way, maps bytes to printable characters (so every
byte string is encodable, no unknown token) and learns merges up to `vocab_size` ids. Its one
special token is :data:`EOS_TOKEN` (id 0), which :mod:`fp8jax.data.tokenizer` picks as the
document separator.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from fp8jax.data._checks import check_positive
from fp8jax.data.files import iter_documents, source_files

EOS_TOKEN = "<|endoftext|>"
DEFAULT_TRAIN_BYTES = 4 << 20  # 4 MiB of text: a few seconds on two CPU cores
_MIN_VOCAB = len(pre_tokenizers.ByteLevel.alphabet()) + 1  # 256 bytes + EOS


def train_tokenizer(files=None, vocab_size: int = 4096, out_path: str | os.PathLike =
                    "tokenizer.json", *, max_bytes: int | None = DEFAULT_TRAIN_BYTES,
                    min_frequency: int = 2, progress: bool | None = None) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE tokenizer on text files and saves it as a ``tokenizer.json``.

  Args:
    files: a file, directory or glob, or a list of them (as ``data.source``); None: the
      standard library source corpus (:func:`fp8jax.data.stdlib_files`).
    vocab_size: ids in the trained vocabulary, >= 257 (256 bytes + EOS); fewer result when the
      text has too few pairs occurring `min_frequency` times.
    out_path: where to write the tokenizer (parent folders are made; an existing file is
      replaced); load it with ``data.tokenizer`` / ``load_data(tokenizer=...)``.
    max_bytes: text bytes read at most (in the files' order), >= 1; None: all.
    min_frequency: a pair is merged only if it occurs at least this often, >= 1.
    progress: show the trainer's progress (None: when stderr is a terminal).

  Returns:
    The trained ``tokenizers.Tokenizer`` (already saved at `out_path`).
  """
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < _MIN_VOCAB:
    raise ValueError(f"vocab_size={vocab_size!r} is not allowed; use an integer >= {_MIN_VOCAB} "
                     "(256 byte tokens + the end-of-text token)")
  check_positive("max_bytes", max_bytes, allow_none=True)
  check_positive("min_frequency", min_frequency)
  paths = source_files(files)
  tokenizer = tokenizers.Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=sys.stderr.isatty() if progress is None else progress)
  documents = (d.decode("utf-8", errors="replace") for d in iter_documents(paths, max_bytes))
  tokenizer.train_from_iterator(documents, trainer)
  out_path = Path(out_path)
  out_path.parent.mkdir(parents=True, exist_ok=True)
  tokenizer.save(str(out_path))
  return tokenizer
