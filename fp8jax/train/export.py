"""A run's trained weights in the Hugging Face layout: the newest (or a chosen) checkpoint of
a ``llama``-family run restored on one device and written by ``fp8jax.interop.hf``
(``fp8jax convert-hf RUN_DIR OUT_DIR``)."""
from __future__ import annotations

import os

import jax

from fp8jax.config import load_config
from fp8jax.interop import hf
from fp8jax.train import build
from fp8jax.train.resume import RunCheckpoints
from fp8jax.train.state import state_init_fn


def export_hf(run_dir: str, out_dir: str, *, step: int | None = None,
              dtype: str = "bfloat16", overwrite: bool = False) -> tuple[int, list[str]]:
  """Writes the checkpoint of `run_dir` (its newest, or `step`) as a Hugging Face LLaMA
  checkpoint in `out_dir` (tensors in `dtype`: float32, float16 or bfloat16; FP16 master
  weights decoded first). Returns (the checkpoint's step, the files written). ValueError:
  not a llama run, or no checkpoint."""
  config = load_config(os.path.join(run_dir, "config.yaml"))
  m = config.model
  if m.builder is not None or m.family != "llama":
    raise ValueError(f"{run_dir} trained model.family={m.family!r}"
                     + (f" (model.builder={m.builder!r})" if m.builder else "")
                     + "; the Hugging Face layout is written for the llama family")
  t, d = config.train, config.data
  run = build.run_model(config)
  model, _, tx = build.model_and_optimizer(config, run)
  init = state_init_fn(model, tx, config.level(), t.microbatch_size, d.seq_len, t.seed,
                       comm_scaling=config.parallel.grad_comm_scaling == "auto")
  abstract = jax.eval_shape(init)
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  restored = RunCheckpoints(config, run_dir).manager.restore(
      abstract, jax.tree.map(lambda _: one, abstract), step=step)
  if restored is None:
    raise ValueError(f"{run_dir} has no checkpoint to export (checkpoint.dir: "
                     f"{config.checkpoint.dir or os.path.join(run_dir, 'checkpoints')})")
  params = jax.device_get(restored.state.model_params())
  files = hf.save_pretrained(out_dir, run.model_config, params, dtype=dtype,
                             overwrite=overwrite)
  return restored.step, files


__all__ = ["export_hf"]
