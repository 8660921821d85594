"""The switch to BF16 GEMMs when FP8 diverges: the BF16 loss the divergence watchdog
(``fp8jax.train.guards.DivergenceWatchdog``) compares the FP8 step's loss with, and the
record of a switch (log line, metrics, ``events.jsonl``, and checkpoint metadata through the
run's records)."""
from __future__ import annotations

import json
import logging
import os

import jax

logger = logging.getLogger("fp8jax")


class Bf16Loss:
  """``(state, batch int32[n m, T+1]) -> mean loss`` of the run's model with BF16 GEMMs on
  `state`'s parameters, over the batch's n microbatches of the train step's size (numpy, the
  same on every process; n at most the step's count), averaged as the train step averages its
  loss.

  Args:
    eval_step: the BF16 model's evaluation step (``fp8jax.train.evaluation.EvalStep``, made by
      ``fp8jax.train.build.eval_step``): the train step's memory plan (microbatches, ZeRO-3
      gathers, shardings, pipeline stages), so the loss needs no more memory than the step.
  """

  def __init__(self, eval_step):
    self.eval_step = eval_step

  def __call__(self, state, batch) -> jax.Array:
    loss_sum, tokens = self.eval_step(state, batch)
    return loss_sum / tokens


def record_fallback(reason: str, step: int, run_dir: str, writer) -> None:
  """Says that the run switched to BF16 GEMMs after optimizer step `step`: a warning, a line
  on stdout, ``bf16_fallback: 1`` in the metrics and an event in `run_dir`/events.jsonl."""
  logger.warning(reason)
  print(f"fp8jax train: {reason}")
  writer.write(step, {"bf16_fallback": 1.0})
  with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
    f.write(json.dumps({"step": step, "event": "bf16_fallback", "reason": reason}) + "\n")


__all__ = ["Bf16Loss", "record_fallback"]
