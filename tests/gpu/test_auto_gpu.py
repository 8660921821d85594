"""GPU facts of the "auto" model settings (sm_89+ only; skipped elsewhere): cuDNN flash
attention chosen and compiled, and the analytic step-memory estimate against the compiled
Trainer step's memory analysis."""
import re

import jax
import numpy as np
import pytest

import fp8jax
import fp8jax.hardware
from fp8jax.config import load_config
from fp8jax.models import GPT, ModelConfig, init_model
from fp8jax.models.layers import attention_impl_for
from fp8jax.train import batch_loss, build, memory
from fp8jax.train.loop import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(fp8jax.native_fp8_reason() is not None,
                                 reason="needs GPUs with FP8 GEMMs (sm_89+)")]


def test_auto_attention_is_cudnn_flash_attention():
  cfg = ModelConfig(d_model=256, n_layers=2, n_heads=2, d_ff=1024, max_seq_len=256)
  assert cfg.attention_impl == "auto" and attention_impl_for(cfg) == "cudnn"
  variables = init_model(cfg, None, jax.random.key(0), 4, 256)
  batch = jax.random.randint(jax.random.key(np.random.randint(1 << 30)), (4, 257), 0, 256)

  def loss(model):
    return lambda v: batch_loss(model.apply, v, batch)

  f = jax.jit(jax.value_and_grad(loss(GPT(cfg))))
  hlo = f.lower(variables).compile().as_text()
  assert re.search(r'custom_call_target="[^"]*fmha[^"]*"', hlo), "no cuDNN attention"
  value, _ = f(variables)
  ref = loss(GPT(cfg.replace(attention_impl="xla")))(variables)
  assert abs(float(value) - float(ref)) < 1e-2 * abs(float(ref))


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_estimate_bounds_the_compiled_step(tmp_path, level):
  """The 1.3B layer shape on 4 layers, B8 x T2048: for each remat policy the compiled
  Trainer step needs at most 1.1x the estimate (it errs high) and at least half of it."""
  ratios = {}
  policies = ("full", "save_gemm_outputs") + (("save_gemm_io",) if level != "O0" else ())
  for policy in policies:
    cfg = load_config("configs/gpt_1_3b.yaml", [
        "model.n_layers=4", f"train.opt_level={level}", f"model.remat_policy={policy}",
        "model.scan_layers=false", "data.max_bytes=4000000",
        f"runtime.run_dir={tmp_path}/{{name}}"])
    trainer = Trainer(cfg, progress=False)
    assert trainer.config.model.attention_impl == "cudnn"
    step = trainer.compiled_step(1)
    m = step.jitted.lower(trainer.state, *step.place(trainer.next_batch(0))).compile() \
        .memory_analysis()
    compiled = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)
    ratios[policy] = compiled / memory.step_bytes(trainer.config, policy, "cudnn")
    del trainer, step
  assert all(0.5 < r < 1.1 for r in ratios.values()), ratios


@pytest.mark.skipif((fp8jax.hardware.local_report().memory_bytes or 0) < 60 * 2**30,
                    reason="needs an 80 GB-class GPU")
def test_this_gpu_chooses_the_fastest_measured_1_3b_settings():
  choice = build.choose_auto(load_config("configs/gpt_1_3b.yaml", ["train.opt_level=O2"]))
  assert choice.settings == {"attention_impl": "cudnn", "remat_policy": "save_gemm_io",
                             "scan_layers": False}, choice.lines()
