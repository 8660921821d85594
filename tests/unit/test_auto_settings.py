"""The "auto" model settings: cuDNN attention where it runs, the remat policy and layer
unrolling chosen from the estimated step memory against fake device memories; CPUs keep XLA
attention, full remat and scanned layers."""
import dataclasses

import pytest

from fp8jax import parallel, xla_env
from fp8jax.config import Config, load_config
from fp8jax.hardware import DeviceReport, GiB, cudnn_attention_head_dim
from fp8jax.models.gpt import ModelConfig
from fp8jax.models.layers import attention_impl_for, cudnn_attention_reason
from fp8jax.train import build, memory

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
  """The config's terms of the memory model (fp8jax.parallel.step_memory.device_memory): the
  activations per remat policy and attention implementation (bf16, GELU), the state and
  gradients at O1 on one device, ZeRO-1's moments over 8."""
  cfg = _gpt_1_3b("train.opt_level=O1")
  m, s = cfg.model, cfg.train.microbatch_size
  n, d, f, layers = s * cfg.data.seq_len, m.d_model, m.d_ff, m.n_layers

  def act(policy, attention):
    return memory.step_memory(cfg, policy, attention).backward["activations"]
  assert act("save_gemm_outputs", "cudnn") - act("full", "cudnn") == \
      layers * n * (4 * d + f + d) * 2  # GEMM outputs and cuDNN attention's residuals
  assert act("save_gemm_outputs", "xla") - act("full", "xla") == layers * n * (4 * d + f) * 2
  assert act("save_gemm_io", "cudnn") - act("save_gemm_outputs", "cudnn") == \
      layers * n * (3 * d + f) * 1  # FP8 input casts
  assert act("full", "xla") - act("full", "cudnn") == s * m.n_heads * cfg.data.seq_len ** 2 * 8
  with pytest.raises(ValueError, match="remat_policy='auto' is not allowed"):
    memory.step_bytes(cfg, "auto", "xla")
  with pytest.raises(ValueError, match="attention_impl='flash' is not allowed"):
    memory.step_bytes(cfg, "full", "flash")
  with pytest.raises(ValueError, match="devices=0 is not allowed"):
    memory.step_bytes(cfg, "full", "xla", devices=0)
  params = memory.model_shape(m).params
  one = memory.step_memory(cfg, "full", "cudnn")
  # f32 master 4 + m 4 + v 4 (+ FP8 meta); f32 gradients, no accumulator for one microbatch
  assert sum(one.state.values()) == pytest.approx(12 * params, rel=1e-4)
  assert one.backward["gradients"] == 4 * params and "accumulator" not in one.backward
  two = memory.step_memory(_gpt_1_3b("train.opt_level=O1", "train.microbatches=2"), "full",
                           "cudnn")
  assert two.backward["accumulator"] == 4 * params
  # ZeRO stage 1 over 8 devices shards Adam's moments: 8 bytes/param at O1 -> 1 each
  sharded = memory.step_memory(dataclasses.replace(
      cfg, parallel=dataclasses.replace(cfg.parallel, zero_stage=1)), "full", "cudnn", 8)
  assert one.state["Adam moments"] - sharded.state["Adam moments"] == \
      pytest.approx(params * 8 * 7 / 8)
  assert memory.step_bytes(cfg, "full", "cudnn") == one.peak


def test_estimate_follows_the_step_the_config_builds():
  """Which step the config runs decides the terms: the fused O2 update on one device (unless
  train.fused_optimizer is false), ZeRO-3's per-layer gathers, the per-group step with FP8
  gradient communication or a device_map, FP8 emulated on devices without FP8 GEMMs."""
  o2 = _gpt_1_3b("train.opt_level=O2")
  shape = memory.model_shape(o2.model)
  k, o = shape.kernel_params, shape.other_params
  fused = memory.step_memory(o2, "full", "cudnn")
  assert fused.backward["gradients"] == 2 * k + 4 * o  # BF16 kernel gradients as they come
  assert fused.update["update temporaries"] == 0
  composed = memory.step_memory(_gpt_1_3b("train.opt_level=O2", "train.fused_optimizer=false"),
                                "full", "cudnn")
  assert composed.backward["gradients"] == 4 * (k + o) and composed.update[
      "update temporaries"] == 3 * (k + o)
  # ZeRO-3 over 8: 2 layers' E4M3 kernels gathered at a time, not the whole model
  z3 = memory.step_memory(_gpt_1_3b("train.opt_level=O3", "parallel.zero_stage=3"), "full",
                          "cudnn", devices=8)
  assert z3.backward["gathered weights"] == 2 * shape.layer_kernels
  assert z3.state["master weights"] == 2 * (k + o) / 8
  z1 = memory.step_bytes(_gpt_1_3b("train.opt_level=O3", "parallel.zero_stage=1"), "full",
                         "cudnn", devices=8)
  assert z3.peak < 0.5 * z1
  # the per-group step at ZeRO-3 runs layer-major: f32 gradient shards (its accumulator),
  # f32 decoded weight shards, E4M3 kernels of 2 layers gathered at a time
  local = memory.step_memory(_gpt_1_3b("train.opt_level=O3", "parallel.zero_stage=3",
                                        "parallel.grad_comm=fp8"), "full", "cudnn", devices=8)
  assert "accumulator" not in local.backward and "accumulator" not in z3.backward
  assert local.backward["decoded weights"] == 4 * (k + o) / 8
  assert local.backward["gathered weights"] == 2 * shape.layer_kernels
  # balanced (per-group counts): the same, with each slot's layer inputs (counts not known
  # before the devices are: twice the even share of microbatches, at most all of them)
  cfg = _gpt_1_3b("train.opt_level=O3", "parallel.zero_stage=3",
                  "parallel.device_map={H200: 1.0}")
  bal = memory.step_memory(cfg, "full", "cudnn", devices=8)
  assert memory.busiest_count(cfg, 8) == min(cfg.train.microbatches,
                                             2 * -(-cfg.train.microbatches // 8))
  assert bal.backward["gathered weights"] == 2 * shape.layer_kernels
  assert "gathered model" not in bal.backward
  emulated = memory.step_memory(o2, "full", "cudnn", emulated=True)
  assert emulated.backward["widened FP8 weight"] == 2 * shape.largest_kernel
  # choose_auto estimates an A100 (no FP8 GEMMs) with the widened weight: a memory between
  # the two estimates fits save_gemm_io on an H200, not on an A100
  est = memory.step_bytes(o2, "save_gemm_io", "cudnn", emulated=True)
  between = est - shape.largest_kernel  # the native estimate is 2 x largest_kernel less
  for report, policy in ((A100, "save_gemm_outputs"), (H200, "save_gemm_io")):
    choice = build.choose_auto(o2, [_with_memory(report, between)])
    assert choice.settings["remat_policy"] == policy, report


@pytest.mark.parametrize("path", ["configs/gpt_125m.yaml", "configs/gpt_1_3b.yaml",
                                  "configs/gpt_7b.yaml", "configs/llama_1b.yaml"])
@pytest.mark.parametrize("sets", [(), ("train.opt_level=O0",), ("train.opt_level=O3",
                                  "parallel.zero_stage=3"), ("train.microbatches=4",)])
def test_run_memory_counts_evaluation_and_probe_below_the_step(path, sets):
  """The auto remat policy reads the largest phase of the run (memory.run_bytes): evaluation
  and the FP8 probe run on the step's plan, so the step is the largest."""
  cfg = load_config(path, list(sets))
  for policy in ("full", "save_gemm_io"):
    phases = memory.phase_bytes(cfg, policy, "cudnn", devices=4)
    assert set(phases) == set(memory.PHASES[:2 + cfg.level().fp8_gemms])
    step = phases.pop("train step")
    assert step == memory.step_bytes(cfg, policy, "cudnn", devices=4)
    assert 0 < max(phases.values()) < step, phases
    assert memory.run_bytes(cfg, policy, "cudnn", devices=4) == step


def _mixed_pipeline(*overrides):
  """GPT 1.3B (24 layers) over 2 pipeline stages x 4 ranks, layers split by stage speed
  (H100 3x an A100), the 8 devices declared 4 x A100 (stage 0) + 4 x H100 (stage 1)."""
  return _gpt_1_3b("parallel.pipeline_parallel_size=2", "train.batch_size=32",
                   "train.microbatches=8", "parallel.zero_stage=1",
                   "parallel.device_map={A100: 1.0, H100: 3.0}",
                   "parallel.device_kinds=4xA100+4xH100", *overrides)


def test_remat_policy_estimate_follows_the_uneven_pipeline_split(monkeypatch):
  """pipeline_layers auto gives the A100 stage 6 of the 24 layers and the H100 stage 18 (the
  run's split, build.stage_layers of its mesh); every device holds the deepest stage's 18
  during the step. choose_auto estimates that stage, not an even 12 + 12: with memory between
  the two estimates of save_gemm_io it takes a policy that fits 18 layers. With only the
  reports (no mesh) it takes the deepest stage the split could give, here the same 18; with
  the mesh (given, or this run's when `devices` is None) the run's own split."""
  cfg = _mixed_pipeline()
  mesh = parallel.mesh_from_config(cfg.parallel)
  split = build.stage_layers(cfg, mesh, 24)
  assert split == (6, 18)
  args = ("cudnn", 8, True)  # 8 devices; the A100s emulate FP8 GEMMs
  even = memory.step_memory(cfg, "save_gemm_io", *args, pipeline_layers=(12, 12)).peak
  uneven = {p: memory.step_memory(cfg, p, *args, pipeline_layers=split).peak
            for p in ("save_gemm_io", "save_gemm_outputs")}
  assert uneven["save_gemm_outputs"] > 1.2 * even  # the deepest stage's 18 layers
  usable = (uneven["save_gemm_io"] + uneven["save_gemm_outputs"]) / 2
  a100 = _with_memory(A100._replace(device_count=4), usable)
  h100 = _with_memory(DeviceReport(1, "gpu", "NVIDIA H100 80GB HBM3", "9.0", 4), usable)
  monkeypatch.setattr(build, "run_reports", lambda devices=None: (a100, h100))
  for mesh_given in (None, mesh):
    for devices in ([a100, h100], None):  # None: this run's mesh (8 CPU devices)
      choice = build.choose_auto(cfg, devices, **({} if mesh_given is None else
                                                  {"mesh": mesh_given}))
      assert choice.settings["remat_policy"] == "save_gemm_outputs", (devices, mesh_given)
      assert choice.reasons["remat_policy"].startswith(
          f"estimated {uneven['save_gemm_outputs'] / GiB:.1f} GiB per device (deepest "
          "pipeline stage: 18 layers)"), choice.reasons
  assert memory.run_bytes(cfg, "save_gemm_outputs", *args, pipeline_layers=split) == \
      uneven["save_gemm_outputs"]  # (the step is the run's largest phase)
  # with the mesh the run's split, below the bound taken without it: stages A100/H100/H100/H100
  four = _mixed_pipeline("parallel.pipeline_parallel_size=4", "parallel.zero_stage=0",
                         "parallel.device_kinds=2xA100+6xH100")
  run = build.stage_layers(four, parallel.mesh_from_config(four.parallel), 24)
  assert run == (2, 8, 7, 7) and max(memory.stage_layers(four)) == 12
  assert build.estimate_stage_layers(four, [a100, h100]) == memory.stage_layers(four)
  assert build.estimate_stage_layers(four, [], parallel.mesh_from_config(four.parallel)) == run
  # without declared kinds, the reports' kinds bound it: one kind splits evenly
  plain = _gpt_1_3b("parallel.pipeline_parallel_size=2", "train.microbatches=2",
                    "parallel.device_map={A100: 1.0, H100: 3.0}")
  assert memory.stage_layers(plain) == (18, 6)  # (every kind of the device_map)
  assert memory.stage_layers(plain, [h100.device_kind]) is None
  assert build.estimate_stage_layers(plain, [a100, h100]) == (18, 6)
