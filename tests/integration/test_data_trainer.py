"""The Trainer on text encoded by a tokenizer (data.tokenizer): it trains on the tokenizer's
ids, and a model vocabulary smaller than the tokenizer's is refused before any compile."""
import math
import os

import numpy as np
import pytest

from fp8jax import data
from fp8jax.config import load_config
from fp8jax.train.loop import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "configs", "tiny.yaml")
VOCAB = 384


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
  path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
  data.train_tokenizer(None, VOCAB, path, max_bytes=100_000)
  return path


def _config(tmp_path, tokenizer, vocab):
  return load_config(TINY, [
      "data.source=stdlib", f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp_path}/cache",
      "data.max_bytes=200000", "data.seq_len=32", f"model.vocab_size={vocab}",
      "model.n_layers=1", "train.steps=2", "train.warmup_steps=0", "train.batch_size=4",
      "train.eval_every=0", "train.log_every=1", "train.opt_level=O0",
      f"runtime.run_dir={tmp_path}/{{name}}"])


def test_trainer_trains_on_tokenizer_ids(tmp_path, tokenizer):
  trainer = Trainer(_config(tmp_path, tokenizer, VOCAB), progress=False)
  assert trainer.data.vocab_size == VOCAB and trainer.data.cache_path.parent == tmp_path / "cache"
  assert trainer.data.tokens.max() >= 256  # merged tokens, not bytes
  batch = trainer.train_batches.next()
  assert batch.shape == (4, 33) and batch.max() < VOCAB
  trainer.train_batches.restore({**trainer.train_batches.state(), "position": 0})
  result = trainer.run()
  assert np.isfinite(result["loss"]) and abs(result["loss"] - math.log(VOCAB)) < 1.0


def test_trainer_refuses_a_model_vocab_below_the_tokenizers(tmp_path, tokenizer):
  with pytest.raises(ValueError, match=rf"vocab_size=300 is too small for tokenizer .*: it has "
                                       rf"{VOCAB} token ids; use a model vocab_size >= {VOCAB}"):
    Trainer(_config(tmp_path, tokenizer, 300), progress=False)
