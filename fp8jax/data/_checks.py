"""Argument checks shared by the data modules."""
from __future__ import annotations

import numpy as np


def check_positive(name: str, value, allow_none: bool = False) -> None:
  """Raises ValueError unless `value` is an integer >= 1 (or None when `allow_none`)."""
  if value is None and allow_none:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
    extra = " or None" if allow_none else ""
    raise ValueError(f"{name}={value!r} is not allowed; use an integer >= 1{extra}")
