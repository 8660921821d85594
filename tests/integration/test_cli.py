import os
import shutil
import subprocess
import sys

from fp8jax import cli


def test_check_reports_devices_mode_and_errors(capsys):
  assert cli.main(["check", "--shape", "64", "128", "96", "--steps", "1"]) == 0
  out = capsys.readouterr().out
  assert "cpu" in out and "FP8 GEMMs: emulated" in out
  rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
          if line.strip().startswith(("bf16 ", "fp8 "))}
  fp8_out, bf16_out = float(rows["fp8"][0]), float(rows["bf16"][0])
  assert 3 * bf16_out < fp8_out < 0.08


def test_console_script_is_installed():
  script = shutil.which("fp8jax", path=os.path.dirname(sys.executable)) or shutil.which("fp8jax")
  assert script, "the `fp8jax` console script is not on PATH (pip install -e .)"
  result = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=120)
  assert result.returncode == 0
  assert all(cmd in result.stdout for cmd in ("train", "plot", "check"))
