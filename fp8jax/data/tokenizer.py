"""Hugging Face ``tokenizers`` tokenizers: loading, vocabulary size, document separator.

A tokenizer is a ``tokenizer.json`` file (``tokenizers.Tokenizer.from_file``). Text is encoded
without the tokenizer's own special-token template (``add_special_tokens=False``); documents are
delimited by one token chosen by :func:`document_separator`:
  1. the ``eos_token`` of a ``tokenizer_config.json`` next to the file, else its ``bos_token``
     (Hugging Face's own record of them), when that token is in the vocabulary;
  2. else the first of :data:`EOS_TOKENS` in the vocabulary, else the first of
     :data:`BOS_TOKENS`;
  3. else none: documents are concatenated (each still encoded on its own).
An end-of-sequence token goes *after* each document (GPT-2's convention), a beginning-of-
sequence token *before* each (LLaMA's).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import tokenizers

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[SEP]")
BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>", "<|bos|>", "[CLS]")


class Separator(NamedTuple):
  """The token that delimits documents: its text, id and place ("after" each document for an
  end-of-sequence token, "before" for a beginning-of-sequence one); all None when there is none."""
  token: str | None
  id: int | None
  place: str | None


NO_SEPARATOR = Separator(None, None, None)


def load_tokenizer(path: str | os.PathLike) -> tokenizers.Tokenizer:
  """The tokenizer saved at `path` (a ``tokenizer.json``); clear errors for a missing or
  unreadable file."""
  path = Path(path)
  if path.is_dir() and (path / "tokenizer.json").is_file():
    path = path / "tokenizer.json"
  if not path.is_file():
    raise FileNotFoundError(f"tokenizer {str(path)!r} does not exist; pass a tokenizer.json file "
                            "(a Hugging Face tokenizers file, e.g. from fp8jax.data."
                            "train_tokenizer) or a folder holding one")
  try:
    return tokenizers.Tokenizer.from_file(str(path))
  except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
    raise ValueError(f"tokenizer {str(path)!r} is not a Hugging Face tokenizer.json: {e}") from None


def tokenizer_file(path: str | os.PathLike) -> Path:
  """The ``tokenizer.json`` that `path` names (the file itself or a folder holding one)."""
  path = Path(path)
  return path / "tokenizer.json" if path.is_dir() else path


def tokenizer_vocab_size(tokenizer: tokenizers.Tokenizer) -> int:
  """Number of token ids: the largest id (added tokens included) + 1."""
  return max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1


def _config_token(value) -> str | None:
  """A tokenizer_config.json token entry (a string or {"content": ...}) as its text."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) and value else None


def document_separator(tokenizer: tokenizers.Tokenizer, path: str | os.PathLike | None = None
                       ) -> Separator:
  """The separator of the module docstring; `path` is the tokenizer's file (for its
  ``tokenizer_config.json``)."""
  candidates = []
  if path is not None:
    config = tokenizer_file(path).parent / "tokenizer_config.json"
    if config.is_file():
      entries = json.loads(config.read_text())
      candidates += [(_config_token(entries.get("eos_token")), "after"),
                     (_config_token(entries.get("bos_token")), "before")]
  candidates += [(t, "after") for t in EOS_TOKENS] + [(t, "before") for t in BOS_TOKENS]
  for token, place in candidates:
    if token is not None and tokenizer.token_to_id(token) is not None:
      return Separator(token, tokenizer.token_to_id(token), place)
  return NO_SEPARATOR
