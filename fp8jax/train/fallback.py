"""The switch to BF16 GEMMs when FP8 diverges: the BF16 loss the divergence watchdog
(``fp8jax.train.guards.DivergenceWatchdog``) compares the FP8 step's loss with, and the
record of a switch (log line, metrics, ``events.jsonl``, and checkpoint metadata through the
run's records)."""
from __future__ import annotations

import json
import logging
import os
from typing import Callable

import jax
import jax.numpy as jnp

from fp8jax.train.state import TrainState
from fp8jax.train.loss import batch_loss
from fp8jax.train.step import scan_microbatches

logger = logging.getLogger("fp8jax")


class Bf16Loss:
  """``(params, batch int32[n m, T+1]) -> mean loss`` of `model` (a BF16 model: no FP8
  state) with `params` as a ``TrainState`` holds them (FP16 master weights are decoded inside
  the program, GEMM weights to `matrix_dtype` when given, as the train step reads them) over the
  batch's n microbatches of `microbatch_size` sequences, averaged as the train step averages
  its loss (the step's microbatch loop, :func:`fp8jax.train.step.scan_microbatches`, without
  gradients); one jitted program per n."""

  def __init__(self, model, microbatch_size: int, matrix_dtype=None):
    self.model, self.microbatch_size = model, microbatch_size
    self.matrix_dtype = matrix_dtype
    self._jitted: dict[int, Callable] = {}

  def __call__(self, params, batch) -> jax.Array:
    n = batch.shape[0] // self.microbatch_size
    if n not in self._jitted:
      apply, matrix_dtype = self.model.apply, self.matrix_dtype

      def bf16_loss(params, batch):
        params = TrainState(jnp.zeros((), jnp.int32), params, {}, ()).model_params(matrix_dtype)
        # The loop's "gradients" are an empty tree: it sums and averages the losses alone.
        loss_only = lambda none, part: (batch_loss(apply, {"params": params}, part), none)
        return scan_microbatches(loss_only, {"params": {}}, batch, n)[0]
      self._jitted[n] = jax.jit(bf16_loss)
    return self._jitted[n](params, batch)


def record_fallback(reason: str, step: int, run_dir: str, writer) -> None:
  """Says that the run switched to BF16 GEMMs after optimizer step `step`: a warning, a line
  on stdout, ``bf16_fallback: 1`` in the metrics and an event in `run_dir`/events.jsonl."""
  logger.warning(reason)
  print(f"fp8jax train: {reason}")
  writer.write(step, {"bf16_fallback": 1.0})
  with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
    f.write(json.dumps({"step": step, "event": "bf16_fallback", "reason": reason}) + "\n")


__all__ = ["Bf16Loss", "record_fallback"]
