"""fp8jax.parallel.sizing (the layouts of `fp8jax simulate --table`) against hand computation."""
import os

import pytest

from fp8jax import cli
from fp8jax.parallel import cost_inputs as ci, cost_model as cm, step_memory as sm
from fp8jax.parallel import sizing
from fp8jax.train import memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ, BATCH = 4096, 1024
M7 = memory.model_shape(cli.table_model("7B", SEQ))
H100 = cm.GPU_SPECS["H100-SXM"]


def _microbatch_seconds(m: int, tensor: int = 1, pipe: int = 1) -> float:
  """One microbatch of m sequences on one GPU at O3, by hand (cost_model's docstring)."""
  a = ci.Assumptions()
  flops = M7.flops_per_token(SEQ) * m * SEQ
  compute = flops / (989e12 * a.bf16_mfu) / a.fp8_speedup_large  # d_model 4096: 1.36x
  overhead = a.microbatch_overhead_s_per_param * M7.matmul_params * 4.8e12 / 3.35e12
  return (compute + overhead) / (tensor * pipe)


def test_table_models_are_the_named_llama_shapes():
  assert M7.n_layers == 32 and M7.d_model == 4096 and M7.d_ff == 11008 and M7.gated_mlp
  assert M7.params == pytest.approx(6.74e9, rel=0.01)  # LLaMA 2 7B
  m70 = memory.model_shape(cli.table_model("70B", SEQ))
  assert m70.params == pytest.approx(68.98e9, rel=0.01)  # LLaMA 2 70B (GQA, 8 kv heads)
  m175 = memory.model_shape(cli.table_model("175B", SEQ))
  assert m175.params == pytest.approx(174.6e9, rel=0.01)  # GPT-3's 96 x 12288
  with pytest.raises(cli.UsageError, match="'13B' is not one of"):
    cli.table_model("13B", SEQ)


def test_one_row_by_hand_7b_zero3_on_64_h100s():
  """7B, O3, ZeRO-3 over 64 data-parallel H100s, 16 sequences per GPU in one microbatch."""
  s = sizing.layout_step(M7, "H100-SXM", "O3", 3, sm.Layout(data=64), SEQ, BATCH, 16)
  a = ci.Assumptions()
  p, kernels, others = M7.params, M7.kernel_params, M7.other_params
  n, d = 16 * SEQ, 4096
  # memory: O3 persistent 5 B/param / 64; the backward holds f32 gradient and BF16 decoded
  # shards, 2 layers' E4M3 kernels, the largest kernel's f32 gradient, the activations
  meta = (32 * 5 + 1) * 3 * 17 * 4
  acts = 32 * n * d * 2 + n * (16 * d + 3 * 2 * 11008) * 2 + n * 32000 * 8
  backward = 4 * p / 64 + 2 * p / 64 + 2 * M7.layer_kernels + 4 * d * 2 * 11008 + acts
  update = 4 * p / 64 + 3 * p / 64
  assert backward > update
  assert s.memory.peak == pytest.approx(5 * p / 64 + meta + backward)
  assert s.fits == (s.memory.peak <= 0.9 * H100.hbm_bytes)
  # time: one microbatch, no bubble; ZeRO-3 reduce-scatters f32 gradients and gathers E4M3
  # kernels + BF16 others twice, over 50 GB/s per GPU between nodes at 0.8
  t = _microbatch_seconds(16)
  comm = 63 / 64 * (4 * p + 2 * (kernels + 2 * others)) / (50e9 * 0.8)
  update_s = 11 * p / 64 / (3.35e12 * a.fp8_optimizer_hbm_efficiency)
  assert (s.microbatches, s.bubble_s, s.tensor_comm_s, s.pipeline_comm_s) == (1, 0, 0, 0)
  assert s.compute_s == pytest.approx(t)
  assert s.data_comm_s == pytest.approx(comm)
  assert s.step_s == pytest.approx(t + comm + update_s)
  assert s.tokens_per_s == pytest.approx(BATCH * SEQ / s.step_s)
  assert s.mfu == pytest.approx(M7.flops_per_token(SEQ) * s.tokens_per_s / (64 * 989e12))


def test_tensor_and_pipeline_terms_by_hand():
  """tensor 2 x pipeline 4 x data 16 (128 GPUs), 4 sequences per microbatch, k = 16: the
  lockstep 1F1B's bubble is 2 x 3 microbatches (GPipe's 3), tensor all-reduces run over
  NVLink, pipeline sends between nodes."""
  s = sizing.layout_step(M7, "H100-SXM", "O3", 1, sm.Layout(16, 2, 4), SEQ, BATCH, 4)
  t = _microbatch_seconds(4, tensor=2, pipe=4)
  act = 4 * SEQ * 4096 * 2  # one microbatch's activations between layers, BF16
  assert s.microbatches == 16
  assert s.compute_s == pytest.approx(16 * t) and s.bubble_s == pytest.approx(6 * t)
  assert s.bubble_s / (s.compute_s + s.bubble_s) == pytest.approx(6 / (16 + 6))
  g = sizing.layout_step(M7, "H100-SXM", "O3", 1, sm.Layout(16, 2, 4, "gpipe"), SEQ, BATCH, 4)
  assert g.bubble_s == pytest.approx(3 * t)
  # 8 layers per stage x 6 all-reduces (remat) x 2 (T-1)/T x act over NVLink 450 GB/s
  assert s.tensor_comm_s == pytest.approx(16 * 8 * 6 * 2 * 0.5 * act / (450e9 * 0.8))
  assert s.pipeline_comm_s == pytest.approx(16 * 2 * act / (50e9 * 0.8))
  first = sm.device_memory(M7, "O3", 1, SEQ, 4, 16, sm.Layout(16, 2, 4))
  assert s.memory == first
  # the lockstep 1F1B keeps 2P - 1 = 7 stage inputs, and one backward slot's 8 layers
  assert first.backward["activations"] == 7 * act + sm.activation_bytes(M7, SEQ, 4, "O3", 2, 8)


def test_best_layout_is_the_fastest_that_fits_else_the_smallest():
  steps = sizing.candidates(M7, "H100-SXM", 64, "O3", SEQ, BATCH)
  best = sizing.best_layout(M7, "H100-SXM", 64, "O3", SEQ, BATCH)
  assert best.fits and best.step_s == min(s.step_s for s in steps if s.fits)
  assert any(not s.fits for s in steps)  # the search does meet settings that do not fit
  assert {s.zero_stage for s in steps} == {1, 3}
  assert {(s.layout.tensor, s.layout.pipeline) for s in steps} >= {(1, 1), (2, 4), (8, 8)}
  m70 = memory.model_shape(cli.table_model("70B", SEQ))
  none = sizing.best_layout(m70, "H100-SXM", 8, "O3", SEQ, BATCH)
  assert not none.fits
  assert none.memory.peak == min(s.memory.peak for s in sizing.candidates(
      m70, "H100-SXM", 8, "O3", SEQ, BATCH))
  # O3 runs at ZeRO >= 1 even when 0 is asked for
  assert {s.zero_stage for s in sizing.candidates(M7, "H100-SXM", 8, "O3", SEQ, BATCH,
                                                  stages=(0,))} == {1}


@pytest.mark.parametrize("call, match", [
    (lambda: sizing.layout_step(M7, "H100-SXM", "O3", 3, sm.Layout(data=64), SEQ, BATCH, 3),
     "global batch 1024 does not split into microbatches of 3 over 64"),
    (lambda: sizing.layout_step(M7, "H100-SXM", "O3", 3, sm.Layout(1, 3, 1), SEQ, BATCH, 1),
     "tensor=3 does not divide d_model=4096"),
    (lambda: sizing.layout_step(M7, "H100-SXM", "O3", 3, sm.Layout(1, 1, 64), SEQ, BATCH, 1),
     "pipeline=64 is not allowed for 32 layers"),
    (lambda: sm.Layout(data=0).check(), r"Layout.data=0 is not allowed"),
    (lambda: sm.Layout(schedule="zb").check(), r"Layout.schedule='zb' is not allowed"),
    (lambda: sizing.layout_step(M7, "T4", "O3", 3, sm.Layout(data=8), SEQ, BATCH, 1),
     "unknown GPU kind 'T4'"),
    (lambda: sizing.gpu_counts("8,x"), r"GPU count 'x' in '8,x' is not allowed"),
    (lambda: sizing.best_layout(M7, "H100-SXM", 3, "O3", SEQ, 1024),
     "no layout of 3 GPUs splits a global batch of 1024"),
])
def test_bad_input_names_the_value(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_cli_table_prints_every_model_count_and_level(capsys):
  argv = ["simulate", "--table", "--models", "7B,70B", "--gpus", "8,64"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| 7") and "GPUs" not in line]
  assert len(rows) == 2 * 2 * 2  # models x GPU counts x levels (O0, O3)
  assert "- 7B: 32 layers, d_model 4096, 32 heads (32 key/value), SwiGLU 11008" in out
  assert "global batch 1024 sequences x 4096 tokens" in out and "BF16 MFU 0.547" in out
  assert "| 70B | 8 | O3 |" in out and "| no (> 72) |" in out  # 70B does not fit 8 H100s
  assert cli.main(argv) == 0
  assert capsys.readouterr().out == out  # deterministic
  assert cli.main(["simulate", "--config", "x.yaml"]) == 2
  assert "simulate needs --cluster and --config (or --table)" in capsys.readouterr().err
  assert cli.main(["simulate", "--table", "--gpus", "0"]) == 2
  assert "GPU count '0' in '0' is not allowed" in capsys.readouterr().err


def test_readme_excerpt_is_what_the_command_prints(capsys):
  """Every row of docs/cli.md's `simulate --table` excerpt is a row of the default table."""
  readme = open(os.path.join(ROOT, "docs", "cli.md")).read()
  start = readme.index("fp8jax simulate --table [--models")
  excerpt = [line.strip() for line in readme[start:].split("\n\n")[1].splitlines()
             if line.strip().startswith("| 7B") or line.strip().startswith("| 70B")
             or line.strip().startswith("| 175B")]
  assert len(excerpt) >= 8
  assert cli.main(["simulate", "--table"]) == 0
  rows = set(capsys.readouterr().out.splitlines())
  assert [r for r in excerpt if r not in rows] == []
