import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import pytest

import ft_util
from fp8jax import cli


def test_check_reports_devices_mode_and_errors(capsys):
  assert cli.main(["check", "--shape", "64", "128", "96", "--steps", "1"]) == 0
  out = capsys.readouterr().out
  assert "cpu" in out and "FP8 GEMMs: emulated" in out
  rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
          if line.strip().startswith(("bf16 ", "fp8 "))}
  fp8_out, bf16_out = float(rows["fp8"][0]), float(rows["bf16"][0])
  assert 3 * bf16_out < fp8_out < 0.08


def test_warnings_print_as_their_message_alone_while_a_command_runs(capsys):
  """orbax gives the root logger a handler (``WARNING:fp8jax:fp8jax: ...``); a command's
  warnings print as their message alone, once, and the logger is as it was after."""
  import orbax.checkpoint  # noqa: F401 (its import installs the root handler)

  class Records(logging.Handler):
    def __init__(self):
      super().__init__()
      self.seen = []

    def emit(self, record):
      self.seen.append(record.getMessage())

  root, log = logging.getLogger(), logging.getLogger("fp8jax")
  records, handlers = Records(), list(log.handlers)
  root.addHandler(records)
  try:
    with cli.plain_warnings():
      logging.getLogger("fp8jax.train").warning("fp8jax: a warning")
      log.info("fp8jax: a detail")
    assert capsys.readouterr().err == "fp8jax: a warning\n"
    assert records.seen == []  # not printed again by the root's handlers
    assert log.propagate and log.handlers == handlers
    log.warning("fp8jax: outside a command")
    assert records.seen == ["fp8jax: outside a command"]
  finally:
    root.removeHandler(records)


def test_console_script_is_installed():
  script = shutil.which("fp8jax", path=os.path.dirname(sys.executable)) or shutil.which("fp8jax")
  assert script, "the `fp8jax` console script is not on PATH (pip install -e .)"
  result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0
  assert all(cmd in result.stdout for cmd in ("train", "plot", "check"))
  assert "``" not in result.stdout and "--debug" in result.stdout  # plain text (item 9)


# ----------------------------------------------------------------------------- as users meet it
# The real entry point in a subprocess (no terminal: stdout is a pipe), on ft_util's ~20k
# parameter config; one run is shared by the assertions on what a run prints and writes.

def _cli(args, cache=None, timeout=300) -> subprocess.CompletedProcess:
  return ft_util.run([sys.executable, "-m", "fp8jax.cli", *map(str, args)], timeout,
                     env=ft_util.env(cache))


def _no_traceback(result) -> None:
  assert "Traceback" not in result.stderr + result.stdout, result.stderr[-3000:]


def _last_line(text: str) -> str:
  return text.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
  """A persistent compilation cache shared by this module's trainer processes."""
  return tmp_path_factory.mktemp("jax_cache")


def test_a_run_without_a_terminal_logs_lines_and_a_rerun_is_refused(tmp_path, cache):
  cfg = ft_util.tiny_config(tmp_path / "quick.yaml", f"{tmp_path}/{{name}}",
                            train={"steps": 4, "warmup_steps": 20, "log_every": 2},
                            checkpoint={"checkpoint_every_n_steps": 0, "auto_resume": False})
  result = _cli(["train", "--config", cfg], cache)
  assert result.returncode == 0, result.stderr[-3000:]
  _no_traceback(result)
  out, everything = result.stdout, result.stdout + result.stderr
  # a line per log window: step, loss, tokens/s, time left (item 5)
  lines = [line for line in out.splitlines() if line.startswith("step ")]
  assert [line.split()[1] for line in lines] == ["2/4", "4/4"], out
  for line in lines:
    words = line.split()
    assert words[2] == "loss" and float(words[3]) > 0 and words[5] == "tok/s"
    assert words[6] == "ETA" and (words[7] == "?" or words[7].count(":") == 2)
  # warmup longer than the run: clamped with a notice (item 6)
  assert "train.warmup_steps=20 is longer than the run (train.steps=4); warmup clamped to 3" \
      in out
  # FP8 emulation on CPU said once (item 7)
  assert everything.count("emulated") == 1, everything
  # metrics CPU cannot give: said once, with the reason (item 11)
  assert out.count("not logged: mfu (no peak FLOP/s known for device kind 'cpu')") == 1
  events = [json.loads(line) for line in open(tmp_path / "quick" / "events.jsonl")]
  assert {e["metric"] for e in events if e["event"] == "metric_absent"} == {
      "mfu", "mem_gib", "peak_mem_gib"}
  # the same run name again, no checkpoint to resume: refused with the ways out (item 3)
  again = _cli(["train", "--config", cfg], cache)
  assert again.returncode == 2
  _no_traceback(again)
  last = _last_line(again.stderr)
  assert last.startswith(f"fp8jax: error: {tmp_path}/quick already holds a run "
                         "(metrics.jsonl logs steps 2-4)"), last
  assert "--set runtime.name=quick-2" in last and "--overwrite" in last
  assert [json.loads(line)["step"] for line in open(tmp_path / "quick" / "metrics.jsonl")
          if '"loss"' in line] == [2, 4]  # untouched


@pytest.mark.parametrize("args, message", [
    (["--config", "configs/nope.yaml"], "--config configs/nope.yaml: no such file; shipped "
     "configs in"),
    (["--config", "configs/tiny.yaml", "--set", "train.learnig_rate=1e-3"],
     "--set train.learnig_rate=1e-3: train.learnig_rate=0.001 is not a known key; did you "
     "mean 'learning_rate'?"),
    (["--config", "configs/tiny.yaml", "--set", "data.source=no/such/*.txt"],
     "no files matched 'no/such/*.txt'"),
])
def test_user_errors_are_one_line_and_exit_2(args, message):
  result = _cli(["train", *args])
  assert result.returncode == 2, result.stderr[-3000:]
  _no_traceback(result)
  assert _last_line(result.stderr).startswith(f"fp8jax: error: {message}"), result.stderr
  assert "configs/tiny.yaml:" not in result.stderr  # the file is fine: the --set is blamed


def test_train_help_names_the_base_config():
  train = _cli(["train", "--help"])
  assert train.returncode == 0 and "``" not in train.stdout
  assert cli.BASE_CONFIG in train.stdout and os.path.isfile(cli.BASE_CONFIG)
  assert "--overwrite" in train.stdout and "Ctrl-C" in train.stdout


def test_simulate_warns_when_the_batch_cannot_cover_the_gpus():
  # (1.3B: its balanced splits fit, also at ZeRO-3, where they take the whole model)
  result = _cli(["simulate", "--cluster", "8xA100-80GB+8xH100-SXM", "--config",
                 "configs/gpt_1_3b.yaml"])
  assert result.returncode == 0, result.stderr[-3000:]
  assert _last_line(result.stderr).startswith(
      "fp8jax simulate: warning: the global batch of 8 sequences does not split equally over "
      "16 GPUs")
  rows = [line.split("|")[1:4] for line in result.stdout.splitlines()
          if line.startswith("| O")]
  assert {r[0].strip() for r in rows} == {"O0", "O1", "O2", "O3"}
  uniform = [line for line in result.stdout.splitlines() if "| uniform |" in line]
  assert uniform and all("infeasible: the global batch of 8 sequences" in u for u in uniform)
  assert "A100-80GB:0 (idle)" in result.stdout


@pytest.mark.slow
def test_ctrl_c_finishes_the_step_saves_and_resumes(tmp_path, cache):
  """The first Ctrl-C stops after the step in flight with a checkpoint and says how to
  resume (exit 130, no traceback); that resume continues from it."""
  run_dir = tmp_path / "ctrl_c"
  cfg = ft_util.tiny_config(tmp_path / "ctrl_c.yaml", run_dir, train={"steps": 40},
                            checkpoint={"checkpoint_every_n_steps": 1000, "auto_resume": False})
  cmd = [sys.executable, "-m", "fp8jax.cli", "train", "--config", cfg]
  proc = subprocess.Popen(cmd, env=ft_util.env(cache), cwd=ft_util.ROOT,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    ft_util.wait_for_step(run_dir, 3, proc)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 130, err[-3000:]
  assert "Traceback" not in out + err and "KeyboardInterrupt" not in err, err[-3000:]
  assert "received SIGINT: stopping after the current step" in err
  stopped = int(out.split("interrupted: stopped after step ")[1].split(",")[0])
  assert 3 <= stopped < 40
  assert "resume with the same command and --set checkpoint.auto_resume=true" in out
  assert sorted(int(n) for n in os.listdir(run_dir / "checkpoints") if n.isdigit()) == [stopped]
  assert max(s for s, _ in ft_util.losses(run_dir)) == stopped  # nothing logged is lost
  resumed = _cli([*cmd[3:], "--set", "checkpoint.auto_resume=true"], cache)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert f"resumed from step {stopped}" in resumed.stdout
  assert [s for s, _ in ft_util.losses(run_dir)] == list(range(1, 41))


def test_tokenizer_train_and_convert_hf_commands(tmp_path, capsys):
  """`fp8jax tokenizer train` writes a tokenizer of the asked size (in-process); `fp8jax
  convert-hf` of a run that is not of the llama family is one error line, exit 2."""
  out = tmp_path / "tok" / "tokenizer.json"
  assert cli.main(["tokenizer", "train", "--vocab-size", "300", "-o", str(out),
                   "--max-bytes", "100000"]) == 0
  from fp8jax.data import load_tokenizer, tokenizer_vocab_size
  assert tokenizer_vocab_size(load_tokenizer(str(out))) == 300
  assert f"--set data.tokenizer={out}" in capsys.readouterr().out
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.yaml").write_text("model:\n  family: gpt\n")
  assert cli.main(["convert-hf", str(run), str(tmp_path / "hf")]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [f"fp8jax: error: {run} trained model.family='gpt'; the Hugging Face layout is "
                 "written for the llama family"]
