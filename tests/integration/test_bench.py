"""`fp8jax bench` through its entry point on CPU with --small: each subject prints its table
(baselines marked, ratios against them) and writes valid JSON; FP8 variants ran on warm
scales (their error is clearly above BF16's but bounded: cold scales would flush the mean-loss
gradient to zero, error 1); bad input ends in one line with exit 2. Speed is not asserted."""
import json
import sys

import jax
import numpy as np
import pytest

import ft_util
from fp8jax import cli
from fp8jax.bench import comm, mlp


def _seed(key) -> int:
  return int(jax.random.randint(key, (), 0, 2**31 - 1))


def _bench(argv, tmp_path, capsys):
  """(stdout, the JSON document) of ``fp8jax bench ARGV --json ...`` run in-process."""
  path = tmp_path / "bench.json"
  assert cli.main(["bench", *argv, "--json", str(path)]) == 0
  with open(path) as f:
    return capsys.readouterr().out, json.load(f)


def _rows(doc, subject, table=0) -> dict:
  return {r["label"]: r for r in doc["subjects"][subject]["tables"][table]["rows"]}


def _markdown_rows(out: str) -> dict:
  """{label: cells} of the Markdown table rows printed on stdout."""
  rows = {}
  for line in out.splitlines():
    cells = [c.strip() for c in line.strip("|").split("|")]
    if line.startswith("| ") and cells[0] not in ("variant",):
      rows[cells[0]] = cells[1:]
  return rows


def test_mlp_times_bf16_flax_fp8_and_fp8jax_on_warm_scales(key, tmp_path, capsys):
  out, doc = _bench(["mlp", "--small", "--modes", "bf16,flax_fp8,fp8jax",
                     "--seed", str(_seed(key))], tmp_path, capsys)
  printed = _markdown_rows(out)
  assert {"bf16 (baseline)", "flax_fp8 (baseline)", "fp8jax"} <= set(printed)
  assert "speed-up vs bf16" in out and "speed-up vs Flax FP8" in out
  rows = _rows(doc, "mlp")
  assert rows["bf16"]["baseline"] and rows["flax_fp8"]["baseline"] and not rows["fp8jax"][
      "baseline"]
  assert doc["backend"] == "cpu" and doc["subjects"]["mlp"]["seconds"] > 0
  for label, r in rows.items():
    assert r["ms"] > 0 and r["tflops"] > 0
    assert r["x_bf16"] == pytest.approx(rows["bf16"]["ms"] / r["ms"])
    assert r["x_flax"] == pytest.approx(rows["flax_fp8"]["ms"] / r["ms"])
    assert printed[f"{label} (baseline)" if r["baseline"] else label][2] == f"{r['x_bf16']:.2f}"
  # the reference is f32 at HIGHEST precision; 20 seeds: bf16 4.6e-3, FP8 8.6e-2 - 9.2e-2
  bf16 = rows["bf16"]["grad_err"]
  assert 0 < bf16 < 1e-2
  for mode in ("flax_fp8", "fp8jax"):
    assert 5 * bf16 < rows[mode]["grad_err"] < 0.15, mode


def test_mlp_refuses_to_time_cold_scales(monkeypatch):
  """The warm-up guard can fail: without carrying the FP8 state the scales never change."""
  monkeypatch.setattr(mlp, "carry_fp8_state", lambda variables, grads: variables)
  with pytest.raises(RuntimeError, match="FP8 scales not updated"):
    mlp.measure(32, 16, 32, modes=("fp8jax",), iters=1, log=lambda m: None)


@pytest.mark.slow  # two train-step compiles (O0, O2): ~30 s on 2 CPU cores
def test_step_times_o0_against_o2(key, tmp_path, capsys):
  out, doc = _bench(["step", "--small", "--seed", str(_seed(key) % 1000)], tmp_path, capsys)
  printed = _markdown_rows(out)
  assert {"O0 saved (baseline)", "O2 io"} <= set(printed)
  rows = _rows(doc, "step")
  base = rows["O0 saved"]
  assert base["baseline"] and base["x_base"] == 1.0
  o2 = rows["O2 io"]
  assert o2["x_base"] == pytest.approx(o2["tokens_per_s"] / base["tokens_per_s"])
  for r in rows.values():
    assert r["batch"] == 4 and r["ms"] > 0 and r["gib"] > 0 and r["skipped_steps"] == 0
    assert r["tokens_per_s"] == pytest.approx(4 * 32 / (r["ms"] / 1e3))
    assert 0 < r["loss"] < 10  # finite, near ln(256) = 5.5 at the start
    assert r["mfu"] is None  # no peak FLOP/s is known for a CPU


def test_step_reports_a_run_that_runs_out_of_memory_and_goes_on(monkeypatch):
  """A variant that exhausts device memory becomes a note of the table, the other runs are
  still measured; a baseline that does not fit is refused (no ratio without it)."""
  from fp8jax.bench import step as bench_step

  def fake(config, level, overrides, iters, log=print):
    if "train.batch_size=64" in overrides:
      raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to "
                                       "allocate 62.38GiB")
    return {"batch": 8, "ms": 10.0, "tokens_per_s": 1000.0 if level == "O0" else 1500.0,
            "tflops": None, "mfu": None, "gib": 1.0, "loss": 5.0, "compile_s": 1.0,
            "skipped": False, "skipped_steps": 0}
  monkeypatch.setattr(bench_step, "time_run", fake)
  runs = [("O0", "O0", []), ("O2 big", "O2", ["train.batch_size=64"]), ("O2", "O2", [])]
  table = bench_step.measure(None, runs, log=lambda m: None)
  assert [r.label for r in table.rows] == ["O0", "O2"]
  assert table.rows[1].values["x_base"] == pytest.approx(1.5)
  assert any(n.startswith("O2 big: out of device memory (Out of memory while trying")
             for n in table.notes), table.notes
  with pytest.raises(ValueError, match="the baseline run 'O2 big' ran out of device memory"):
    bench_step.measure(None, runs[1:], log=lambda m: None)


def test_optim_times_the_o2_update_against_optax(key, tmp_path, capsys):
  out, doc = _bench(["optim", "--small", "--modes", "optax,clip_optax,clip_o2_fused",
                     "--seed", str(_seed(key))], tmp_path, capsys)
  assert {"optax (baseline)", "clip_optax (baseline)", "clip_o2_fused"} <= set(
      _markdown_rows(out))
  rows = _rows(doc, "optim")
  assert list(rows) == ["optax", "clip_optax", "clip_o2_fused"]  # the order asked for
  for label, base in (("clip_optax", "clip_optax"), ("clip_o2_fused", "clip_optax")):
    r, b = rows[label], rows[base]
    assert r["x_base"] == pytest.approx(r["ms"] / b["ms"])
    assert r["x_base_b2b"] == pytest.approx(r["b2b_ms"] / b["b2b_ms"])
  # the Trainer's O2 update (FP16 master weights, FP8 gradients) against f32 Adam's first step
  # (20 seeds: 6.5e-2 - 6.6e-2); a step that updated nothing would be 1
  assert 0.02 < rows["clip_o2_fused"]["update_err"] < 0.15
  assert rows["clip_optax"]["update_err"] is None and rows["optax"]["x_base"] == 1.0
  # weights + optimizer state + gradients; the state's scalars add a few bytes per tensor
  assert rows["optax"]["bytes_per_param"] == pytest.approx(16, abs=0.01)
  assert rows["clip_o2_fused"]["bytes_per_param"] == pytest.approx(6, abs=0.01)


def test_comm_times_fp8_reduce_scatter_against_bf16(key, tmp_path, capsys):
  out, doc = _bench(["comm", "--small", "--devices", "4", "--seed", str(_seed(key))], tmp_path,
                    capsys)
  assert "4 x cpu" in out and "bf16 psum_scatter (f32 in) (baseline)" in _markdown_rows(out)
  flat, tree = (_rows(doc, "comm", i) for i in (0, 1))  # one size, then the gradient tree
  base = flat[comm.BASELINE]
  # errors against a float64 sum of the ranks' gradients (20 seeds: bf16 2.2e-3 - 2.5e-3,
  # FP8 2.5e-2 - 2.7e-2)
  assert 0 < base["error"] < 1e-2
  for label, r in flat.items():
    assert r["x_base"] == pytest.approx(r["ms"] / base["ms"])
    if label.startswith("fp8"):
      assert 1e-2 < r["error"] < 5e-2, label
  assert flat["fp8 current"]["wire"] == "all-to-all:u8"  # FP8 bits cross the wire as u8
  assert list(tree)[0] == comm.TREE_BASELINE and len(tree) == 6
  assert "3 tensors" in doc["subjects"]["comm"]["tables"][1]["title"]
  assert tree["fp8 delayed, one buffer"]["wire"] == "all-to-all:u8"  # one buffer, one collective
  assert tree["fp8 current per leaf"]["wire"] == "all-to-all:u8x3"
  assert all(r["error"] is None and r["ms"] > 0 for r in tree.values())


def test_comm_on_one_device_says_so_and_skips(tmp_path, capsys):
  out, doc = _bench(["comm", "--small", "--devices", "1"], tmp_path, capsys)
  assert "comm: skipped: needs >= 2 devices, given 1 cpu" in out
  assert doc["subjects"]["comm"]["skipped"].startswith("needs >= 2 devices")


@pytest.mark.parametrize("argv, message", [
    (["mlp", "--iters", "0"], "bench mlp: --iters 0: must be >= 1"),
    (["mlp", "--modes", "bf16,fp4"], "bench mlp: --modes 'bf16,fp4': unknown mode 'fp4'"),
    (["mlp", "--small", "--tokens", "-1"], "bench mlp: --tokens -1: must be >= 1"),
    (["optim", "--modes", "adam"], "bench optim: --modes 'adam': unknown mode 'adam'"),
    (["step", "--run", "O2"], "bench step: --run 'O2': use LABEL=LEVEL"),
    (["step", "--config", "no/such.yaml"], "bench step: --config no/such.yaml: no such file"),
    (["step", "--small", "--run", "a=O9"], "bench step: run 'a': --set train.opt_level=O9: "),
    (["step", "--small", "--run", "a=O0", "--run", "a=O2"], "bench step: --run labels"),
    (["comm", "--sizes-mib", "1,x"], "bench comm: --sizes-mib '1,x': use whole MiB >= 1"),
    (["comm", "--devices", "99"], "bench comm: --devices 99: this process has 8 local"),
    (["all", "--seed", "-3"], "bench all: --seed -3: must be >= 0"),
])
def test_bad_values_end_in_one_line_with_exit_2(argv, message, capsys):
  assert cli.main(["bench", *argv]) == 2
  captured = capsys.readouterr()
  err = captured.err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"fp8jax: error: {message}"), err
  assert captured.out == ""  # refused before anything runs


@pytest.mark.parametrize("argv, message", [
    (["nope"], "invalid choice: 'nope'"),
    (["mlp", "--iters", "many"], "argument --iters: invalid int value: 'many'"),
    (["optim", "--tokens", "4"], "unrecognized arguments: --tokens 4"),
])
def test_bad_subjects_and_flags_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["bench", *argv])
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_the_entry_point_honours_jax_num_cpu_devices(tmp_path):
  path = tmp_path / "comm.json"
  result = ft_util.run([sys.executable, "-m", "fp8jax.cli", "bench", "comm", "--small",
                        "--json", str(path)], 120, env=ft_util.env(JAX_NUM_CPU_DEVICES=1))
  assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
  assert "comm: skipped: needs >= 2 devices, found 1 cpu (on CPU: JAX_NUM_CPU_DEVICES=8)" \
      in result.stdout
  with open(path) as f:
    assert json.load(f)["devices"] == ["cpu"]


def test_mlp_block_step_keeps_all_six_gemms(key):
  """The block step returns its output, so its forward's second GEMM is not dead code: six
  dots in the compiled program (forward 2, input gradients 2, weight gradients 2)."""
  t, d, f = mlp.SMALL_SHAPE
  x = jax.random.normal(key, (t, d)).astype(jax.numpy.bfloat16)
  net = mlp.make_model("bf16", f, d)
  variables = net.init(key, x)
  hlo = mlp.block_step(net).lower(variables, x, x).compile().as_text()
  assert hlo.count(" dot(") == 6, [line for line in hlo.splitlines() if " dot(" in line]
  dv, dx, y = mlp.block_step(net)(variables, x, x)
  assert y.shape == x.shape and dx.shape == x.shape


def test_mlp_tn_gemms_compute_the_same_products(key):
  """gemms_fp8_tn (every operand laid out K-major beforehand) multiplies exactly what
  gemms_fp8 multiplies, output for output (FP8 products summed in f32, bf16 outputs)."""
  t, d, f = mlp.SMALL_SHAPE
  kx, kp, kg = jax.random.split(key, 3)
  x = jax.random.normal(kx, (t, d)).astype(jax.numpy.bfloat16)
  params = mlp.MLP(f, d).init(kp, x)["params"]
  args = mlp.gemm_operands("gemms_fp8", x, params, kg)
  plain = mlp.gemms_step(jax.numpy.bfloat16)(*args)
  tn = mlp.gemms_tn_step(False)(*mlp.tn_operands(args))
  for a, b in zip(plain, tn, strict=True):
    assert a.shape == b.shape and float(jax.numpy.max(jax.numpy.abs(a.astype(float)))) > 0
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-2,
                               atol=1e-6)


def test_mlp_rowwise_modes(key):
  """The row-wise block modes run on warm FP8 state with FP8-level gradient error; the
  gemms_fp8_rowwise GEMMs are gemms_fp8_f32out's products scaled per row and column."""
  table = mlp.measure(*mlp.SMALL_SHAPE, modes=("bf16", "fp8jax_rowwise",
                                               "fp8jax_rowwise_torchao"),
                      iters=1, seed=_seed(key), log=lambda m: None)
  bf16 = table.row("bf16").values["grad_err"]
  for mode in ("fp8jax_rowwise", "fp8jax_rowwise_torchao"):
    assert 5 * bf16 < table.row(mode).values["grad_err"] < 0.15, mode
  t, d, f = mlp.SMALL_SHAPE
  kx, kp, kg = jax.random.split(key, 3)
  x = jax.random.normal(kx, (t, d)).astype(jax.numpy.bfloat16)
  args = mlp.gemm_operands("gemms_fp8", x, mlp.MLP(f, d).init(kp, x)["params"], kg)
  plain = mlp.gemms_step(jax.numpy.float32)(*args)
  scaled_args = mlp.rowwise_operands(args, kg)
  s_t, s_d, s_f = scaled_args[-3:]
  pairs = ((s_t, s_f), (s_t, s_d), (s_t, s_f), (s_t, s_d), (s_f, s_d), (s_d, s_f))
  for a, b, (sa, sb) in zip(plain, mlp.gemms_rowwise_step()(*scaled_args), pairs, strict=True):
    np.testing.assert_allclose(np.asarray(b, np.float32),
                               np.asarray(a, np.float32) * sa[:, None] * sb[None, :],
                               rtol=1e-2, atol=1e-6)


def test_mlp_op_mode_is_the_same_block(key):
  """fp8jax_mlp_op (the block as one fp8_mlp_chained op, through fp8jax.linen.dense_mlp as in
  the models) has the block's variable trees and computes what fp8jax_gelu_in_cast computes
  (the same quantized math; only where GELU's derivative is applied differs), with all six
  GEMMs in the program; only it runs the one op."""
  t, d, f = mlp.SMALL_SHAPE
  kx, kc, kp = jax.random.split(key, 3)
  x = jax.random.normal(kx, (t, d)).astype(jax.numpy.bfloat16)
  ct = (jax.random.normal(kc, (t, d)) / (t * d)).astype(jax.numpy.bfloat16)
  params = mlp.MLP(f, d).init(kp, x)["params"]
  out, trees = {}, {}
  for mode in (mlp.GELU_IN_CAST, mlp.MLP_OP):
    compiled, variables = mlp.warm_block(mode, x, ct, params, kp)
    net = mlp.make_model(mode, f, d)
    ops = str(jax.make_jaxpr(net.apply)(variables, x)).count("_fp8_mlp")
    assert (ops > 0) == (mode == mlp.MLP_OP)
    dv, dx, y = compiled(variables, x, ct)
    trees[mode] = variables
    out[mode] = (y, dx, dv["params"]["Dense_0"]["kernel"], dv["params"]["Dense_1"]["kernel"])
    assert compiled.as_text().count(" dot(") == 6
  assert jax.tree.structure(trees[mlp.MLP_OP]) == jax.tree.structure(trees[mlp.GELU_IN_CAST])
  for a, b in zip(out[mlp.MLP_OP], out[mlp.GELU_IN_CAST], strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    assert float(np.max(np.abs(b))) > 0
    np.testing.assert_allclose(a, b, rtol=0.1, atol=0.02 * float(np.max(np.abs(b))))
