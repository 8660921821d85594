"""Token sources -> deterministic, resumable batches of int32[B, T+1] (inputs + targets).

One concept per module:
  - :mod:`~fp8jax.data.files`: text sources (files, directories, globs; the built-in stdlib
    and site-packages corpora);
  - :mod:`~fp8jax.data.binfile`: ``.bin`` token files (nanoGPT's uint16, llm.c's uint16/uint32);
  - :mod:`~fp8jax.data.tokenizer`: Hugging Face tokenizers and the document separator;
  - :mod:`~fp8jax.data.tokencache`: text encoded once into a cached token file;
  - :mod:`~fp8jax.data.bpe`: training a byte-level BPE tokenizer (:func:`train_tokenizer`);
  - :mod:`~fp8jax.data.corpus`: :func:`load_data` -> :class:`TokenData` (train/val split);
  - :mod:`~fp8jax.data.batches`: :class:`BatchIterator` (exact ``state()`` / ``restore()``).
"""
from fp8jax.data.batches import BatchIterator
from fp8jax.data.binfile import BIN_DTYPE, BinWriter, bin_layout, load_bin, token_dtype, write_bin
from fp8jax.data.bpe import DEFAULT_TRAIN_BYTES, EOS_TOKEN, train_tokenizer
from fp8jax.data.corpus import TokenData, load_data
from fp8jax.data.files import (BUILTIN_SOURCES, BYTE_VOCAB, DEFAULT_MAX_BYTES, DOC_SEPARATOR,
                               iter_documents, read_documents, resolve_files,
                               site_packages_files, site_packages_roots, source_files,
                               stdlib_files)
from fp8jax.data.tokencache import CachedTokens, cache_key, cached_tokens, default_cache_dir
from fp8jax.data.tokenizer import (Separator, document_separator, load_tokenizer,
                                   tokenizer_vocab_size)

__all__ = [
    "BIN_DTYPE", "BUILTIN_SOURCES", "BYTE_VOCAB", "BatchIterator", "BinWriter", "CachedTokens",
    "DEFAULT_MAX_BYTES", "DEFAULT_TRAIN_BYTES", "DOC_SEPARATOR", "EOS_TOKEN", "Separator",
    "TokenData", "bin_layout", "cache_key", "cached_tokens", "default_cache_dir",
    "document_separator", "iter_documents", "load_bin", "load_data", "load_tokenizer",
    "read_documents", "resolve_files", "site_packages_files", "site_packages_roots",
    "source_files", "stdlib_files", "token_dtype", "tokenizer_vocab_size", "train_tokenizer",
    "write_bin",
]
