import dataclasses
import json
import os

import pytest

from fp8jax import cli, hardware
from fp8jax.models.gpt import ModelConfig, flops_per_token, matmul_param_count
from fp8jax.parallel import cost_inputs as ci, cost_model as cm, step_memory as sm
from fp8jax.parallel.balance import KindProfile
from fp8jax.parallel.pipeline import split_layers as pipeline_split
from fp8jax.train import memory

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_7B = os.path.join(ROOT, "configs", "gpt_7b.yaml")
# 7B shape of configs/gpt_7b.yaml without reading YAML
BIG_CONFIG = ModelConfig(vocab_size=256, d_model=4096, n_layers=32, n_heads=32, d_ff=11008,
                         max_seq_len=2048, mlp="swiglu", remat=True)
SMALL_CONFIG = ModelConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=2, d_ff=256,
                           max_seq_len=8, mlp="gelu", remat=False)
BIG, SMALL = memory.model_shape(BIG_CONFIG), memory.model_shape(SMALL_CONFIG)
MID = memory.model_shape(BIG_CONFIG.replace(n_layers=8))  # the 7B layer shape, 1.6B parameters
MIXED = "8xA100-80GB+8xH100-SXM"


def test_parse_cluster_groups_order_and_defaults():
  c = cm.parse_cluster(MIXED)
  assert c.groups == (("A100-80GB", 8), ("H100-SXM", 8))
  assert c.gpus == 16 and c.gpus_per_node == 8 and c.inter_node_bw == 50e9
  assert c.kinds()[:8] == ("A100-80GB",) * 8 and c.kinds()[8:] == ("H100-SXM",) * 8
  assert c.describe() == MIXED
  assert cm.parse_cluster(" 2 x h200 + 1XNVIDIA H100 80GB HBM3").groups == (
      ("H200", 2), ("H100-SXM", 1))


@pytest.mark.parametrize("text, match", [
    ("", "empty"),
    ("A100-80GB", "not COUNTxKIND"),
    ("8xH100-SXM+", "not COUNTxKIND"),
    ("0xH100-SXM", "count 0"),
    ("8xFOO", r"unknown GPU kind 'FOO'.*'A100-40GB'.*'H200'"),
    ("8xA100", "A100-40GB or A100-80GB"),
])
def test_parse_cluster_rejects_bad_strings(text, match):
  with pytest.raises(ValueError, match=match):
    cm.parse_cluster(text)


def test_gpu_spec_reads_jax_device_kinds_and_matches_metrics_peaks():
  assert hardware.gpu_spec("NVIDIA H100 80GB HBM3").name == "H100-SXM"
  assert hardware.gpu_spec("NVIDIA H100 PCIe").name == "H100-PCIe"
  assert hardware.gpu_spec("NVIDIA A100-SXM4-80GB").name == "A100-80GB"
  assert hardware.gpu_spec("NVIDIA A100-SXM4-40GB").name == "A100-40GB"
  assert hardware.gpu_spec("NVIDIA H200").name == "H200"
  for name in ("A100-40GB", "A100-80GB", "H100-SXM", "H100-PCIe", "H200", "H800", "L40S",
               "B200"):
    spec = hardware.GPU_SPECS[name]
    assert spec.bf16_flops == hardware.peak_flops(name, False)
    assert (spec.fp8_flops is None) == name.startswith("A100")
  assert hardware.GPU_SPECS["H100-PCIe"].fp8_flops == 1513e12
  with pytest.raises(ValueError, match="known kinds"):
    hardware.gpu_spec("NVIDIA GH200 480GB")


def test_peak_flops_read_device_kinds():
  assert hardware.peak_flops("NVIDIA H100 80GB HBM3", True) == 1979e12
  assert hardware.peak_flops("NVIDIA H100 PCIe", False) == 756e12
  assert hardware.peak_flops("NVIDIA GH200 480GB", False) == 989e12
  assert hardware.peak_flops("NVIDIA A100-SXM4-80GB", True) == 312e12  # no FP8: BF16's
  assert hardware.peak_flops("NVIDIA L4", True) == 242e12
  assert hardware.peak_flops("NVIDIA L40", False) is None  # not an L4
  assert hardware.peak_flops("cpu", False) is None
  assert hardware.fp8_native("NVIDIA L40S") and not hardware.fp8_native("A100-80GB")


def test_model_shape_matches_the_model_config_arithmetic():
  for cfg in (BIG_CONFIG, SMALL_CONFIG, SMALL_CONFIG.replace(tie_embeddings=True)):
    shape = memory.model_shape(cfg)
    assert shape.matmul_params == matmul_param_count(cfg)
    for seq_len in (1, 8, 2048):
      assert shape.flops_per_token(seq_len) == flops_per_token(cfg, seq_len)
  tied = memory.model_shape(SMALL_CONFIG.replace(tie_embeddings=True))
  assert tied.kernel_params == SMALL.kernel_params - 64 * 256  # the LM head is the embedding
  assert tied.other_params == SMALL.other_params


def test_memory_model_by_hand():
  kernels, others = SMALL.kernel_params, SMALL.other_params
  assert kernels == 2 * (4 * 64 * 64 + 2 * 64 * 256) + 64 * 256  # layers + LM head
  assert others == 256 * 64 + 2 * 2 * 64 + 64                   # embedding + norms
  assert SMALL.layer_kernels == 4 * 64 * 64 + 2 * 64 * 256 and SMALL.head_kernels == 64 * 256
  assert SMALL.largest_kernel == 64 * 256  # fc_in / fc_out, above qkv's 64 x 192
  p = kernels + others
  a = ci.Assumptions()
  act = 2 * 34 * 16 * 64 + 16 * 256 * 8  # no remat: 34 d B/token/layer + f32 logits, grad
  assert sm.activation_bytes(SMALL, 8, 2) == act
  remat = memory.model_shape(SMALL_CONFIG.replace(remat=True))
  assert sm.activation_bytes(remat, 8, 2) == 2 * 16 * 64 * 2 + 16 * (16 * 64 + 3 * 256) * 2 + \
      16 * 256 * 8
  meta = 9 * 3 * 17 * 4  # 2 layers x 4 GEMMs + the LM head; 3 roles x (scale + 16 amaxes) f32
  n = 4

  def mem(level, stage, **kw):
    return sm.device_memory(SMALL, level, stage, 8, 2, layout=sm.Layout(data=n), a=a, **kw)
  # O0, stage 0: f32 master + m + v = 12 B/param; with the f32 gradients 16 (docs/architecture.md, Levels)
  o0 = mem("O0", 0)
  assert sum(o0.state.values()) == 12 * p
  assert sum(o0.state.values()) + o0.backward["gradients"] == 16 * p
  # the update phase (gradients + the all-reduce's output) is larger than the backward's
  assert o0.update == {"gradients": 4 * p, "update temporaries": 0.0,
                       "all-reduce output": 4 * p}
  assert o0.peak == 12 * p + 8 * p
  # O2 persistent: FP16 master 2 + E4M3 m 1 + FP16 v 2 = 5 B/param before sharding
  o2 = mem("O2", 0)
  assert o2.state == {"master weights": 2 * p, "Adam moments": 3 * p, "FP8 meta": meta}
  assert o2.backward == {"gradients": 4 * p, "decoded weights": 2 * p,
                         "FP8 weight casts": kernels, "activations": act}
  assert o2.peak == 5 * p + meta + (4 + 3 + 4) * p
  # ZeRO-1 over 4: m, v and the update's temporaries / 4
  assert mem("O2", 1).state["Adam moments"] == 3 * p / n
  assert mem("O2", 1).update["update temporaries"] == 3 * p / n
  # ZeRO-3 at O2 over 4: the state / 4, f32 gradient and decoded shards, 2 layers' E4M3
  # kernels and the largest kernel's f32 gradient in flight (not the gathered model)
  z3 = mem("O2", 3)
  assert sum(z3.state.values()) == 5 * p / n + meta
  assert z3.backward == {"gradients": 4 * p / n, "decoded weights": 2 * p / n,
                         "gathered weights": 2 * SMALL.layer_kernels,
                         "weight gradient in flight": 4 * 64 * 256, "activations": act}
  assert z3.update == {"gradients": 4 * p / n, "update temporaries": 3 * p / n}
  assert z3.peak == pytest.approx(5 * p / n + meta + max(sum(z3.backward.values()), 7 * p / n))
  # O0 gathers its kernels in BF16; a second microbatch adds an f32 accumulator (/4 from 2)
  assert mem("O0", 3).backward["gathered weights"] == 2 * 2 * SMALL.layer_kernels
  assert sm.device_memory(SMALL, "O2", 2, 8, 2, 3, sm.Layout(data=n), a).backward[
      "accumulator"] == 4 * p / n
  # the per-group (balanced) step decodes the master to f32; at stage 3 it runs layer-major:
  # shards in, 2 layers' E4M3 kernels and one layer's f32 gradients in flight, the reduced
  # gradient shards its only accumulator, and activations: each slot's input to each of the
  # 2 layers plus the last output and its gradient (n d c each), one layer's working set and
  # one microbatch's logits; below 3 its gradients stay whole with an f32 accumulator
  for slots in (1, 3):
    local = mem("O2", 3, local_grads=True, slots=slots)
    assert local.backward == {"gradients": 4 * p / n, "decoded weights": 4 * p / n,
                              "gathered weights": 2 * SMALL.layer_kernels,
                              "weight gradient in flight": 4 * SMALL.layer_kernels,
                              "activations": slots * (2 + 2) * 16 * 64 * 2
                              + sm.activation_bytes(SMALL, 8, 2, "O2", layers=0)}
    assert local.state == z3.state and local.update == z3.update
  local1 = mem("O2", 1, local_grads=True)
  assert local1.backward == {"gradients": 4 * p, "accumulator": 4 * p, "decoded weights": 4 * p,
                             "FP8 weight casts": kernels, "activations": act}
  # one GPU at O2, stage 0: the fused update (one microbatch: BF16 kernel gradients, no
  # update temporaries); with it off, f32 gradients and the composed update's temporaries
  one = sm.device_memory(SMALL, "O2", 0, 8, 2, a=a)
  assert one.backward["gradients"] == 2 * kernels + 4 * others
  assert one.update == {"gradients": 2 * kernels + 4 * others, "update temporaries": 0.0}
  composed = sm.device_memory(SMALL, "O2", 0, 8, 2, a=a, fused_update=False)
  assert composed.backward["gradients"] == 4 * p
  assert composed.update == {"gradients": 4 * p, "update temporaries": 3 * p}
  # XLA attention: one layer's f32 scores and probabilities (2 sequences x 2 heads x T^2)
  xla = dataclasses.replace(SMALL, attention_impl="xla")
  assert sm.activation_bytes(xla, 8, 2) - act == 2 * 2 * 8 * 8 * 8 * 2  # every layer: no remat
  # an emulating kind (A100) widens the largest FP8 kernel to BF16
  assert mem("O2", 3, emulated=True).backward["widened FP8 weight"] == 2 * 64 * 256
  assert "widened FP8 weight" not in mem("O0", 3, emulated=True).backward


def test_pipeline_and_tensor_memory_by_hand():
  """Every stage (one program) holds its stored layers' share and the shared variables
  (embedding, LM head) whole, tensor ranks their kernels' share; a stage keeps one input per
  microbatch in flight (the lockstep 1F1B's ring of 2 x `pipeline` - 1, GPipe's all k) and
  one backward slot's saved layer inputs. Uneven stages: the step terms cover the deepest
  stage's layers, the state stays the stored L / P."""
  m = memory.model_shape(BIG_CONFIG)
  d, c, n_tok = 4096, 2, 2 * 2048
  a = ci.Assumptions()
  whole = sm.device_memory(m, "O2", 1, 2048, 2, 8, sm.Layout(data=2), a)
  piped = sm.device_memory(m, "O2", 1, 2048, 2, 8, sm.Layout(data=2, tensor=2, pipeline=4), a)
  layer = m.layer_kernels / 2 + m.layer_others
  held = 8 * layer + m.embedding + m.head_kernels
  assert piped.state["master weights"] == 2 * held
  assert whole.state["master weights"] == 2 * m.params
  assert piped.backward["gradients"] == 4 * held == piped.backward["accumulator"]
  kept = n_tok * d * c  # one stage input per microbatch in flight
  one_slot = sm.activation_bytes(m, 2048, 2, "O2", tensor=2, layers=8, in_flight=1)
  assert piped.backward["activations"] == 7 * kept + one_slot
  gpipe = sm.device_memory(m, "O2", 1, 2048, 2, 8, sm.Layout(2, 2, 4, "gpipe"), a)
  assert gpipe.backward["activations"] == 8 * kept + one_slot  # all 8 microbatches
  # without a pipeline the schedule does not matter: one microbatch at a time
  assert sm.device_memory(m, "O2", 1, 2048, 2, 8, sm.Layout(2, 2, 1, "gpipe"), a) == \
      sm.device_memory(m, "O2", 1, 2048, 2, 8, sm.Layout(2, 2, 1), a)
  assert piped.peak < whole.peak / 4
  # uneven stages (32 layers as 5 + 5 + 5 + 17): the state of the stored 8 layers, the step's
  # accumulator, slot gradients, casts and saved activations over 17, plus the padded copy
  uneven = sm.device_memory(m, "O2", 1, 2048, 2, 8, sm.Layout(2, 2, 4, "1f1b", (5, 5, 5, 17)),
                            a)
  assert uneven.state == piped.state and uneven.update == piped.update
  wide = 17 * layer + m.embedding + m.head_kernels
  assert uneven.backward["accumulator"] == 4 * wide
  assert uneven.backward["slot gradients"] == 2 * wide
  assert uneven.backward["padded layers"] == 2 * 17 * layer
  assert uneven.backward["FP8 weight casts"] == 17 * m.layer_kernels / 2 + m.head_kernels
  assert uneven.backward["activations"] == 7 * kept + sm.activation_bytes(
      m, 2048, 2, "O2", tensor=2, layers=17, in_flight=1)
  assert "padded layers" not in sm.device_memory(
      m, "O2", 1, 2048, 2, 8, sm.Layout(2, 2, 4, "1f1b", (8, 8, 8, 8)), a).backward
  for bad, match in (((5, 5, 22), "3 layer counts|4 layer counts"), ((5, 5, 5, 5), "sums to 20")):
    with pytest.raises(ValueError, match=match):
      sm.device_memory(m, "O2", 1, 2048, 2, 8, sm.Layout(2, 2, 4, "1f1b", bad), a)


def test_o2_needs_less_memory_than_o0():
  a = ci.Assumptions()
  o0 = sm.device_memory(BIG, "O0", 3, 2048, 1, layout=sm.Layout(data=4), a=a)
  o2 = sm.device_memory(BIG, "O2", 3, 2048, 1, layout=sm.Layout(data=4), a=a)
  assert sum(o2.state.values()) < 0.45 * sum(o0.state.values())
  assert o2.peak < o0.peak
  # at ZeRO-1 over 4 GPUs only O2's state leaves room for a microbatch
  four = cm.parse_cluster("4xA100-80GB")
  assert not cm.predict(four, BIG, 2048, 8, "O0", 1).uniform.feasible
  assert cm.predict(four, BIG, 2048, 8, "O2", 1).uniform.feasible
  # one H100 cannot hold 7B at O0 without sharding (16 B/param = 104 GB): infeasible, no crash
  pred = cm.predict(cm.parse_cluster("1xH100-SXM"), BIG, 2048, 8, "O0", 0)
  assert not pred.uniform.feasible and not pred.balanced.feasible and pred.speedup is None
  assert "does not fit" in pred.balanced.reason and "H100-SXM" in pred.balanced.reason


def test_zero3_needs_less_memory_than_zero1():
  for level in ("O0", "O2", "O3"):
    z1, z3 = (sm.device_memory(BIG, level, z, 2048, 1, layout=sm.Layout(data=16)).peak
              for z in (1, 3))
    assert z3 < 0.5 * z1, level
  c = cm.parse_cluster(MIXED)
  p1, p3 = (cm.predict(c, MID, 2048, 256, "O2", z, microbatch=4) for z in (1, 3))
  assert p3.uniform.memory["A100-80GB"] < p1.uniform.memory["A100-80GB"]


def test_comm_bytes_gradients_are_f32_unless_fp8_and_stage3_gathers_e4m3():
  kernels, others = BIG.kernel_params, BIG.other_params
  p = kernels + others
  for stage, key in ((0, "grad all-reduce"), (1, "grad all-reduce"),
                     (2, "grad reduce-scatter")):
    o0 = cm.comm_bytes("O0", stage, kernels, others, 1, False)[key]
    o2 = cm.comm_bytes("O2", stage, kernels, others, 1, False)[key]
    fp8 = cm.comm_bytes("O2", stage, kernels, others, 1, False, grad_comm="fp8")[key]
    assert o0 == o2 == 4 * fp8  # the step reduces f32 gradients; E4M3 on request
  assert cm.comm_bytes("O0", 0, kernels, others, 1, False) == {"grad all-reduce": 2 * 4 * p}
  with pytest.raises(ValueError, match="grad_comm='bf16' is not allowed"):
    ci.grad_comm_bytes("O2", "bf16")
  # ZeRO-3, uniform step: per microbatch each layer's weights gathered forward and backward
  # (E4M3 kernels) and its gradients reduce-scattered. Balanced (per-group counts,
  # layer-major): the same collectives once per step, whatever the microbatch counts.
  uni = cm.comm_bytes("O3", 3, kernels, others, 4, False)
  bal = cm.comm_bytes("O3", 3, kernels, others, 4, True)
  assert uni["weight all-gather"] == 8 * (kernels + 2 * others)
  assert uni["grad reduce-scatter"] == 4 * 4 * p
  assert bal == {"grad reduce-scatter": 4 * p, "weight all-gather": 2 * (kernels + 2 * others)}
  # stage 2: the uniform step reduce-scatters per microbatch, the per-group one once
  assert cm.comm_bytes("O2", 2, kernels, others, 4, False)["grad reduce-scatter"] == \
      4 * cm.comm_bytes("O2", 2, kernels, others, 4, True)["grad reduce-scatter"] == 4 * 4 * p


def test_homogeneous_cluster_balanced_equals_uniform():
  for level, stage in (("O2", 0), ("O0", 1), ("O2", 1), ("O3", 1), ("O2", 2), ("O3", 3)):
    p = cm.predict(cm.parse_cluster("8xH100-SXM"), MID, 2048, 64, level, stage, microbatch=2)
    assert p.uniform.counts == p.balanced.counts == (4,) * 8
    assert p.uniform.compute_s == p.balanced.compute_s
    if stage <= 1:
      assert p.speedup == pytest.approx(1.0)
    elif stage == 2:  # only the collectives differ: the balanced loop has none inside
      assert p.balanced.comm_s < p.uniform.comm_s and p.speedup > 1.0
    else:  # the balanced step (layer-major) gathers each layer once per step, not per
      # microbatch: less traffic, and every microbatch's layer inputs held instead
      assert p.balanced.comm_s < p.uniform.comm_s
      assert p.balanced.memory["H100-SXM"] > p.uniform.memory["H100-SXM"]


def test_mixed_cluster_balanced_is_faster_and_a100_runs_fp8_emulated():
  # 7B at ZeRO-1 leaves the per-group step no room on 80 GB (f32 decoded weights, gradients
  # and accumulator: 12 bytes per parameter); at stage 3 it runs layer-major (shards, one
  # layer gathered at a time) and fits, faster than uniform (collectives once per step)
  big = cm.predict(cm.parse_cluster(MIXED), BIG, 2048, 256, "O2", 1)
  assert big.uniform.feasible and not big.balanced.feasible
  assert "does not fit" in big.balanced.reason
  big3 = cm.predict(cm.parse_cluster(MIXED), BIG, 2048, 256, "O2", 3)
  assert big3.uniform.feasible and big3.balanced.feasible and big3.speedup > 1.2
  p = cm.predict(cm.parse_cluster(MIXED), MID, 2048, 256, "O2", 1)
  assert p.uniform.feasible and p.balanced.feasible
  assert p.speedup > 1.5
  assert p.balanced.step_s < p.uniform.step_s
  counts = p.balanced.counts
  assert max(counts[:8]) < min(counts[8:])  # H100s get more microbatches
  assert sum(counts) * p.balanced.microbatch == 256
  assert p.emulated == ("A100-80GB",)
  o0 = cm.predict(cm.parse_cluster(MIXED), BIG, 2048, 256, "O0", 1, microbatch=4)
  o2 = cm.predict(cm.parse_cluster(MIXED), BIG, 2048, 256, "O2", 1, microbatch=4)
  ratio = lambda k: o2.uniform.microbatch_seconds[k] / o0.uniform.microbatch_seconds[k]
  # The token-proportional part scales by the level's factor, the per-microbatch overhead not.
  a = ci.Assumptions()
  for kind, factor in [("A100-80GB", a.emulated_fp8_overhead), ("H100-SXM", 1 / 1.36)]:
    overhead = a.microbatch_overhead_s_per_param * matmul_param_count(BIG_CONFIG) * 4.8e12 / \
        hardware.gpu_spec(kind).hbm_bw
    base = o0.uniform.microbatch_seconds[kind]
    assert ratio(kind) == pytest.approx((factor * (base - overhead) + overhead) / base)
  assert ratio("H100-SXM") < ratio("A100-80GB") < 1
  assert o0.emulated == ()


def test_a_batch_that_does_not_split_equally_has_no_uniform_split():
  p = cm.predict(cm.parse_cluster("2xH100-SXM+1xA100-80GB"), MID, 2048, 5, "O2", 1,
                 microbatch=1)
  assert not p.uniform.feasible and p.speedup is None
  assert p.uniform.reason == ("the global batch of 5 sequences does not split equally over 3 "
                              "GPUs (the uniform split needs a multiple of 3 sequences)")
  assert p.balanced.feasible and sum(p.balanced.counts) == 5
  assert cm.uniform_reason(6, 3) is None and cm.uniform_reason(8, 2, microbatch=4) is None
  assert cm.uniform_reason(8, 4, microbatch=4) == "2 microbatches of 4 do not split equally " \
      "over 4 GPUs"


@pytest.mark.parametrize("batch", [8, 256])
def test_prediction_does_not_depend_on_the_order_of_the_groups(batch):
  a, b = (cm.parse_cluster(c) for c in (MIXED, "8xH100-SXM+8xA100-80GB"))
  for level in ("O0", "O1", "O2", "O3"):
    for stage in (1, 3):
      p, q = (cm.predict(c, MID, 2048, batch, level, stage) for c in (a, b))
      for split in ("uniform", "balanced"):
        x, y = getattr(p, split), getattr(q, split)
        assert x.feasible == y.feasible and x.step_s == y.step_s and x.memory == y.memory
        assert x.idle == y.idle
        if x.feasible:  # the same count for every GPU of a kind, whatever the order
          assert dict(zip(p.kinds, x.counts)) == dict(zip(q.kinds, y.counts))
      assert p.speedup == q.speedup
      assert (p.speedup is None) == (batch == 8)  # 8 sequences cannot cover 16 GPUs


def test_idle_gpus_are_marked_and_hold_their_state_only():
  p = cm.predict(cm.parse_cluster(MIXED), MID, 2048, 8, "O2", 1)
  bal = p.balanced
  assert bal.feasible and bal.idle == ("A100-80GB",)
  assert bal.counts[:8] == (0,) * 8 and sum(bal.counts) == 8
  used = sm.device_memory(MID, "O2", 1, 2048, bal.microbatch, 1, sm.Layout(data=16),
                          emulated=True, local_grads=True)
  # an idle GPU holds its state, its (zero) gradient accumulator and decoded weights, and
  # takes part in the update; no activations
  held = sum(v for k, v in used.backward.items() if k != "activations")
  assert bal.memory["A100-80GB"] == pytest.approx(
      sum(used.state.values()) + max(sum(used.update.values()), held))
  assert bal.memory["A100-80GB"] < bal.memory["H100-SXM"]
  assert bal.memory["H100-SXM"] == pytest.approx(sm.device_memory(
      MID, "O2", 1, 2048, bal.microbatch, 1, sm.Layout(data=16), local_grads=True).peak)
  table = cm.format_table([p])
  assert "A100-80GB:0 (idle) H100-SXM:1" in table and "(idle): GPUs of that kind" in table
  busy = cm.predict(cm.parse_cluster(MIXED), MID, 2048, 256, "O0", 1)
  assert busy.uniform.idle == () and "(idle)" not in cm.format_table([busy])


def _write_profile(path, kind="NVIDIA H100 80GB HBM3", points=None, **changes):
  data = {"format": "fp8jax-profile/1", "device_kind": kind, "compute_capability": "9.0",
          "platform": "gpu", "memory_bytes": 85e9, "level": "O2", "seq_len": 2048,
          "points": points if points is not None else [
              {"microbatch": 1, "seconds": 0.5, "tokens_per_s": 4096.0, "peak_bytes": None,
               "fits": True},
              {"microbatch": 2, "seconds": 0.9, "tokens_per_s": 4551.0, "peak_bytes": None,
               "fits": True},
              {"microbatch": 4, "seconds": 1.0, "tokens_per_s": 0.0, "peak_bytes": None,
               "fits": False}]}
  data.update(changes)
  path.write_text(json.dumps(data))
  return str(path)


def test_profile_replaces_the_flop_estimate(tmp_path):
  prof = cm.load_profile(_write_profile(tmp_path / "h100.json"))
  assert prof == KindProfile("H100-SXM", {1: 0.5, 2: 0.9}, {1: True, 2: True, 4: False})
  c = cm.parse_cluster(MIXED)
  p = cm.predict(c, BIG, 2048, 64, "O2", 1, profiles={"H100-SXM": prof}, microbatch=2)
  assert p.balanced.microbatch_seconds["H100-SXM"] == 0.9
  plain = cm.predict(c, BIG, 2048, 64, "O2", 1, microbatch=2)
  assert plain.balanced.microbatch_seconds["H100-SXM"] != 0.9
  assert p.balanced.microbatch_seconds["A100-80GB"] == \
      plain.balanced.microbatch_seconds["A100-80GB"]
  # a size the profile measured as not fitting is infeasible
  bad = cm.predict(c, BIG, 2048, 64, "O2", 1, profiles={"H100-SXM": prof}, microbatch=4)
  assert not bad.uniform.feasible and "do not admit" in bad.uniform.reason


@pytest.mark.parametrize("changes, match", [
    ({"format": "other/2"}, "format must be 'fp8jax-profile/1'"),
    ({"device_kind": "NVIDIA T4"}, "unknown GPU kind"),
    ({"points": []}, "points must be a non-empty list"),
    ({"points": [{"microbatch": 0, "seconds": 1.0, "fits": True}]}, "microbatch=0"),
    ({"points": [{"microbatch": 1, "seconds": -1.0, "fits": True}]}, "seconds=-1.0"),
    ({"level": "O7"}, "level='O7'"),
])
def test_load_profile_rejects_bad_files(tmp_path, changes, match):
  path = _write_profile(tmp_path / "p.json", **changes)
  with pytest.raises(ValueError, match=match):
    cm.load_profile(path)


def test_bad_arguments_name_the_value():
  c = cm.parse_cluster("8xH100-SXM")
  with pytest.raises(ValueError, match="level 'O5'"):
    cm.predict(c, BIG, 2048, 64, "O5", 1)
  with pytest.raises(ValueError, match="ZeRO stage 4"):
    cm.predict(c, BIG, 2048, 64, "O2", 4)
  with pytest.raises(ValueError, match="stage 0 is not allowed at O3"):
    cm.predict(c, BIG, 2048, 64, "O3", 0)
  with pytest.raises(ValueError, match="microbatch=3"):
    cm.predict(c, BIG, 2048, 64, "O2", 1, microbatch=3)
  with pytest.raises(ValueError, match="overlap=1.5"):
    cm.predict(c, BIG, 2048, 64, "O2", 1, assumptions=ci.Assumptions(overlap=1.5))
  with pytest.raises(ValueError, match=r"attention_impl='flash' is not allowed; use one of "
                     r"\['cudnn', 'xla'\]"):
    dataclasses.replace(BIG, attention_impl="flash")
  with pytest.raises(ValueError, match="n_heads=0 is not allowed with attention_impl='xla'"):
    dataclasses.replace(BIG, attention_impl="xla", n_heads=0)


def test_cli_simulate_prints_the_table(capsys, tmp_path):
  path = _write_profile(tmp_path / "h100.json")
  assert cli.main(["simulate", "--cluster", MIXED, "--config", CONFIG_7B, "--batch", "64",
                   "--levels", "O0,O2", "--zero", "3",
                   "--profile", f"H100-SXM={path}"]) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| O")]
  assert len(rows) == 4  # 2 levels x (uniform, balanced)
  assert "predictions, not measurements" in out and "BF16 MFU 0.547" in out
  assert "FP8 emulated on A100-80GB" in out and "used for that level" in out
  # at ZeRO-3 the balanced step runs layer-major (one layer gathered at a time): both fit
  assert all("infeasible" not in r for r in rows)


def test_pipeline_time_is_set_by_the_slowest_stage():
  """Every tick lasts the slowest stage's microbatch (L_s x its kind's seconds per layer):
  compute k x max_s, bubble the schedule's fill x max_s; the split by stage speed
  (split_layers) beats the even split on A100 + H100 stages, and the even split's step is
  paced by the A100 stage."""
  assert cm.pipeline_step_seconds((2, 6), (3.0, 1.0), 8, "gpipe") == pytest.approx((48.0, 6.0))
  assert cm.pipeline_step_seconds((4, 4), (3.0, 1.0), 8, "1f1b") == pytest.approx((96.0, 24.0))
  assert cm.pipeline_step_seconds((1, 1, 6), (1.0, 1.0, 0.5), 4, "gpipe") == pytest.approx(
      (12.0, 6.0))
  cluster = cm.parse_cluster("4xA100-80GB+4xH100-SXM")
  a = ci.Assumptions()
  p = cm.predict_pipeline(cluster, MID, 2048, 64, "O3", 3, 2, "gpipe", microbatch=2)
  assert cm.stage_kinds(cluster, 2) == [("A100-80GB",), ("H100-SXM",)]
  per_layer = [cm.microbatch_seconds(MID, 2048, 2, "O3", k, a) / 8
               for k in ("A100-80GB", "H100-SXM")]
  assert p.auto.stage_layers == pipeline_split(8, per_layer) and p.auto.stage_layers[0] < 4
  assert p.even.stage_layers == (4, 4)
  for s in (p.auto, p.even):
    assert s.feasible and s.microbatches == 64 // (4 * 2)
    pace = max(n * x for n, x in zip(s.stage_layers, per_layer))
    assert s.stage_seconds == pytest.approx(tuple(n * x for n, x in zip(s.stage_layers,
                                                                        per_layer)))
    assert s.compute_s == pytest.approx(8 * pace) and s.bubble_s == pytest.approx(pace)
    assert s.step_s == pytest.approx(s.compute_s + s.bubble_s + s.comm_s + s.optimizer_s)
  assert p.even.compute_s == pytest.approx(8 * 4 * per_layer[0])  # the A100 stage sets it
  assert p.speedup == pytest.approx(p.even.step_s / p.auto.step_s) and p.speedup > 1.3
  # memory: the auto split's deepest stage during the step, the even split's L/P
  wide = max(p.auto.stage_layers)
  assert p.auto.memory["H100-SXM"] == sm.device_memory(
      MID, "O3", 3, 2048, 2, 8, sm.Layout(4, 1, 2, "gpipe", p.auto.stage_layers), a).peak
  assert wide > 4 and p.auto.memory["H100-SXM"] > p.even.memory["H100-SXM"]
  # a homogeneous cluster splits evenly, at no speed-up
  same = cm.predict_pipeline(cm.parse_cluster("8xH100-SXM"), MID, 2048, 64, "O3", 3, 2)
  assert same.auto.stage_layers == (4, 4) and same.speedup == pytest.approx(1.0)
  given = cm.predict_pipeline(cluster, MID, 2048, 64, "O3", 3, 2, stage_layers=(3, 5))
  assert given.given.stage_layers == (3, 5) and given.given.feasible
  with pytest.raises(ValueError, match="stages=3 is not allowed on 8 GPUs"):
    cm.predict_pipeline(cluster, MID, 2048, 64, "O3", 3, 3)
  with pytest.raises(ValueError, match="do not split 8 layers over 2 stages"):
    cm.predict_pipeline(cluster, MID, 2048, 64, "O3", 3, 2, stage_layers=(3, 3))


def test_cli_simulate_prints_pipeline_rows(capsys):
  argv = ["simulate", "--cluster", "8xA100-80GB+8xH100-SXM", "--config", "configs/gpt_7b.yaml",
          "--batch", "256", "--levels", "O3", "--zero", "3", "--pipeline", "2"]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert "pipeline of 2 stages (gpipe) over 8xA100-80GB+8xH100-SXM" in out
  rows = [line for line in out.splitlines() if line.startswith("| O3 | 3 | 2 (gpipe)")]
  assert len(rows) == 2 and "| auto | 7+25 |" in rows[0] and "| even | 16+16 |" in rows[1]
  assert rows[0].rstrip(" |").endswith("x") and float(rows[0].split("|")[-2][:-2]) > 1.5
  assert cli.main(argv[:-1] + ["3"]) == 2
  assert "stages=3 is not allowed on 16 GPUs" in capsys.readouterr().err
