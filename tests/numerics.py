"""Helpers of the numerical tests: a fresh seed per run (reported, or fixed with
FP8JAX_TEST_SEED) and the relative error against a reference."""
import os

import numpy as np


def fresh_seed(label: str) -> int:
  """A random seed (FP8JAX_TEST_SEED, if set), printed under `label` for a rerun."""
  seed = int(os.environ.get("FP8JAX_TEST_SEED", np.random.SeedSequence().entropy % (1 << 31)))
  print(f"{label}: seed {seed}")
  return seed


def rel_error(a, b) -> float:
  """||a - b|| / ||b|| in float64."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))
