"""The "auto" model settings: cuDNN attention where it runs, the remat policy and layer
unrolling chosen from the estimated step memory against fake device memories; CPUs keep XLA
attention, full remat and scanned layers."""
import dataclasses

import pytest

from fp8jax import xla_env
from fp8jax.config import Config, load_config
from fp8jax.hardware import DeviceReport, cudnn_attention_head_dim
from fp8jax.models.gpt import ModelConfig
from fp8jax.models.layers import attention_impl_for, cudnn_attention_reason
from fp8jax.train import build, memory

GiB = 2**30
H200 = DeviceReport(0, "gpu", "NVIDIA H200", "9.0", 1, 100 * GiB)
A100 = DeviceReport(0, "gpu", "NVIDIA A100-SXM4-80GB", "8.0", 1, 60 * GiB)
V100 = DeviceReport(0, "gpu", "Tesla V100-SXM2-16GB", "7.0", 1, 12 * GiB)
CPU = DeviceReport(0, "cpu", "cpu", None, 1)


def _gpt_1_3b(*overrides):
  return load_config("configs/gpt_1_3b.yaml", list(overrides))


def _with_memory(report, usable_bytes):
  """`report` whose device lets a chosen step fill `usable_bytes`."""
  return report._replace(memory_bytes=int(usable_bytes / build.MEMORY_FRACTION))


@pytest.mark.parametrize("platform,cc,head_dim", [
    ("gpu", "7.0", None), ("gpu", "8.0", 128), ("gpu", "8.9", 128), ("gpu", "9.0", 256),
    ("gpu", "10.0", 256), ("gpu", "gfx90a", None), ("gpu", None, None), ("cpu", "9.0", None),
])
def test_cudnn_attention_head_dim(platform, cc, head_dim):
  assert cudnn_attention_head_dim(DeviceReport(0, platform, "x", cc, 1)) == head_dim


@pytest.mark.parametrize("device,changes,supported", [
    (H200, {}, True),
    (A100, {}, True),
    (V100, {}, False),                                     # sm 7.0
    (CPU, {}, False),
    (DeviceReport(0, "gpu", "AMD Instinct MI250X", "gfx90a", 1), {}, False),  # not CUDA
    (H200, dict(dtype="float32"), False),                  # cuDNN: bf16 / fp16 only
    (H200, dict(d_model=1024, n_heads=4), True),           # head dim 256 from sm 9.0
    (A100, dict(d_model=1024, n_heads=4), False),          # ... at most 128 before
    (H200, dict(d_model=2048, n_heads=4), False),          # 512
    (H200, dict(d_model=200, n_heads=2), False),           # 100: not a multiple of 8
])
def test_cudnn_attention_reason(device, changes, supported):
  cfg = ModelConfig(**changes)
  why = cudnn_attention_reason(cfg, device)
  assert (why is None) == supported, why
  auto = cfg.replace(attention_impl="auto")
  assert attention_impl_for(auto, device) == ("cudnn" if supported else "xla")
  for pinned in ("xla", "cudnn"):  # explicit values are kept whatever the device
    assert attention_impl_for(cfg.replace(attention_impl=pinned), device) == pinned


def test_auto_is_the_default_and_resolves_on_this_cpu():
  assert Config().model.attention_impl == ModelConfig().attention_impl == "auto"
  assert Config().model.remat_policy == Config().model.scan_layers == "auto"
  assert attention_impl_for(ModelConfig()) == "xla"  # this process's CPU
  cfg = load_config("configs/tiny.yaml")
  choice = build.choose_auto(cfg)
  assert choice.settings == {"attention_impl": "xla", "remat_policy": "full",
                             "scan_layers": True}
  resolved = build.resolve_auto(cfg)
  m = resolved.model
  assert (m.attention_impl, m.remat_policy, m.scan_layers) == ("xla", "full", True)
  assert build.resolve_auto(resolved) is resolved  # nothing left to choose
  line, = choice.lines()
  assert "model.attention_impl=xla (no cuDNN on cpu)" in line and "XLA_FLAGS" not in line


def test_remat_policy_is_the_least_recomputing_that_fits():
  """Fake device memories placed between the estimates of the candidates: each picks the
  first candidate (save_gemm_io, save_gemm_outputs, full) whose estimate fits."""
  cfg = _gpt_1_3b("train.opt_level=O2")
  est = {p: memory.step_bytes(cfg, p, "cudnn")
         for p in ("full", "save_gemm_outputs", "save_gemm_io")}
  assert est["full"] < est["save_gemm_outputs"] < est["save_gemm_io"]
  cases = [(est["save_gemm_io"] * 1.01, "save_gemm_io", False),
           ((est["save_gemm_io"] + est["save_gemm_outputs"]) / 2, "save_gemm_outputs", False),
           ((est["save_gemm_outputs"] + est["full"]) / 2, "full", True),
           (est["full"] * 0.5, "full", True)]  # nothing fits: the least memory
  for usable, policy, scan in cases:
    choice = build.choose_auto(cfg, [_with_memory(H200, usable)])
    assert choice.settings == {"attention_impl": "cudnn", "remat_policy": policy,
                               "scan_layers": scan}, (usable / GiB, choice)
    assert choice.apply(cfg).model.remat_policy == policy
  assert "even with full remat" in build.choose_auto(
      cfg, [_with_memory(H200, est["full"] * 0.5)]).reasons["remat_policy"]


def test_o0_never_saves_the_bf16_inputs():
  cfg = _gpt_1_3b("train.opt_level=O0")
  choice = build.choose_auto(cfg, [_with_memory(H200, 1000 * GiB)])
  assert choice.settings["remat_policy"] == "save_gemm_outputs"


def test_a_7b_o2_step_on_an_h200_keeps_full_remat_scanned():
  """The shipped 7B config at O2 on one H200 at XLA's default memory share: only full remat
  fits the estimate (the saving policies need ~110 GiB and more)."""
  h200 = H200._replace(memory_bytes=None)  # the kind's memory x XLA's default share
  choice = build.choose_auto(load_config("configs/gpt_7b.yaml"), [h200])
  assert choice.settings == {"attention_impl": "cudnn", "remat_policy": "full",
                             "scan_layers": True}


def test_scan_layers_auto():
  big = _with_memory(H200, 1000 * GiB)
  # remat off: no policy applies, layers unrolled
  choice = build.choose_auto(_gpt_1_3b("model.remat=false"), [big])
  assert choice.settings["remat_policy"] == "full" and choice.settings["scan_layers"] is False
  # too many layers to unroll (compile time)
  deep = _gpt_1_3b(f"model.n_layers={build.UNROLL_MAX_LAYERS + 1}")
  assert build.choose_auto(deep, [big]).settings["scan_layers"] is True
  # a pinned full remat policy keeps the scan; a pinned saving one unrolls
  assert build.choose_auto(_gpt_1_3b("model.remat_policy=full"), [big]).settings == {
      "attention_impl": "cudnn", "scan_layers": True}
  assert build.choose_auto(_gpt_1_3b("model.remat_policy=save_gemm_outputs"),
                           [big]).settings["scan_layers"] is False


def test_pinned_settings_are_kept(monkeypatch):
  cfg = _gpt_1_3b("model.attention_impl=xla", "model.remat_policy=save_gemm_outputs",
                  "model.scan_layers=true")
  monkeypatch.setattr(xla_env, "_APPLIED", ())
  choice = build.choose_auto(cfg, [H200])
  assert choice.settings == {} and choice.lines() == []
  assert build.resolve_auto(cfg, [H200]) is cfg
  # on GPUs the start log also names the XLA flags fp8jax set, pinned settings or not
  monkeypatch.setattr(xla_env, "_APPLIED", ("--xla_gpu_enable_triton_gemm=false",))
  line, = build.choose_auto(cfg, [H200]).lines()
  assert line.startswith("XLA_FLAGS += --xla_gpu_enable_triton_gemm=false")
  assert build.choose_auto(cfg, [CPU]).lines() == []


def test_every_process_gets_one_choice():
  """Reports of two processes: cuDNN only if both run it; memory of the smallest device."""
  cfg = _gpt_1_3b("train.opt_level=O2", "parallel.zero_stage=1")
  v100 = V100._replace(process_index=1, memory_bytes=H200.memory_bytes)
  assert build.choose_auto(cfg, [H200, v100]).settings["attention_impl"] == "xla"
  a100 = A100._replace(process_index=1)
  est = memory.step_bytes(cfg, "save_gemm_io", "cudnn", devices=2)
  roomy, tight = _with_memory(H200, est * 1.01), _with_memory(a100, est * 0.99)
  assert build.choose_auto(cfg, [roomy, roomy._replace(process_index=1)]).settings[
      "remat_policy"] == "save_gemm_io"
  choice = build.choose_auto(cfg, [roomy, tight])
  assert choice.settings["remat_policy"] == "save_gemm_outputs"
  assert choice.settings["attention_impl"] == "cudnn"


def test_unknown_device_memory_keeps_full_remat():
  gpu = DeviceReport(0, "gpu", "NVIDIA Future GPU", "12.0", 1, None)
  choice = build.choose_auto(_gpt_1_3b(), [gpu])
  assert choice.settings["remat_policy"] == "full"
  assert choice.reasons["remat_policy"] == "device memory unknown"


def test_bad_devices_are_refused():
  with pytest.raises(ValueError, match=r"devices=\['H200'\] is not allowed; use DeviceReports"):
    build.choose_auto(_gpt_1_3b(), ["H200"])
  with pytest.raises(ValueError, match="devices=.. is not allowed"):
    build.choose_auto(_gpt_1_3b(), [])


def test_estimate_terms():
  """The estimate's policy terms as the module docstring writes them (bf16, GELU)."""
  cfg = _gpt_1_3b("train.opt_level=O1")
  m, n = cfg.model, cfg.train.microbatch_size * cfg.data.seq_len
  d, f, layers = m.d_model, m.d_ff, m.n_layers
  full = memory.activation_bytes(cfg, "full", "cudnn", cfg.train.microbatch_size)
  outputs = memory.activation_bytes(cfg, "save_gemm_outputs", "cudnn",
                                    cfg.train.microbatch_size)
  io = memory.activation_bytes(cfg, "save_gemm_io", "cudnn", cfg.train.microbatch_size)
  assert outputs - full == layers * n * (4 * d + f + d) * 2
  assert io - outputs == layers * n * (3 * d + f) * 1  # FP8 input casts
  xla = memory.activation_bytes(cfg, "full", "xla", cfg.train.microbatch_size)
  assert xla - full == cfg.train.microbatch_size * m.n_heads * cfg.data.seq_len ** 2 * 8
  with pytest.raises(ValueError, match="remat_policy='auto' is not allowed"):
    memory.activation_bytes(cfg, "auto", "xla", 1)
  # ZeRO stage 1 over 8 devices shards Adam's moments: 8 bytes/param at O1 -> 1 each
  one = memory.state_bytes(cfg, devices=1)
  sharded = memory.state_bytes(dataclasses.replace(
      cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=1)), devices=8)
  params = sum(memory.param_counts(m))
  assert one - sharded == pytest.approx(params * 8 * 7 / 8)
